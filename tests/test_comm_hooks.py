"""DDP communication hooks (--ddp-comm-hook): fp16/bf16 compression and PowerSGD, whose per-rank state (error
feedback, warm-started factors) is saved in each checkpoint so that a resume is bitwise."""

import shutil

import pytest
import torch
from helpers import assert_clean_error, assert_same_weights, check_ok, launch, run_script, weights

PROBE = "tests/probe.py"
# 96 samples, 2 ranks x batch 4: 24 steps; PowerSGD compresses from step 3
ARGS = ["--dropout", "0", "--train-size", 96, "--val-size", 23, "--epochs", 2, "--mixed-precision", "no"]
# 400,000 parameters: DDP splits them into two gradient buckets after the first step (its first bucket holds 1 MB),
# which over gloo hung PowerSGD until it was given one bucket; a hang ends the run within 60 s (the watchdog)
POWERSGD = ["--ddp-comm-hook", "powersgd", "--powersgd-start-step", 2, "--checkpointing-steps", 5, "--hidden", 40000]
POWERSGD += ["--hang-timeout-s", 60]
inprocess, multiprocess = pytest.mark.inprocess, pytest.mark.multiprocess


def two_processes(output_dir, *args):
    return check_ok(launch(PROBE, "--output-dir", output_dir, *ARGS, "--batch-size", 4, *args))


@multiprocess
def test_powersgd_s_state_is_saved_per_rank_and_a_resume_continues_bitwise(tmp_path):
    # DDP lays its gradient buckets out again after a process's first step, so the resumed process starts with
    # another layout than the state was saved in: it is kept by parameter and laid out again (comm_hooks.PowerSGD)
    output = two_processes(tmp_path / "full", *POWERSGD)
    assert "ddp_comm_hook                PowerSGD rank 1 from step 3" in output, output[:3000]
    step_10 = tmp_path / "full" / "checkpoints" / "step_10"
    assert (step_10 / "comm_hook_state_0.pt").is_file() and (step_10 / "comm_hook_state_1.pt").is_file()
    saved = torch.load(step_10 / "comm_hook_state_1.pt", weights_only=False)["states"][0]
    assert saved["iter"] == 10 and {"error", "p", "q"} <= set(saved["by_parameter"]["0.weight"])
    shutil.copytree(step_10, tmp_path / "cut" / "checkpoints" / "step_10")
    shutil.copy(tmp_path / "full" / "history.json", tmp_path / "cut" / "history.json")
    resumed = two_processes(tmp_path / "cut", *POWERSGD, "--resume-from-checkpoint", "latest")
    assert "resumed from" in resumed and "PowerSGD starts afresh" not in resumed, resumed[-3000:]
    assert_same_weights(tmp_path / "cut", tmp_path / "full")  # bitwise
    plain = weights(tmp_path / "full")
    assert plain["0.weight"].abs().sum() > 0  # (trained)


@multiprocess
def test_bf16_compression_trains_as_the_plain_all_reduce_to_bf16_rounding(tmp_path):
    output = two_processes(tmp_path / "bf16", "--ddp-comm-hook", "bf16")
    assert "ddp_comm_hook                bf16 compression of the gradients' all-reduce" in output, output[:3000]
    check_ok(run_script(PROBE, "--output-dir", tmp_path / "one", *ARGS, "--batch-size", 8))
    compressed, exact = weights(tmp_path / "bf16"), weights(tmp_path / "one")
    for name in exact:
        assert torch.allclose(compressed[name], exact[name], atol=2e-3), name


@inprocess
def test_a_hook_where_it_cannot_apply_is_one_line(tmp_path):
    one_process = run_script(PROBE, "--output-dir", tmp_path / "a", "--ddp-comm-hook", "fp16")
    assert_clean_error(one_process, "--ddp-comm-hook fp16: one process communicates nothing")
    fsdp = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    sharded = run_script(PROBE, "--output-dir", tmp_path / "b", "--ddp-comm-hook", "powersgd", env=fsdp)
    assert_clean_error(sharded, "--ddp-comm-hook powersgd compresses DDP's all-reduce: FSDP does not use it")
    orphan = run_script(PROBE, "--output-dir", tmp_path / "c", "--powersgd-rank", 2)
    assert_clean_error(orphan, "--powersgd-rank: only with --ddp-comm-hook powersgd")
    assert not any((tmp_path / name).exists() for name in "abc")


class Keeper:
    """Stands for comm_hooks.PowerSGD in load_states: what it is given."""

    def __init__(self):
        self.given = None

    def load_state_dict(self, values, feedback=True):
        self.given = (values["iter"], values["rng"], feedback)
        return []


@inprocess
def test_on_another_world_size_every_rank_takes_rank_0_s_step_count_and_generator(tmp_path):
    # the ranks must compress from the same step with the same random factors, or their all-reduces differ in size
    # (a rank with no file of its own, grown by an elastic restart, used to start at step 0 alone)
    from ddp_accel import comm_hooks

    state = {"iter": 12, "rng": "rank 0's", "matrix_approximation_rank": 1, "by_parameter": {}}
    torch.save({"world_size": 2, "states": [state]}, tmp_path / "comm_hook_state_0.pt")
    torch.save({"world_size": 2, "states": [{**state, "rng": "rank 1's"}]}, tmp_path / "comm_hook_state_1.pt")
    same = [Keeper(), Keeper()]
    assert comm_hooks.load_states([same[0]], tmp_path, 0, 2) is None
    assert comm_hooks.load_states([same[1]], tmp_path, 1, 2) is None
    assert [keeper.given for keeper in same] == [(12, "rank 0's", True), (12, "rank 1's", True)]
    grown = [Keeper() for _ in range(3)]
    notes = [comm_hooks.load_states([keeper], tmp_path, rank, 3) for rank, keeper in enumerate(grown)]
    assert all("error feedback starts afresh" in note for note in notes), notes
    assert [keeper.given for keeper in grown] == [(12, "rank 0's", False)] * 3


class DdpModel:
    """What comm_hooks.PowerSGD needs of a DDP model: its module and a hook to register (no process group)."""

    def __init__(self, module):
        self.module = module

    def register_comm_hook(self, state, hook):
        pass


@inprocess
def test_what_a_resume_changes_of_powersgd_is_said_in_one_line_and_stale_feedback_is_dropped(tmp_path):
    # resumed with another hook, another rank, or a start step that turns compression off again: PowerSGD's state
    # was dropped or kept without a word (stale error feedback applied once compression came back)
    from ddp_accel import comm_hooks

    model = DdpModel(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 2)))
    saved = comm_hooks.PowerSGD(model, rank=2, start_step=2)
    saved.state.iter = 10
    values = {**saved.state_dict(), "by_parameter": {"0.weight": {"error": torch.ones(64 * 32)}}}
    other_rank = comm_hooks.PowerSGD(model, rank=4, start_step=2)
    assert other_rank.load_state_dict(values) == ["PowerSGD's rank 2 -> 4: its factors start afresh"]
    assert other_rank.pending is not None  # the error feedback goes on
    later = comm_hooks.PowerSGD(model, rank=2, start_step=50)
    notes = later.load_state_dict(values)
    assert notes == [
        "PowerSGD compressed from step 3; now off until step 51, and its error feedback starts afresh then"
    ]
    assert later.pending is None
    same = comm_hooks.PowerSGD(model, rank=2, start_step=2)
    assert same.load_state_dict(values) == [] and same.pending is not None
    torch.save({"world_size": 1, "states": [values]}, tmp_path / "comm_hook_state_0.pt")
    note = comm_hooks.load_states([], tmp_path, 0, 1)  # resumed without PowerSGD
    assert note and "left unused: this run does not compress with PowerSGD" in note
    # the banner of a PowerSGD that would never compress
    assert comm_hooks.PowerSGD(model, rank=100_000, start_step=2).compressed() == 0 and same.compressed() == 1
    never = comm_hooks.describe("powersgd", 2, 500, total_steps=24, compressed=2)
    assert never == "PowerSGD rank 2 from step 501: never, in this run's 24 steps (every step a plain all-reduce)"
    too_large = comm_hooks.describe("powersgd", 100_000, 2, total_steps=24, compressed=0)
    assert too_large.endswith("no matrix of the model is larger than that rank (every step a plain all-reduce)")


@inprocess
def test_a_hook_is_refused_for_sparse_gradients_in_one_line(tmp_path):
    from ddp_accel import comm_hooks
    from ddp_accel.errors import UserError

    bag = torch.nn.EmbeddingBag(10, 4, sparse=True)
    with pytest.raises(UserError, match="sparse ones"):
        comm_hooks.check_model(torch.nn.Sequential(bag), "bf16")
    comm_hooks.check_model(torch.nn.Sequential(bag), "none")

"""The ddp_accel loop, run for real on 1 and 2 CPU processes (gloo) through tests/probe.py."""

import json
import re
import shutil
import subprocess

import pytest
import torch
from helpers import (
    BIN,
    ROOT,
    SHORT_PROBE_ARGS,
    assert_clean_error,
    assert_same_weights,
    check_ok,
    launch,
    metrics_of,
    run_script,
    weights,
)
from probe import ComplexLinear

from ddp_accel.endings import OUT_OF_MEMORY_ADVICE

PROBE = "tests/probe.py"
inprocess, multiprocess = pytest.mark.inprocess, pytest.mark.multiprocess
# the shared 2-process job: 40 samples, 2 ranks x batch 4 (5 steps an epoch), 2 epochs, 23 validation samples
SHARED = ["--batch-size", 4, "--epochs", 2, "--train-size", 40, "--val-size", 23]


def probe(output_dir, *args, nproc=2, launcher="accelerate"):
    """tests/probe.py on `nproc` processes (launched), or on one in this process."""
    args = ["--output-dir", output_dir, "--dropout", "0", *args]
    if nproc == 1:
        return check_ok(run_script(PROBE, *args))
    return check_ok(launch(PROBE, *args, nproc=nproc, launcher=launcher))


@pytest.fixture(scope="module")
def two_process_job(tmp_path_factory):
    """One 2-process run that several tests read (read-only); it keeps its 2 newest checkpoints of steps 3, 6, 9."""
    output_dir = tmp_path_factory.mktemp("two_process_job")
    probe(output_dir, *SHARED, "--checkpointing-steps", 3, "--checkpoint-limit", 2)
    return output_dir


@multiprocess
def test_one_process_2b_equals_two_processes_b(tmp_path, two_process_job):
    probe(tmp_path / "one", *SHARED[2:], "--batch-size", 8, nproc=1)
    one, two = (metrics_of(d) for d in (tmp_path / "one", two_process_job))
    assert one["steps"] == two["steps"] == 10
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert_same_weights(tmp_path / "one", two_process_job, atol=1e-6)


@multiprocess
def test_sparse_and_complex_gradients_train_the_same_on_one_and_two_processes_and_resume_bitwise(tmp_path):
    # One model, two all-reduces the classic recipe leaves alone: an EmbeddingBag's sparse gradient (gloo; its
    # SparseAdamW decays only the rows a batch touched) and a complex64 layer's gradient, all-reduced as complex
    # numbers (AdamW accepts complex parameters; fused AdamW does not): 1 x 2B == 2 x B, and resume is exact.
    common = ["--sparse-embedding", "--complex", "--epochs", 2, "--lr", "0.01"]
    probe(tmp_path / "one", *common, "--batch-size", 8, nproc=1)
    probe(tmp_path / "two", *common, "--batch-size", 4, "--checkpointing-steps", 5)
    trained = weights(tmp_path / "one")
    initial = ComplexLinear(16, 16).weight.detach()
    assert trained["1.weight"].dtype == torch.complex64 and (trained["1.weight"] - initial).imag.abs().max() > 1e-3
    assert trained["0.table.weight"].dtype == torch.float32  # the table trained beside it (compared below)
    assert_same_weights(tmp_path / "one", tmp_path / "two", atol=1e-6)
    shutil.copytree(tmp_path / "two" / "checkpoints" / "step_5", tmp_path / "cut" / "checkpoints" / "step_5")
    probe(
        tmp_path / "cut", *common, "--batch-size", 4, "--checkpointing-steps", 5, "--resume-from-checkpoint", "latest"
    )
    assert_same_weights(tmp_path / "two", tmp_path / "cut", atol=None)


@inprocess
def test_the_shared_optimizer_option_builds_each_optimizer_and_a_nesterov_sgd_run_resumes_bitwise(tmp_path):
    from argparse import Namespace

    from ddp_accel import make_optimizer

    weights_ = [torch.nn.Parameter(torch.ones(2))]
    shared = dict(lr=0.1, momentum=0.8, nesterov=False, weight_decay=None, betas=(0.8, 0.9))
    built = {
        name: make_optimizer(weights_, Namespace(**shared, optimizer=name)) for name in ("sgd", "adamw", "rmsprop")
    }
    assert type(built["sgd"]) is torch.optim.SGD and built["sgd"].defaults["momentum"] == 0.8
    assert type(built["adamw"]) is torch.optim.AdamW and built["adamw"].defaults["betas"] == (0.8, 0.9)
    assert type(built["rmsprop"]) is torch.optim.RMSprop and built["rmsprop"].defaults["momentum"] == 0.8
    assert make_optimizer(weights_, Namespace(**shared | {"nesterov": True}, optimizer="sgd")).defaults["nesterov"]

    # SGD with Nesterov's momentum: its momentum buffers are in the checkpoint, the resume is bitwise
    common = ["--batch-size", 8, "--epochs", 2, "--train-size", 48, "--dropout", "0.3", "--checkpointing-steps", 3]
    common += ["--optimizer", "sgd", "--nesterov", "--lr", "0.05"]
    probe(tmp_path / "full", *common, nproc=1)
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_3", tmp_path / "cut" / "checkpoints" / "step_3")
    probe(tmp_path / "cut", *common, "--resume-from-checkpoint", "latest", nproc=1)
    assert_same_weights(tmp_path / "full", tmp_path / "cut", atol=None)
    # a resume under another optimizer is refused by the checkpoint's identity (SGD's state is not AdamW's)
    continued = [*common[:-5], "--epochs", 3, "--resume-from-checkpoint", "latest"]  # the run goes on, as AdamW
    result = run_script(PROBE, "--output-dir", tmp_path / "cut", *continued)
    assert_clean_error(result, "another optimizer (SGD(4 params, momentum on); this run makes AdamW(4 params")
    # Nesterov without SGD's momentum: one line before anything starts
    result = run_script(PROBE, "--output-dir", tmp_path / "bad", "--optimizer", "adamw", "--nesterov")
    assert_clean_error(result, "--nesterov is SGD's, with momentum: it needs --optimizer sgd and --momentum above 0")


@inprocess
def test_sparse_adamw_is_sparse_adam_plus_decay_of_the_touched_rows():
    from ddp_accel.optim import SparseAdamW

    torch.manual_seed(0)
    tables = [torch.nn.Embedding(50, 4, sparse=True) for _ in range(3)]
    for table in tables[1:]:
        table.load_state_dict(tables[0].state_dict())
    ours, decayed = (
        SparseAdamW(tables[0].parameters(), lr=0.1),
        SparseAdamW(tables[2].parameters(), lr=0.1, weight_decay=0.5),
    )
    reference = torch.optim.SparseAdam(tables[1].parameters(), lr=0.1)
    for step in range(6):
        # rows 20..49 are never touched; repeated ids sum their gradients; distinct increasing ids (what the bag's
        # distinct-row lookup gives) are taken as they are
        ids = torch.randint(0, 20, (8, 3)) if step % 2 else torch.randperm(20)[:12].sort().values.view(4, 3)
        for table, optimizer in zip(tables, (ours, reference, decayed), strict=False):
            optimizer.zero_grad()
            (table(ids) ** 2).sum().backward()
            before = table.weight.detach().clone()
            optimizer.step()
        assert torch.allclose(tables[0].weight, tables[1].weight, atol=1e-6)
        assert torch.equal(tables[2].weight[20:], before[20:])  # untouched rows: no decay either
    assert not torch.allclose(tables[0].weight[:20], tables[2].weight[:20])


@inprocess
def test_one_gradient_scaler_unscales_the_sparse_and_dense_gradients_once():
    # fp16 with two optimizers (accelerate#439): as one Optimizers, clip_grad_norm_'s unscale_ and the step's
    # must not divide twice; the sparse table gradient is unscaled like the dense one
    from ddp_accel.optim import Optimizers, SparseAdamW

    torch.manual_seed(0)
    table, head = torch.nn.Embedding(20, 4, sparse=True), torch.nn.Linear(4, 1)
    ids = torch.tensor([1, 2, 2, 5])
    head(table(ids)).sum().backward()
    expected = table.weight.grad.to_dense().clone(), head.weight.grad.clone()
    table.zero_grad(), head.zero_grad()
    optimizer = Optimizers(SparseAdamW(table.parameters(), lr=0.1), torch.optim.AdamW(head.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(head(table(ids)).sum()).backward()
    scaler.unscale_(optimizer)  # what accelerator.clip_grad_norm_ does first
    scaler.step(optimizer)
    scaler.update()
    assert torch.allclose(table.weight.grad.to_dense(), expected[0]) and torch.allclose(head.weight.grad, expected[1])
    assert scaler.get_scale() == 1024.0  # no overflow seen, no step skipped


@inprocess
def test_an_lr_schedule_reaches_both_optimizers_after_prepare_and_a_state_load():
    # Accelerate's prepare (and a resume) load a state dict into the inner optimizers, which replaces their group
    # dicts: a schedule that kept scaling the old dicts left imdb.py's sparse bag at its peak LR for the whole run
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from ddp_accel.optim import Optimizers, SparseAdamW

    table, head = torch.nn.Embedding(20, 4, sparse=True), torch.nn.Linear(4, 1)
    optimizer = Optimizers(SparseAdamW(table.parameters(), lr=0.1), torch.optim.AdamW(head.parameters(), lr=0.1))
    accelerator = Accelerator(cpu=True)
    try:
        prepared = accelerator.prepare(optimizer)
        scheduler = torch.optim.lr_scheduler.LambdaLR(prepared, lambda step: 1 / (step + 1))
        scheduler.step()
        inner = lambda: [group["lr"] for inner in optimizer.optimizers for group in inner.param_groups]  # noqa: E731
        assert inner() == [0.05, 0.05]
        optimizer.load_state_dict(optimizer.state_dict())  # a resume's load
        scheduler.step()
        assert inner() == pytest.approx([0.1 / 3] * 2) and scheduler.get_last_lr() == pytest.approx([0.1 / 3] * 2)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@multiprocess
def test_gradient_accumulation_matches_big_batch(tmp_path):
    probe(tmp_path / "big", "--batch-size", 8, "--epochs", 2, nproc=1)
    probe(tmp_path / "accum", "--batch-size", 4, "--gradient-accumulation-steps", 2, "--epochs", 2, nproc=1)
    assert_same_weights(tmp_path / "big", tmp_path / "accum", atol=1e-6)
    # and across processes: 2 ranks x batch 2 x accumulation 2 == 1 rank x batch 8
    probe(tmp_path / "both", "--batch-size", 2, "--gradient-accumulation-steps", 2, "--epochs", 2, nproc=2)
    assert_same_weights(tmp_path / "big", tmp_path / "both", atol=1e-6)


@multiprocess
def test_ranks_see_disjoint_shards_and_epochs_reshuffle(two_process_job):
    seen = [json.loads((two_process_job / f"seen_rank{rank}.json").read_text()) for rank in (0, 1)]
    per_epoch = 40 // (4 * 2)  # batches per rank per epoch
    epochs = []
    for epoch in range(2):
        shards = [
            {i for batch in rank_batches[epoch * per_epoch : (epoch + 1) * per_epoch] for i in batch}
            for rank_batches in seen
        ]
        assert not shards[0] & shards[1], "ranks saw the same sample in one epoch"
        assert shards[0] | shards[1] == set(range(40)), "an epoch did not cover the dataset"
        epochs.append([i for batch in seen[0][epoch * per_epoch : (epoch + 1) * per_epoch] for i in batch])
    assert epochs[0] != epochs[1], "epoch 2 repeated epoch 1's order: set_epoch not applied"


@multiprocess
def test_eval_counts_every_sample_exactly_once(two_process_job):
    # 23 validation samples, batch 4, 2 ranks: the sharded loader pads the last batch; metrics must not.
    metrics = metrics_of(two_process_job)
    assert metrics["eval_samples"] == 23
    assert metrics["eval_unique_ids"] == 23
    assert metrics["eval_id_sum"] == sum(range(23))


@multiprocess
def test_resume_mid_epoch_gives_identical_weights(tmp_path, short_job):
    # dropout on: resume must also restore every rank's RNG state; the LR schedule must continue too
    checkpoints = sorted((short_job / "checkpoints").iterdir())  # the whole run's: 2 epochs of 12 steps
    assert [p.name for p in checkpoints] == ["step_10", "step_15", "step_20", "step_5"]
    # a run that died after step 5 (mid-epoch 0) left only step_5
    shutil.copytree(short_job / "checkpoints" / "step_5", tmp_path / "cut" / "checkpoints" / "step_5")
    output = probe(tmp_path / "cut", *SHORT_PROBE_ARGS, "--resume-from-checkpoint", "latest")
    assert "resumed from" in output and "step 5, epoch 0" in output
    assert_same_weights(short_job, tmp_path / "cut", atol=None)


@multiprocess
def test_checkpoint_limit_keeps_newest(two_process_job):
    assert sorted(p.name for p in (two_process_job / "checkpoints").iterdir()) == ["step_6", "step_9"]


@inprocess
def test_latest_without_checkpoint_starts_fresh(tmp_path):
    output = probe(tmp_path, "--batch-size", 4, "--max-steps", 3, "--resume-from-checkpoint", "latest", nproc=1)
    assert "resumed from" not in output
    assert metrics_of(tmp_path)["steps"] == 3


@inprocess
def test_incomplete_checkpoint_is_ignored_by_latest(tmp_path):
    probe(tmp_path, "--batch-size", 4, "--max-steps", 4, "--checkpointing-steps", 2, nproc=1)
    # a save that crashed: its files are in .tmp_step_N, or step_N lacks training_state.json
    shutil.copytree(tmp_path / "checkpoints" / "step_4", tmp_path / "checkpoints" / ".tmp_step_6")
    shutil.copytree(tmp_path / "checkpoints" / "step_4", tmp_path / "checkpoints" / "step_8")
    (tmp_path / "checkpoints" / "step_8" / "training_state.json").unlink()
    output = probe(tmp_path, "--batch-size", 4, "--max-steps", 6, "--resume-from-checkpoint", "latest", nproc=1)
    assert "resumed from" in output and "step_4" in output


@inprocess
def test_tracking_writes_tensorboard_events(tmp_path):
    probe(tmp_path, "--batch-size", 4, "--max-steps", 4, "--log-steps", 2, "--with-tracking", nproc=1)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))  # OUTPUT_DIR/tensorboard/, as documented


@inprocess
def test_a_damaged_newest_checkpoint_falls_back_and_an_explicit_one_is_an_error(tmp_path):
    common = ["--batch-size", 4, "--epochs", 2, "--checkpointing-steps", 4]
    probe(tmp_path / "full", *common, nproc=1)
    shutil.copytree(tmp_path / "full" / "checkpoints", tmp_path / "cut" / "checkpoints")
    for later in (tmp_path / "cut" / "checkpoints").glob("step_*"):
        if int(later.name[5:]) > 8:  # a run that stopped after step 8's checkpoint
            shutil.rmtree(later)
    damaged = tmp_path / "cut" / "checkpoints" / "step_8" / "random_states_0.pkl"
    damaged.write_bytes(damaged.read_bytes()[:100])  # truncated: Accelerate alone would only log it
    step_8 = tmp_path / "cut" / "checkpoints" / "step_8"
    result = run_script(PROBE, "--output-dir", tmp_path / "cut", *common, "--resume-from-checkpoint", step_8)
    assert_clean_error(result, "step_8 is damaged", "random_states_0.pkl")
    output = probe(tmp_path / "cut", *common, "--resume-from-checkpoint", "latest", nproc=1)
    assert "step_8 is damaged (random_states_0.pkl has 100 bytes" in output and "resumed from" in output
    assert "step 4, epoch 0" in output  # the one before it
    assert_same_weights(tmp_path / "full", tmp_path / "cut", atol=None)


@inprocess
def test_resume_with_another_batch_size_skips_by_samples_and_says_so(tmp_path):
    probe(tmp_path / "full", "--batch-size", 4, "--epochs", 1, "--checkpointing-steps", 5, nproc=1)
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_5", tmp_path / "cut" / "checkpoints" / "step_5")
    output = probe(tmp_path / "cut", "--batch-size", 8, "--epochs", 1, "--resume-from-checkpoint", "latest", nproc=1)
    # 5 batches of 4 = 20 samples seen; batches of 8: skip 2 (16 samples), the last 4 are seen again
    assert "global batch changed from 4 to 8" in output and "4 of them are seen again" in output, output[-2000:]
    assert "resumed from" in output and "step 2, epoch 0" in output  # steps of 8 samples from here on
    order = [i for batch in json.loads((tmp_path / "full" / "seen_rank0.json").read_text()) for i in batch]
    resumed = json.loads((tmp_path / "cut" / "seen_rank0.json").read_text())
    assert resumed[0] == order[16:24] and [i for b in resumed for i in b] == order[16:]


@inprocess
def test_a_checkpoint_is_renamed_into_place_only_once_complete(tmp_path, monkeypatch):
    # a save that fails while training_state.json is written leaves no step_N folder
    from pathlib import Path

    from accelerate import Accelerator

    from ddp_accel.checkpoint import TRAINING_STATE, complete_checkpoints, save_checkpoint
    from ddp_accel.state import RunIdentity, TrainState

    write_text = Path.write_text

    def disk_gone_at_the_training_state(path, *args, **kwargs):
        if path.name == TRAINING_STATE:
            raise OSError("disk gone")
        return write_text(path, *args, **kwargs)

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    with monkeypatch.context() as patch:
        patch.setattr(Path, "write_text", disk_gone_at_the_training_state)
        with pytest.raises(OSError, match="disk gone"):
            save_checkpoint(accelerator, tmp_path, TrainState(step=3), RunIdentity())
    assert not (tmp_path / "step_3").exists() and complete_checkpoints(tmp_path) == []
    save_checkpoint(accelerator, tmp_path, TrainState(step=4), RunIdentity())
    assert complete_checkpoints(tmp_path) == [tmp_path / "step_4"] and model is not None


@inprocess
def test_latest_and_rotation_follow_training_progress_when_the_global_batch_changed(tmp_path):
    # at world size 1 (batch 4) a run saved step_98; resumed at world size 2 (batch 8) it counts from step 49 and
    # saves step_50, step_60: newer than step_98 although numbered lower
    from accelerate import Accelerator

    from ddp_accel.checkpoint import complete_checkpoints, resolve_resume, save_checkpoint
    from ddp_accel.state import RunIdentity, TrainState

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    save_checkpoint(accelerator, tmp_path, TrainState(step=98, batches_in_epoch=98, global_batch=4), RunIdentity())
    save_checkpoint(
        accelerator, tmp_path, TrainState(step=50, batches_in_epoch=50, global_batch=8), RunIdentity(), limit=2
    )
    assert complete_checkpoints(tmp_path) == [tmp_path / "step_98", tmp_path / "step_50"]
    assert resolve_resume("latest", tmp_path, accelerator) == tmp_path / "step_50"
    save_checkpoint(
        accelerator, tmp_path, TrainState(step=60, batches_in_epoch=60, global_batch=8), RunIdentity(), limit=2
    )
    assert complete_checkpoints(tmp_path) == [tmp_path / "step_50", tmp_path / "step_60"]  # step_98 rotated out
    save_checkpoint(
        accelerator, tmp_path, TrainState(step=61, epoch=1, global_batch=8), RunIdentity(), limit=2
    )  # the next epoch
    assert resolve_resume("latest", tmp_path, accelerator) == tmp_path / "step_61" and model is not None


def fixture_random_states_readable() -> bool:
    """The fixtures' RNG states were pickled under numpy 2, whose arrays numpy 1 cannot unpickle: there a resume of
    them is refused in one line (ddp_accel.checkpoint_format.check_random_states), not continued inexactly."""
    import numpy

    return int(numpy.__version__.split(".")[0]) >= 2


@inprocess
def test_a_checkpoint_of_729a739_still_resumes_bitwise_with_a_warning(tmp_path):
    # tests/fixtures/checkpoint_729a739/step_5: written by tests/probe.py of ddp_accel 729a739 (before TrainState,
    # files.json and run identities) with the arguments below, at world size 1
    from pathlib import Path

    common = ["--batch-size", 4, "--epochs", 2, "--checkpointing-steps", 5, "--dropout", "0.3"]
    fixture = Path(__file__).parent / "fixtures" / "checkpoint_729a739" / "step_5"
    shutil.copytree(fixture, tmp_path / "old" / "checkpoints" / "step_5")
    resumed = run_script(PROBE, "--output-dir", tmp_path / "old", *common, "--resume-from-checkpoint", "latest")
    if not fixture_random_states_readable():
        assert_clean_error(resumed, "this Accelerate cannot read its random states")
        return
    output = check_ok(resumed)
    assert "resumed from" in output and "step 5, epoch 0, skipping 5 batches" in output, output[-2000:]
    assert "written before run identities were recorded" in output
    check_ok(run_script(PROBE, "--output-dir", tmp_path / "new", *common))
    # the fixture's first 5 steps ran on another CPU, whose kernels round the last bit otherwise (1.5e-8 apart on an
    # AVX-512 Xeon): equal within that; a resume one batch off in the data is 5e-4 or more apart (tried)
    assert_same_weights(tmp_path / "new", tmp_path / "old", atol=1e-6)


@inprocess
def test_a_checkpoint_of_af45933_with_positional_callback_states_resumes_into_the_named_ones(tmp_path):
    # tests/fixtures/checkpoint_af45933/step_6: written by tests/probe.py of ddp_accel af45933 (the stateful
    # callbacks saved by position: custom_checkpoint_0.pkl the EMA, _1 the plateau schedule) with `common` below.
    # Resumed now (saved by name), it ends where a run of today does: both states went to their owners
    from pathlib import Path

    from safetensors.torch import load_file

    common = ["--batch-size", 4, "--epochs", 2, "--dropout", "0.3", "--ema-decay", "0.9", "--ema-warmup"]
    common += ["--lr-schedule", "plateau", "--plateau-patience", 1, "--lr-gamma", "0.5", "--best-metric"]
    common += ["ema_accuracy", "--eval-steps", 4, "--checkpointing-steps", 6]
    fixture = Path(__file__).parent / "fixtures" / "checkpoint_af45933" / "step_6"
    shutil.copytree(fixture, tmp_path / "old" / "checkpoints" / "step_6")
    resumed = run_script(PROBE, "--output-dir", tmp_path / "old", *common, "--resume-from-checkpoint", "latest")
    if not fixture_random_states_readable():
        assert_clean_error(resumed, "this Accelerate cannot read its random states")
        return
    output = check_ok(resumed)
    assert "resumed from" in output and "step 6, epoch 0" in output, output[-2000:]
    check_ok(run_script(PROBE, "--output-dir", tmp_path / "new", *common))
    assert (tmp_path / "new" / "checkpoints" / "step_6" / "callback_states.pt").is_file()
    assert metrics_of(tmp_path / "old")["final_lr"] == metrics_of(tmp_path / "new")["final_lr"]
    for name in ("model.safetensors", "model_ema.safetensors"):  # (another CPU rounds the first 6 steps otherwise)
        old, new = (load_file(str(tmp_path / run / name)) for run in ("old", "new"))
        assert all(torch.allclose(old[key], new[key], atol=1e-6, rtol=1e-5) for key in old), name


def samples_of(output_dir) -> list[int]:
    """The training sample ids rank 0 consumed in its last run, in order."""
    return [i for batch in json.loads((output_dir / "seen_rank0.json").read_text()) for i in batch]


# a schedule whose LR is a formula of the samples trained (2 epochs of 64): 0.05 * (1 + cos(pi * samples / 128)) / 2
COSINE = ["--lr-schedule", "cosine", "--min-lr", 0, "--lr", "0.05"]


def assert_cosine_by_samples(output_dir, total_samples: int = 128) -> None:
    """After every step of the run's last command, the LR of the next step is the cosine at the samples trained,
    whatever the world size that counted them, and it ends at --min-lr."""
    import math

    for samples, rate in learning_rates(output_dir).items():
        expected = 0.05 * 0.5 * (1 + math.cos(math.pi * samples / total_samples))
        assert rate == pytest.approx(expected, rel=1e-12, abs=1e-15), (samples, rate, expected)
    assert metrics_of(output_dir)["final_lr"] == 0.0


@pytest.fixture(scope="module")
def stopped_past_the_middle(tmp_path_factory):
    """One process, batch 4, 2 epochs of 64 samples (32 steps); its checkpoint of step 20: 16 samples into epoch 2."""
    root = tmp_path_factory.mktemp("past_the_middle")
    probe(root / "full", "--batch-size", 4, "--epochs", 2, *COSINE, "--checkpointing-steps", 20, nproc=1)
    return root


@pytest.mark.parametrize(
    "change",
    [("--batch-size", "8"), ("--gradient-accumulation-steps", "2")],
    ids=["global-batch-4-to-8", "accumulation-1-to-2"],
)
@inprocess
def test_a_resume_past_the_middle_with_fewer_steps_per_epoch_continues_from_its_place_in_the_data(
    stopped_past_the_middle, tmp_path, change
):
    # step 20 of 32 at 4 samples a step is step 10 of 16 at 8: comparing raw step numbers refused this resume
    full = stopped_past_the_middle / "full"
    shutil.copytree(full / "checkpoints" / "step_20", tmp_path / "cut" / "checkpoints" / "step_20")
    output = probe(
        tmp_path / "cut",
        "--batch-size",
        4,
        "--epochs",
        2,
        *COSINE,
        *change,
        "--resume-from-checkpoint",
        "latest",
        nproc=1,
    )
    assert "step 20 as the checkpoint counted" in output and "at step 10 of this command's 16" in output, output
    assert "resumed from" in output and "step 10, epoch 1" in output, output[-2000:]
    assert metrics_of(tmp_path / "cut")["steps"] == 16
    assert samples_of(tmp_path / "cut") == samples_of(full)[64 + 16 :]  # the rest of epoch 2, each sample once
    assert_cosine_by_samples(tmp_path / "cut")


@pytest.mark.multiprocess
def test_a_one_process_run_resumed_past_the_middle_on_two_processes_completes(stopped_past_the_middle, tmp_path):
    # what an elastic join in the second half of a run does: world size 1 -> 2, twice the global batch
    full = stopped_past_the_middle / "full"
    shutil.copytree(full / "checkpoints" / "step_20", tmp_path / "joined" / "checkpoints" / "step_20")
    output = probe(tmp_path / "joined", "--batch-size", 4, "--epochs", 2, *COSINE, "--resume-from-checkpoint", "latest")
    assert "resumed from" in output and "step 10, epoch 1" in output, output[-2000:]
    assert metrics_of(tmp_path / "joined")["steps"] == 16
    assert_cosine_by_samples(tmp_path / "joined")
    rest = samples_of(full)[64 + 16 :]
    ranks = [json.loads((tmp_path / "joined" / f"seen_rank{rank}.json").read_text()) for rank in (0, 1)]
    seen = sorted(i for rank in ranks for batch in rank for i in batch)
    assert seen == sorted(rest)  # every remaining sample of epoch 2 once, across the two processes


@pytest.mark.multiprocess
def test_a_two_process_run_resumed_past_the_middle_on_one_process_completes_with_monotonic_trackers(tmp_path):
    # what a node leaving in the second half of a run does: world size 2 -> 1, half the global batch. Steps are
    # counted again (step 10 of 16 at 8 samples is step 20 of 32 at 4); the trackers' x axis (samples trained),
    # history.json's `samples` and metrics.json's progress only grow and end at the uninterrupted run's count.
    from test_tracking import tensorboard_steps, tensorboard_values

    out, common = tmp_path / "run", ["--batch-size", 4, "--epochs", 2, "--with-tracking", "--log-steps", 1, *COSINE]
    probe(
        out, *common, "--checkpointing-steps", 10, "--max-steps", 10
    )  # 2 processes: 8 steps an epoch; evaluated at 10
    output = probe(out, *common, "--resume-from-checkpoint", "latest", nproc=1)
    assert "at step 20 of this command's 32 (step 10 as the checkpoint counted)" in output, output[-3000:]
    metrics = metrics_of(out)
    assert metrics["steps"] == 32 and metrics["world_size"] == 1
    assert metrics["progress"] == {"epoch": 2, "samples_in_epoch": 0, "samples": 128}  # 2 epochs of 64, once
    assert_cosine_by_samples(out)  # (the first command's cosine was over its own --max-steps 10)
    samples = tensorboard_steps(out / "tensorboard", "train_loss")
    assert samples == [8 * step for step in range(1, 11)] + [80 + 4 * step for step in range(1, 13)], samples
    logged_steps = tensorboard_values(out / "tensorboard", "optimizer_step")  # log windows and evaluations
    assert sorted(set(logged_steps)) == [*range(1, 11), *range(21, 33)], logged_steps
    history = json.loads((out / "history.json").read_text())
    assert [record["samples"] for record in history] == [64, 80, 128] and history[-1]["epoch"] == 2.0, history


@inprocess
def test_compile_keeps_the_weights_names_and_resumes_with_or_without_compile(tmp_path):
    # torch.compile's wrapper prefixed every exported key with `_orig_mod.` (a file -e refused as another model's);
    # --compile compiles in place. The eager backend: the same path without a C++ compiler, and the same numbers
    from safetensors.torch import load_file

    common = ["--batch-size", 4, "--epochs", 1, "--checkpointing-steps", 8, "--dropout", "0"]
    eager = ["--compile", "--compile-backend", "eager"]
    probe(tmp_path / "plain", *common, nproc=1)
    probe(tmp_path / "compiled", *common, *eager, nproc=1)
    assert not [key for key in load_file(str(tmp_path / "compiled" / "model.safetensors")) if "_orig_mod" in key]
    assert_same_weights(tmp_path / "plain", tmp_path / "compiled", atol=None)
    for name, resumed_with in (("to_plain", []), ("to_compiled", eager)):  # a compiled run's checkpoint, and back
        source = "compiled" if name == "to_plain" else "plain"
        shutil.copytree(tmp_path / source / "checkpoints" / "step_8", tmp_path / name / "checkpoints" / "step_8")
        output = probe(tmp_path / name, *common, *resumed_with, "--resume-from-checkpoint", "latest", nproc=1)
        assert "resumed from" in output, output[-2000:]
        assert_same_weights(tmp_path / "plain", tmp_path / name, atol=None)


@multiprocess
def test_the_accelerate_configs_dynamo_path_exports_the_bare_models_weights(tmp_path):
    # `accelerate launch --dynamo_backend` (the YAML dynamo_config) wraps the model in torch.compile: model.safetensors
    # had `_orig_mod.` names. Its checkpoint resumes without dynamo
    from safetensors.torch import load_file

    config = ROOT / "accelerate_configs" / "cpu.yaml"
    command = [str(BIN / "accelerate"), "launch", "--config_file", str(config), "--dynamo_backend", "eager", PROBE]
    command += ["--output-dir", str(tmp_path), "--epochs", "2", "--max-steps", "2", "--checkpointing-steps", "2"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    check_ok(result)
    assert metrics_of(tmp_path)["world_size"] == 1  # cpu.yaml: one process
    assert sorted(load_file(str(tmp_path / "model.safetensors"))) == ["0.bias", "0.weight", "3.bias", "3.weight"]
    output = probe(tmp_path, "--epochs", 2, "--max-steps", 4, "--resume-from-checkpoint", "latest", nproc=1)
    assert "resumed from" in output and metrics_of(tmp_path)["steps"] == 4, output[-2000:]


@inprocess
def test_ema_early_stopping_and_a_profiler_window_resume_bitwise_and_say_what_they_did(tmp_path):
    # EMA is where resume breaks elsewhere (lost, or restarted from the raw weights); the early-stopping count must
    # go on across a resume. The probe's accuracy stops improving at once: patience 2 with an evaluation every 4
    # steps ends at step 12 of 160, and model_best is chosen among the averaged weights
    from safetensors.torch import load_file

    common = ["--batch-size", 4, "--epochs", 10, "--eval-steps", 4, "--checkpointing-steps", 4, "--dropout", "0.3"]
    common += ["--ema-decay", "0.9", "--ema-warmup", "--best-metric", "ema_accuracy", "--early-stopping-patience", 2]
    # reduce-on-plateau on the same metric: halved at the evaluation of step 8, its state resumed from step 8
    common += ["--lr-schedule", "plateau", "--plateau-patience", 1, "--lr-gamma", "0.5"]
    output = probe(tmp_path / "full", *common, "--profile-steps", "1:3", nproc=1)
    assert "early stopping at step 12: ema_accuracy has not improved" in output, output[-2000:]
    metrics = metrics_of(tmp_path / "full")
    assert metrics["steps"] == 12 and metrics["end_reason"].startswith("early stopping: ema_accuracy"), metrics
    lr = json.loads((tmp_path / "full" / "args.json").read_text())["lr"]
    assert metrics["final_lr"] == lr * 0.5, (metrics["final_lr"], lr)  # halved after step 8, no step after 12
    history = json.loads((tmp_path / "full" / "history.json").read_text())
    assert metrics["best_ema_accuracy"] == max(record["ema_accuracy"] for record in history)
    assert "profile of steps 2..3 (rank 0)" in output and "Self CPU" in output, output[-3000:]
    assert json.loads((tmp_path / "full" / "profile" / "trace_rank0.json").read_text())["traceEvents"]
    rerun = probe(tmp_path / "full", *common, "--resume-from-checkpoint", "latest", nproc=1)
    assert "is complete (ended by early stopping: ema_accuracy" in rerun, rerun[-2000:]
    assert "Without --early-stopping-patience, a larger --epochs or --max-steps continues it" in rerun
    # without early stopping, a longer run goes on from the newest checkpoint (the stop was a choice, not the end)
    shutil.copytree(tmp_path / "full", tmp_path / "longer")
    index = common.index("--early-stopping-patience")
    without_stopping = [*common[:index], *common[index + 2 :], "--max-steps", 16]
    output = probe(tmp_path / "longer", *without_stopping, "--resume-from-checkpoint", "latest", nproc=1)
    assert "resumed from" in output and metrics_of(tmp_path / "longer")["steps"] == 16, output[-2000:]

    # stopped after step 8 (one evaluation without improvement counted): the resume counts on and ends at 12 with
    # every weight file of the uninterrupted run
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_8", tmp_path / "cut" / "checkpoints" / "step_8")
    staged = tmp_path / "cut" / "checkpoints" / ".final"  # what a kill after step 8 leaves: the best of step 4, staged
    staged.mkdir()
    shutil.copy(tmp_path / "full" / "model_best.safetensors", staged / "model_best.safetensors")
    output = probe(tmp_path / "cut", *common, "--resume-from-checkpoint", "latest", nproc=1)
    assert "resumed from" in output and "early stopping at step 12" in output, output[-2000:]
    for name in ("model.safetensors", "model_ema.safetensors", "model_best.safetensors"):
        full, cut = (load_file(str(tmp_path / run / name)) for run in ("full", "cut"))
        assert all(torch.equal(full[key], cut[key]) for key in full), name
    average, raw = (load_file(str(tmp_path / "full" / name)) for name in ("model_ema.safetensors", "model.safetensors"))
    assert not all(torch.equal(average[key], raw[key]) for key in raw)  # an average, not the last weights

    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_8", tmp_path / "plain" / "checkpoints" / "step_8")
    without = [
        "--batch-size",
        4,
        "--epochs",
        2,
        "--resume-from-checkpoint",
        "latest",
        "--output-dir",
        tmp_path / "plain",
    ]
    assert_clean_error(run_script(PROBE, *without), "other stateful callbacks", "--ema-decay given on one side only")
    result = run_script(PROBE, "--output-dir", tmp_path / "bad", "--best-metric", "ema_top1", "--max-steps", 2)
    assert_clean_error(result, "--best-metric ema_top1 is a metric of the weights' average: add --ema-decay")
    result = run_script(PROBE, "--output-dir", tmp_path / "bad", "--best-metric", "eval_top1", "--max-steps", 2)
    assert_clean_error(result, "--best-metric eval_top1 is not a metric of this run's evaluation: eval_loss")
    result = run_script(PROBE, "--output-dir", tmp_path / "none", "--early-stopping-patience", 2)
    assert_clean_error(result, "--early-stopping-patience needs an evaluation to watch", "--best-metric")
    result = run_script(PROBE, "--output-dir", tmp_path / "past", "--profile-steps", "3:600")
    assert_clean_error(result, "--profile-steps 3:600 ends past this run's 2 steps")
    # refused before --overwrite-output-dir deleted the run that was there
    result = run_script(
        PROBE, *common, "--output-dir", tmp_path / "full", "--overwrite-output-dir", "--profile-steps", "3:600"
    )
    assert_clean_error(result, "--profile-steps 3:600 ends past this run's 160 steps")
    assert (tmp_path / "full" / "checkpoints" / "step_8").is_dir() and (tmp_path / "full" / "history.json").is_file()

    # resumed under another --best-metric: the best so far (an accuracy) is no loss to beat; it starts again
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_8", tmp_path / "other" / "checkpoints" / "step_8")
    switched = [*common, "--max-steps", 16]
    switched[switched.index("--best-metric") + 1] = "eval_loss"
    output = probe(tmp_path / "other", *switched, "--resume-from-checkpoint", "latest", nproc=1)
    assert "the checkpoint's best so far was by ema_accuracy, this run's by eval_loss" in output, output[-2000:]
    history = json.loads((tmp_path / "other" / "history.json").read_text())
    after = [record["eval_loss"] for record in history if record["step"] > 8]
    assert after and metrics_of(tmp_path / "other")["best_loss"] == min(after), (
        history,
        metrics_of(tmp_path / "other"),
    )


@inprocess
def test_a_sigterm_mid_training_saves_the_average_of_the_step_it_saves(tmp_path):
    # the stop is agreed after the step's callbacks: a preemption checkpoint of step 7 holds the EMA of step 7 (it
    # held step 6's: the resumed average lagged one update behind for good)
    from safetensors.torch import load_file

    common = ["--batch-size", 4, "--epochs", 1, "--ema-decay", "0.9", "--checkpointing-steps", 4, "--dropout", "0.3"]
    probe(tmp_path / "full", *common, nproc=1)
    output = probe(tmp_path / "cut", *common, "--sigterm-at-batch", 7, nproc=1)
    assert "preempted by SIGTERM at step 7 (train)" in output, output[-2000:]
    probe(tmp_path / "cut", *common, "--resume-from-checkpoint", "latest", nproc=1)
    for name in ("model.safetensors", "model_ema.safetensors"):
        full, cut = (load_file(str(tmp_path / run / name)) for run in ("full", "cut"))
        assert all(torch.equal(full[key], cut[key]) for key in full), name


@inprocess
def test_options_a_resume_may_change_are_said_in_one_line_when_they_do(tmp_path):
    # another --ema-decay, an --ema-warmup added, another --lr-schedule and --lr were taken without a word
    common = ["--batch-size", 4, "--epochs", 1, "--ema-decay", "0.9", "--checkpointing-steps", 4]
    probe(tmp_path, *common, "--max-steps", 4, nproc=1)
    same = probe(tmp_path, *common, "--max-steps", 8, "--resume-from-checkpoint", "latest", nproc=1)
    assert "was trained with other options" not in same, same[-2000:]
    changed = [*common, "--max-steps", 12, "--resume-from-checkpoint", "latest", "--ema-warmup", "--lr", "0.01"]
    changed[changed.index("0.9")] = "0.99"
    output = probe(tmp_path, *changed, "--lr-schedule", "cosine", nproc=1)
    lines = [line for line in output.splitlines() if "was trained with other options" in line]
    assert len(lines) == 1, output[-3000:]
    for said in (
        "--lr 0.001 -> 0.01",
        "--lr-schedule None -> cosine",
        "--ema-decay 0.9 -> 0.99",
        "--ema-warmup False -> True",
    ):
        assert said in lines[0], lines[0]
    # what the run remembers is what it trained with last: resumed again under the same options, nothing to say
    changed[changed.index(12)] = 16
    again = probe(tmp_path, *changed, "--lr-schedule", "cosine", nproc=1)
    assert "resumed from" in again and "was trained with other options" not in again, again[-3000:]


def learning_rates(output_dir) -> dict[int, float]:
    """tests/probe.py's record: samples trained -> the learning rate of the next step (rank 0, its last run)."""
    return dict(json.loads((output_dir / "lr_rank0.json").read_text()))


@pytest.mark.parametrize("batches", [(8, 4), (4, 8)], ids=["global-batch-8-to-4", "global-batch-4-to-8"])
@inprocess
def test_a_resume_at_another_global_batch_keeps_the_lr_schedule_at_its_place_in_the_data(tmp_path, batches):
    # what 2 -> 1 and 1 -> 2 processes do to the schedule: steps are counted again in the new global batch, and the
    # schedule's position with them, so the LR at each sample position is the uninterrupted run's and cosine ends
    # at --min-lr (the saved position, in the old steps, jumped the LR and ended cosine above --min-lr)
    before, after = batches
    common = ["--epochs", 4, "--lr-schedule", "cosine", "--warmup-epochs", 1, "--min-lr", 0, "--lr", "0.05"]
    probe(tmp_path / "full", *common, "--batch-size", after, nproc=1)
    stop_batch = 12 * 8 // before  # 96 samples: into the third epoch, past the warm-up
    output = probe(tmp_path / "cut", *common, "--batch-size", before, "--sigterm-at-batch", stop_batch, nproc=1)
    assert f"preempted by SIGTERM at step {stop_batch}" in output, output[-2000:]
    output = probe(tmp_path / "cut", *common, "--batch-size", after, "--resume-from-checkpoint", "latest", nproc=1)
    assert f"global batch changed from {before} to {after}" in output, output[-2000:]
    full, cut = learning_rates(tmp_path / "full"), learning_rates(tmp_path / "cut")
    assert min(cut) == 96 + after and max(cut) == 256, sorted(cut)
    for samples, rate in cut.items():
        assert rate == pytest.approx(full[samples], rel=1e-12, abs=1e-15), (samples, rate, full[samples])
    assert metrics_of(tmp_path / "cut")["final_lr"] == 0.0 == metrics_of(tmp_path / "full")["final_lr"]


@pytest.mark.parametrize("metric", ["bogus", "eval_accuracyx", "ema_accuracy"])
@inprocess
def test_a_mistyped_best_metric_is_refused_before_the_first_step_leaving_no_file(tmp_path, metric):
    # the task declares its metric names: a wrong --best-metric was refused only after a whole epoch, with
    # history.json written
    result = run_script(PROBE, "--output-dir", tmp_path / "run", "--best-metric", metric, "--epochs", 3)
    if metric == "ema_accuracy":
        assert_clean_error(result, "--best-metric ema_accuracy is a metric of the weights' average: add --ema-decay")
    else:
        assert_clean_error(
            result, f"--best-metric {metric} is not a metric of this run's evaluation: eval_loss, eval_accuracy,"
        )
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    result = run_script(PROBE, "--output-dir", tmp_path / "ema", "--best-metric", "ema_bogus", "--ema-decay", "0.9")
    assert_clean_error(
        result, "--best-metric ema_bogus is not a metric of this run's evaluation: eval_loss,", "ema_loss"
    )


@pytest.mark.inprocess
def test_auto_batch_size_keeps_the_global_batch_and_trains_as_the_explicit_accumulation(tmp_path, monkeypatch):
    # --batch-size 12 where only 4 samples fit (an injected out-of-memory error above 4): the trial goes 12, 6, 4,
    # then trains micro-batches of 4 accumulated 3 times, as --batch-size 4 --gradient-accumulation-steps 3 does
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    common = ["--epochs", "1", "--train-size", "48", "--dropout", "0.3"]
    output = probe(tmp_path / "auto", *common, "--batch-size", 12, "--auto-batch-size", "--oom-above", 4, nproc=1)
    probe(tmp_path / "explicit", *common, "--batch-size", 4, "--gradient-accumulation-steps", 3, nproc=1)
    assert re.search(
        r"batch_size_per_process\s+4\n\s+gradient_accumulation_steps\s+3\n\s+global_batch_size\s+12", output
    )
    auto, explicit = metrics_of(tmp_path / "auto"), metrics_of(tmp_path / "explicit")
    assert auto["auto_batch_size"] == "12 asked, 4 fits" and auto["steps"] == explicit["steps"] == 4, auto
    assert_same_weights(tmp_path / "auto", tmp_path / "explicit")  # bitwise: the trial changed nothing

    # without the option, the same out-of-memory error is one line that says what to change, not a traceback
    result = run_script(PROBE, "--output-dir", tmp_path / "oom", *common, "--batch-size", 12, "--oom-above", 4)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert errors == [f"error: process 0 ran out of memory (CUDA out of memory): {OUT_OF_MEMORY_ADVICE}"], errors


@inprocess
def test_a_time_budget_plans_on_batches_that_change_nothing_and_a_resume_keeps_the_plan(tmp_path, monkeypatch):
    from ddp_accel.budget import Costs

    common = ["--batch-size", 4, "--train-size", 40, "--dropout", "0.3", "--checkpointing-steps", 5]
    # the timed batches leave no trace (weights, AdamW's moments, the dropout generator): an hour fits the 2
    # epochs asked, and the run is the run without a budget, bit for bit
    output = probe(tmp_path / "budget", *common, "--epochs", 2, "--time-budget", "1h", nproc=1)
    probe(tmp_path / "plain", *common, "--epochs", 2, nproc=1)
    assert re.search(r"time_budget\s+1 h 0 min: 2 epochs of 2 fit", output), output
    assert "time budget: the command took" in output
    assert_same_weights(tmp_path / "budget", tmp_path / "plain")
    assert metrics_of(tmp_path / "budget")["time_budget"]["epochs"] == 2
    # with accumulation too: the timing ends on whole accumulation groups, and no gradient of it is left over
    accumulated = [*common, "--epochs", 2, "--gradient-accumulation-steps", 3]
    probe(tmp_path / "budget_accumulated", *accumulated, "--time-budget", "1h", nproc=1)
    probe(tmp_path / "plain_accumulated", *accumulated, nproc=1)
    assert_same_weights(tmp_path / "budget_accumulated", tmp_path / "plain_accumulated")

    # the plan from given costs: 100 s, 2 s of it spent, an epoch 10 batches x 2 s, an evaluation 6 x 0.5 s, a
    # reserve of 8 s: 3 of the 10 epochs asked fit (2 + 3 x 23 + 8 = 79; 4 would need 102)
    costs = Costs(train_batch_s=2.0, train_start_s=0.0, eval_batch_s=0.5, eval_start_s=0.0, spent_s=2.0)
    monkeypatch.setattr("ddp_accel.budget.measure_costs", lambda *args: Costs(**vars(costs)))
    planned = [*common, "--epochs", 10, "--time-budget", "100s"]
    output = probe(tmp_path / "full", *planned, nproc=1)
    assert re.search(r"time_budget\s+1 min 40 s: 3 epochs of 10 fit", output), output
    assert metrics_of(tmp_path / "full")["steps"] == 30

    # a resume keeps the plan, measures nothing, and ends as the uninterrupted run; a rerun says it is complete
    def measured(*args):
        raise AssertionError("a resumed run must keep its plan, not time batches again")

    monkeypatch.setattr("ddp_accel.budget.measure_costs", measured)
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_5", tmp_path / "cut" / "checkpoints" / "step_5")
    output = probe(tmp_path / "cut", *planned, "--resume-from-checkpoint", "latest", nproc=1)
    assert re.search(r"3 epochs of 10 fit .*\(the run's plan, kept", output), output
    assert_same_weights(tmp_path / "full", tmp_path / "cut")
    output = probe(tmp_path / "full", *planned, "--resume-from-checkpoint", "latest", nproc=1)
    assert "is complete (30 steps)" in output

    def error_of(output_dir, *args):
        result = run_script(PROBE, "--output-dir", output_dir, "--dropout", "0", *args)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
        return errors[0]

    # another budget at a resume, a budget that holds no epoch, a warm-up the plan cuts short: one line each
    error = error_of(
        tmp_path / "cut", *common, "--epochs", 10, "--time-budget", "5m", "--resume-from-checkpoint", "latest"
    )
    assert "the run was planned for 1 min 40 s (3 epochs), and a resume keeps its plan" in error, error
    monkeypatch.setattr("ddp_accel.budget.measure_costs", lambda *args: Costs(**{**vars(costs), "spent_s": 90.0}))
    error = error_of(tmp_path / "short", *planned)
    assert "--time-budget 1 min 40 s: not even one epoch fits on this machine" in error, error
    monkeypatch.setattr("ddp_accel.budget.measure_costs", lambda *args: Costs(**vars(costs)))
    error = error_of(tmp_path / "warm", *planned, "--lr-schedule", "cosine", "--warmup-epochs", 4)
    assert "leaves 3 epochs here, within --warmup-epochs 4" in error, error
    error = error_of(tmp_path / "profile", *planned, "--profile-steps", "40:45")
    assert "ends past this run's 30 steps (3 epochs: --time-budget's plan)" in error, error
    error = error_of(tmp_path / "step", *planned, "--lr-schedule", "step", "--lr-step-epochs", 3)
    assert "leaves 3 epochs here: the first decay of --lr-schedule step (every --lr-step-epochs 3)" in error, error
    # a budget added at the resume of a run trained without one; a lower --epochs at a resume is still the most
    error = error_of(tmp_path / "plain", *planned, "--resume-from-checkpoint", "latest")
    assert "--time-budget plans a run from its start, and " in error and "was trained without one" in error, error
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_5", tmp_path / "lower" / "checkpoints" / "step_5")
    monkeypatch.setattr("ddp_accel.budget.measure_costs", measured)
    probe(
        tmp_path / "lower",
        *common,
        "--epochs",
        2,
        "--time-budget",
        "100s",
        "--resume-from-checkpoint",
        "latest",
        nproc=1,
    )
    assert metrics_of(tmp_path / "lower")["steps"] == 20


@inprocess
def test_a_machine_that_slows_down_after_the_plan_ends_training_early_and_says_so(tmp_path, monkeypatch):
    # the plan is made from fast batches (timed costs of 1 ms), then every step takes 20 ms: the 20 planned epochs
    # would take about four times the budget; the guard ends training at an epoch's end, and the run is complete
    from ddp_accel.budget import Costs

    costs = Costs(train_batch_s=0.001, train_start_s=0.0, eval_batch_s=0.001, eval_start_s=0.0, spent_s=0.1)
    monkeypatch.setattr("ddp_accel.budget.measure_costs", lambda *args: Costs(**vars(costs)))
    monkeypatch.setattr("ddp_accel.budget.FIXED_RESERVE_S", 0.25)  # the guard's work, not the exit's, is tested
    common = [
        "--batch-size",
        4,
        "--epochs",
        20,
        "--time-budget",
        "1.5s",
        "--step-ms",
        20,
        "--checkpointing-steps",
        "epoch",
    ]
    output = probe(tmp_path, *common, nproc=1)
    metrics = metrics_of(tmp_path)
    assert metrics["time_budget"]["epochs"] == 20 and metrics["progress"]["epoch"] < 20, metrics
    assert metrics["end_reason"].startswith("time budget: the machine ran slower than planned"), metrics
    assert "the next would end past the budget, so training ends after" in output, output[-2000:]
    assert "an epoch took" in output and "from the batches timed at the start" in output, output[-2000:]  # misled
    rerun = probe(tmp_path, *common, "--resume-from-checkpoint", "latest", nproc=1)
    assert "is complete (ended by time budget" in rerun and "Without --time-budget" in rerun, rerun[-2000:]


@inprocess
def test_a_resumed_run_is_held_to_what_is_left_of_its_time_budget(tmp_path, monkeypatch):
    # the plan made from batches that ran 20x faster than the epochs then did: the first command, stopped by a
    # signal, and its resume (which keeps the plan) are guarded together: the resume followed the plan's 20 epochs
    # without a line, far past the budget
    from ddp_accel.budget import Costs

    costs = Costs(train_batch_s=0.001, train_start_s=0.0, eval_batch_s=0.001, eval_start_s=0.0, spent_s=0.1)
    monkeypatch.setattr("ddp_accel.budget.measure_costs", lambda *args: Costs(**vars(costs)))
    monkeypatch.setattr("ddp_accel.budget.FIXED_RESERVE_S", 0.25)
    common = ["--batch-size", 4, "--epochs", 20, "--time-budget", "3s", "--step-ms", 20, "--checkpointing-steps", 4]
    stopped = probe(tmp_path, *common, "--sigterm-at-batch", 6, nproc=1)  # in the first epoch (16 steps)
    assert "preempted by SIGTERM at step 6" in stopped, stopped[-2000:]
    spent = json.loads((tmp_path / "checkpoints" / "step_6" / "training_state.json").read_text())["budget_spent_s"]
    assert spent > 6 * 0.02, spent  # the first command's time, carried by the checkpoint
    resumed = probe(tmp_path, *common, "--resume-from-checkpoint", "latest", nproc=1)
    metrics = metrics_of(tmp_path)
    assert metrics["end_reason"].startswith("time budget: the machine ran slower than planned"), metrics
    assert metrics["progress"]["epoch"] < 20 and "the next would end past the budget" in resumed, resumed[-2000:]


@multiprocess
def test_on_two_processes_a_time_budget_plans_the_same_on_both_and_trains_as_without_it(tmp_path, two_process_job):
    # each rank times its own batches; both take the slowest figures (one all-reduce), so both train the same
    # number of epochs, and the run is the shared job's without a budget, bit for bit
    output = probe(tmp_path, *SHARED, "--time-budget", "1h")
    assert re.search(r"time_budget\s+1 h 0 min: 2 epochs of 2 fit", output), output
    assert metrics_of(tmp_path)["steps"] == metrics_of(two_process_job)["steps"] == 10
    assert_same_weights(tmp_path, two_process_job)

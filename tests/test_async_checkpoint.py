"""--async-checkpoint: checkpoints staged in memory and written by a background thread (ddp_accel/async_save.py).
The files are a synchronous save's, byte for byte; a checkpoint is `latest` only once complete; a stop waits for the
write in flight and then saves its own step; a process killed mid-write resumes from the previous checkpoint."""

import contextlib
import json
import shutil
import threading

import pytest
import torch
from helpers import ROOT, SHORT_PROBE_ARGS, assert_same_weights, check_ok, launch, run_script, write

from ddp_accel import async_save
from ddp_accel.checkpoint import complete_checkpoints, resolve_resume
from ddp_accel.checkpoint_format import AcceleratorObjects, Contents, write_checkpoint

PROBE = "tests/probe.py"
ARGS = SHORT_PROBE_ARGS  # batch 4 on 2 ranks; the 1-process runs below give --batch-size 8 after it (the last wins)
inprocess, multiprocess = pytest.mark.inprocess, pytest.mark.multiprocess


def one_process(output_dir, *args):
    return check_ok(run_script(PROBE, "--output-dir", output_dir, *ARGS, "--batch-size", 8, *args))


def checkpoint_files(output_dir) -> dict[str, bytes]:
    root = output_dir / "checkpoints"
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


@inprocess
def test_async_checkpoints_are_the_synchronous_ones_byte_for_byte_and_a_stop_waits_for_the_write(tmp_path):
    one_process(tmp_path / "sync")
    one_process(tmp_path / "async", "--async-checkpoint")
    sync, background = checkpoint_files(tmp_path / "sync"), checkpoint_files(tmp_path / "async")
    assert sync.keys() == background.keys() and "step_20/optimizer.bin" in sync, sorted(sync)
    assert all(sync[name] == background[name] for name in sync), [n for n in sync if sync[n] != background[n]]
    # SIGTERM at batch 7, two steps after the save of step 5 began in the background: the stop waits for it, saves
    # step 7 at once; the resume ends bitwise equal (dropout: the RNG states are the staged ones)
    output = one_process(tmp_path / "cut", "--async-checkpoint", "--sigterm-at-batch", 7)
    assert "preempted by SIGTERM at step 7 (train)" in output, output[-2000:]
    assert [path.name for path in complete_checkpoints(tmp_path / "cut" / "checkpoints")] == ["step_5", "step_7"]
    one_process(tmp_path / "cut", "--async-checkpoint", "--resume-from-checkpoint", "latest")
    assert_same_weights(tmp_path / "cut", tmp_path / "sync")


@inprocess
def test_a_checkpoint_is_latest_only_once_written_and_a_write_cut_short_leaves_the_previous(tmp_path, monkeypatch):
    # the writer of step 10 held mid-write: the training goes on, `latest` is step 5; released, it is step 10.
    # A process killed there (the writer abandoned) leaves step 5 as latest, and the resume from it is bitwise
    held, release = threading.Event(), threading.Event()
    write_all = async_save.StagedWrites.write_all

    def slow_write_all(self):
        if any("step_10" in str(path) for _, _, path in self.writes):
            held.set()
            assert release.wait(60)
        write_all(self)

    monkeypatch.setattr(async_save.StagedWrites, "write_all", slow_write_all)
    seen: dict[str, object] = {}

    def watch():  # what a resume would pick while the write is held
        assert held.wait(60)
        root = tmp_path / "held" / "checkpoints"
        seen["latest"] = resolve_resume("latest", root)
        seen["partial"] = (root / ".tmp_step_10").is_dir()
        release.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    one_process(tmp_path / "held", "--async-checkpoint", "--max-steps", 12)
    watcher.join()
    assert seen == {"latest": tmp_path / "held" / "checkpoints" / "step_5", "partial": True}, seen
    assert (tmp_path / "held" / "checkpoints" / "step_10" / "training_state.json").is_file()
    # killed mid-write: what was on disk then (step 5 and a partial step 10) resumes from step 5, to the same weights
    killed = tmp_path / "killed" / "checkpoints"
    shutil.copytree(tmp_path / "held" / "checkpoints" / "step_5", killed / "step_5")
    shutil.copytree(tmp_path / "held" / "checkpoints" / "step_10", killed / ".tmp_step_10")
    (killed / ".tmp_step_10" / "training_state.json").unlink()
    shutil.copy(tmp_path / "held" / "history.json", tmp_path / "killed" / "history.json")
    output = one_process(
        tmp_path / "killed", "--async-checkpoint", "--max-steps", 12, "--resume-from-checkpoint", "latest"
    )
    assert "resumed from" in output and "step_5" in output, output[-2000:]
    assert_same_weights(tmp_path / "killed", tmp_path / "held")


@inprocess
def test_a_run_commits_only_once_its_last_checkpoint_is_complete(tmp_path, monkeypatch):
    # the write of step 20 (the last one) held for a second: the run's final files, metrics.json last, come after it
    from ddp_accel import run_folder

    released = threading.Event()
    write_all, commit = async_save.StagedWrites.write_all, run_folder.RunFolder.commit

    def slow_write_all(self):
        if any("step_20" in str(path) for _, _, path in self.writes):
            released.wait(1.0)
        write_all(self)

    seen = {}

    def recording_commit(self, *args, **kwargs):
        seen["last checkpoint complete"] = (self.checkpoints / "step_20" / "training_state.json").is_file()
        released.set()
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(async_save.StagedWrites, "write_all", slow_write_all)
    monkeypatch.setattr(run_folder.RunFolder, "commit", recording_commit)
    one_process(tmp_path / "run", "--async-checkpoint")
    assert seen == {"last checkpoint complete": True}


@inprocess
def test_the_main_process_completes_a_checkpoint_only_once_a_slow_rank_s_files_are_written(tmp_path):
    # two ranks' writers in one process: rank 1's write takes 0.5 s (a slow disk, a large shard), rank 0's is at
    # once. Rank 0 lists the folder and renames it only after rank 1's marker, which comes after its files
    import time

    from ddp_accel.checkpoint import FILE_LIST, complete

    partial, final = tmp_path / ".tmp_step_3", tmp_path / "step_3"
    partial.mkdir()

    def slowly(obj, path):
        time.sleep(0.5)
        torch.save(obj, path)

    failures = []

    def writer(rank, write, name):
        staged = async_save.StagedWrites()
        staged.add(write, {"rank": torch.full((4,), float(rank))}, partial / name)
        finish = (lambda: complete(partial, final, "{}", None)) if rank == 0 else None
        try:
            async_save.write_then_mark(staged, partial, rank, 2, finish)
        except OSError as failed:  # (rank 1 writing into a folder already renamed)
            failures.append(failed)

    threads = [threading.Thread(target=writer, args=(1, slowly, "shard_1.pt"))]
    threads.append(threading.Thread(target=writer, args=(0, torch.save, "shard_0.pt")))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures and not partial.exists()
    assert json.loads((final / FILE_LIST).read_text()).keys() == {"shard_0.pt", "shard_1.pt"}
    assert torch.load(final / "shard_1.pt")["rank"].eq(1).all()


@inprocess
def test_the_staging_copies_tensors_so_later_steps_do_not_change_a_staged_checkpoint(tmp_path):
    weights = {"w": torch.ones(3)}
    staged = async_save.StagedWrites()
    staged.add(torch.save, weights, tmp_path / "w.pt")
    weights["w"].add_(1)  # the next optimizer step
    assert not (tmp_path / "w.pt").exists() and staged.bytes == 12
    staged.write_all()
    assert torch.equal(torch.load(tmp_path / "w.pt")["w"], torch.ones(3))


@inprocess
def test_a_tensor_at_the_address_of_one_staged_before_is_staged_as_itself(tmp_path):
    # FSDP's FULL_STATE_DICT on several processes: the model's full state is gathered, staged and freed, then the
    # optimizer's is gathered into the same memory; each object's tensors are staged from their own contents
    memory = bytearray(64)
    weight = torch.frombuffer(memory, dtype=torch.float32).fill_(1.0)
    staged = async_save.StagedWrites()
    staged.add(torch.save, {"weight": weight}, tmp_path / "model.pt")
    del weight
    moment = torch.frombuffer(memory, dtype=torch.float32).fill_(2.0)  # another tensor, at the same address
    staged.add(torch.save, {"exp_avg": moment}, tmp_path / "optimizer.pt")
    staged.write_all()
    assert torch.equal(torch.load(tmp_path / "model.pt")["weight"], torch.ones(16))
    assert torch.equal(torch.load(tmp_path / "optimizer.pt")["exp_avg"], torch.full((16,), 2.0))


@inprocess
def test_under_fsdp_the_shards_are_staged_and_written_over_a_group_of_their_own(tmp_path):
    # torch.distributed.checkpoint's save is staged too: its shards are the synchronous save's (its .metadata holds
    # an id of each save); written later over the writer's own process group
    fsdp = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    for kind, extra in (("sync", []), ("async", ["--async-checkpoint"])):
        common = ["--output-dir", tmp_path / kind, *ARGS, "--batch-size", 8, "--epochs", 1, *extra]
        check_ok(run_script(PROBE, *common, env=fsdp))
    sync, background = checkpoint_files(tmp_path / "sync"), checkpoint_files(tmp_path / "async")
    shards = [name for name in sync if name.endswith(".distcp")]
    assert "step_10/pytorch_model_fsdp_0/__0_0.distcp" in shards and "step_10/optimizer_0/__0_0.distcp" in shards
    assert all(sync[name] == background[name] for name in shards)
    assert sync.keys() == background.keys()


@multiprocess
def test_on_two_processes_async_checkpoints_are_the_synchronous_ones_and_a_stop_resumes_bitwise(tmp_path, short_job):
    # each rank's writer leaves its marker; the main process's completes the folder once every marker is there
    common = ["--output-dir", tmp_path / "async", *ARGS, "--async-checkpoint"]
    stopped = launch(PROBE, *common, "--sigterm-at-batch", 7)  # rank 0 signalled (rank 1 exits 3: a peer's stop)
    marker = json.loads((tmp_path / "async" / "preempted.json").read_text())
    assert marker["step"] == 7, (marker, stopped.stderr[-2000:])
    check_ok(launch(PROBE, *common, "--resume-from-checkpoint", "latest"))
    assert_same_weights(tmp_path / "async", short_job)  # the same job, synchronous checkpoints, uninterrupted
    sync, background = checkpoint_files(short_job), checkpoint_files(tmp_path / "async")
    for name in ("step_5/optimizer.bin", "step_10/model.safetensors", "step_20/random_states_1.pkl"):
        assert sync[name] == background[name], name


@multiprocess
def test_under_fsdp_full_state_dict_on_two_processes_async_checkpoints_are_the_synchronous_ones(tmp_path):
    # the full state dicts are gathered on rank 0, staged and freed one after another: each file holds its own
    # object's values (an earlier version wrote a model tensor's values as an optimizer moment)
    yaml = (ROOT / "accelerate_configs" / "fsdp.yaml").read_text().replace("SHARDED_STATE_DICT", "FULL_STATE_DICT")
    config = write(tmp_path / "full_state_dict.yaml", yaml)
    common = [*ARGS, "--dropout", "0"]
    check_ok(launch(PROBE, "--output-dir", tmp_path / "sync", *common, config=config))
    check_ok(launch(PROBE, "--output-dir", tmp_path / "async", *common, "--async-checkpoint", config=config))
    sync, background = checkpoint_files(tmp_path / "sync"), checkpoint_files(tmp_path / "async")
    assert "step_10/optimizer.bin" in sync and "step_10/pytorch_model_fsdp.bin" in sync, sorted(sync)
    assert sync.keys() == background.keys()
    assert [name for name in sync if sync[name] != background[name]] == []


@inprocess
def test_staging_keeps_tied_weights_tied_and_containers_as_they_were(tmp_path):
    # tied weights share one staged storage, so that Accelerate drops the duplicate name as in a synchronous save
    # (model.safetensors would otherwise hold both, and the resume's strict load fail); a Counter, a defaultdict
    # and a state dict's _metadata come back as they went in
    import collections

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.out = torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False)
            self.out.weight = self.embed.weight

    try:
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(Tied())
        accelerator.save_state(str(tmp_path / "sync"))
        staged = async_save.StagedWrites()
        write_checkpoint(accelerator, tmp_path / "async", Contents(AcceleratorObjects([model])), staged)
        staged.write_all()
        assert (tmp_path / "async" / "model.safetensors").read_bytes() == (
            tmp_path / "sync" / "model.safetensors"
        ).read_bytes()
        accelerator.load_state(str(tmp_path / "async"))
        assert model.out.weight is model.embed.weight
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    state = collections.OrderedDict(w=torch.ones(2))
    state._metadata = {"": {"version": 1}}
    values = {"counts": collections.Counter(a=3), "lists": collections.defaultdict(list, b=[1]), "state": state}
    copied = async_save.StagedWrites()._copied(values)
    assert copied["counts"] == collections.Counter(a=3) and copied["lists"]["new"] == []
    assert copied["state"]._metadata == {"": {"version": 1}} and copied["state"]["w"] is not state["w"]


@inprocess
def test_waiting_for_a_write_is_watched_with_the_generous_bound_and_a_stop_s_save_has_its_own_kind(tmp_path):
    # the staging copy teaches the watchdog a short bound for "checkpoint"; neither the wait for a write (the disk's
    # pace) nor a stop's save at once may be held to it
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from ddp_accel.checkpoint import Checkpoints
    from ddp_accel.state import RunIdentity, TrainState

    activities = []
    try:
        accelerator = Accelerator(cpu=True)
        accelerator.prepare(torch.nn.Linear(2, 2))
        checkpoints = Checkpoints(accelerator, tmp_path)
        checkpoints.writer = async_save.CheckpointWriter()
        checkpoints.activity = lambda what, kind: activities.append((what, kind)) or contextlib.nullcontext()
        checkpoints.save_now(TrainState(step=1), RunIdentity())
        checkpoints.save_reached(TrainState(step=2), RunIdentity())
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert activities == [
        ("the checkpoint of step 1", "checkpoint"),
        ("the write of step_1", None),
        ("the checkpoint of step 2", "checkpoint written at once"),
    ], activities
    assert [path.name for path in complete_checkpoints(tmp_path)] == ["step_1", "step_2"]

"""One writer of the checkpoint format (ddp_accel/checkpoint_format.py): its files are Accelerate's own `save_state`'s,
byte for byte, written at once, staged for the background writer, or by a survivor for every rank; a component
registered once is written by every save and read by the loader."""

import os
import threading
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ddp_accel.async_save import StagedWrites
from ddp_accel.checkpoint import save_checkpoint
from ddp_accel.checkpoint_format import (
    HELD,
    AcceleratorObjects,
    Contents,
    HeldCheckpoint,
    Replica,
    WriteNow,
    held_step,
    hold,
    let_go_held,
    load_checkpoint,
    share_held,
    take_held,
    write_checkpoint,
)
from ddp_accel.random_streams import RandomStreams
from ddp_accel.state import RunIdentity, TrainState

pytestmark = pytest.mark.inprocess


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture
def trained(monkeypatch):
    """An Accelerator (fp32 on the CPU) and what a run hands its prepare, after one step: a model with buffers and
    tied weights, an optimizer with state, a scheduler, a loader."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.norm = torch.nn.Embedding(7, 4), torch.nn.BatchNorm1d(4)
            self.out = torch.nn.Linear(4, 7, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, tokens):
            return self.out(self.norm(self.embed(tokens)))

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = DataLoader(TensorDataset(torch.randint(0, 7, (16,))), batch_size=4, shuffle=True)
    prepared_model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    (batch,) = next(iter(loader))
    accelerator.backward(prepared_model(batch).logsumexp(-1).mean())
    optimizer.step()
    scheduler.step()
    yield accelerator, AcceleratorObjects([model], [optimizer], [scheduler], [loader])
    AcceleratorState._reset_state(reset_partial_state=True)


def test_the_files_are_accelerates_own_save_state_byte_for_byte_written_at_once_or_staged(tmp_path, trained):
    accelerator, objects = trained
    state = torch.get_rng_state()
    accelerator.save_state(str(tmp_path / "accelerate"))
    torch.set_rng_state(state)  # (nothing draws in between: the same streams on each side)
    write_checkpoint(accelerator, tmp_path / "now", Contents(objects), WriteNow())
    staged = StagedWrites()
    write_checkpoint(accelerator, tmp_path / "staged", Contents(objects), staged)
    staged.write_all()
    theirs = files_of(tmp_path / "accelerate")
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"} <= theirs.keys(), theirs
    for ours in ("now", "staged"):
        written = files_of(tmp_path / ours)
        assert written.keys() == theirs.keys(), (ours, sorted(written), sorted(theirs))
        assert [name for name in theirs if written[name] != theirs[name]] == [], ours


class Counter:
    """A component of the kind a new feature registers: a cursor that every rank shares."""

    name = "counter"
    each_rank = None

    def __init__(self, value: int = 0):
        self.value = value

    def save(self, folder, rank, ranks, save):
        if rank == 0:
            save({"value": self.value}, folder / "counter.pt")

    def load(self, folder, rank, ranks):
        self.value = torch.load(folder / "counter.pt")["value"]
        return [f"counter at {self.value}"]


def test_a_component_registered_once_is_written_by_every_save_and_read_by_the_loader(tmp_path, trained):
    accelerator, objects = trained
    saved = Contents(objects, [Counter(41)])
    save_checkpoint(accelerator, tmp_path / "sync", TrainState(step=3), RunIdentity(), contents=saved)
    from ddp_accel.async_save import CheckpointWriter

    writer = CheckpointWriter()
    save_checkpoint(accelerator, tmp_path / "async", TrainState(step=3), RunIdentity(), contents=saved, writer=writer)
    writer.wait()
    replica = Replica(RandomStreams.now(), {}, 2)
    write_checkpoint(accelerator, tmp_path / "survivor", saved, WriteNow(), replica=replica)
    for folder in (tmp_path / "sync" / "step_3", tmp_path / "async" / "step_3", tmp_path / "survivor"):
        assert (folder / "counter.pt").is_file(), sorted(os.listdir(folder))
    loaded = Contents(objects, [Counter()])
    notes = load_checkpoint(accelerator, tmp_path / "async" / "step_3", RunIdentity(), contents=loaded)
    assert loaded.components[0].value == 41 and "counter at 41" in notes


def saved_and_held(accelerator, root: Path, contents: Contents) -> tuple[Path, HeldCheckpoint]:
    """Step 1 saved under `root`, and held as a survivor holds the step it reached (its copy staged, then held)."""
    folder = save_checkpoint(accelerator, root, TrainState(step=1), RunIdentity(), contents=contents)
    staged = StagedWrites()
    write_checkpoint(accelerator, folder, contents, staged, create=False)
    return folder, hold(folder, staged, folder, contents.objects, (folder / "training_state.json").read_text())


def test_a_step_held_by_its_process_loads_from_its_copy_once_whatever_its_folder_holds(tmp_path, trained):
    # a survivor under --recover in-process keeps its copy of the step it saved (the bulk in memory, the small
    # files in a folder of its own): its next group's load reads nothing of the step's folder, which another
    # survivor may still be writing
    accelerator, objects = trained
    contents, model, optimizer, scheduler = Contents(objects), *objects.models, *objects.optimizers, *objects.schedulers

    def one_step():
        accelerator.backward(model(torch.arange(7)).logsumexp(-1).mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    def states():
        optimizer_state = [value.clone() for value in optimizer.state_dict()["state"][0].values()]
        schedule = torch.tensor(scheduler.state_dict()["last_epoch"])
        return [value.clone() for value in model.state_dict().values()] + optimizer_state + [schedule]

    folder, held = saved_and_held(accelerator, tmp_path, contents)
    assert sorted(held.files) == ["model.safetensors", "optimizer.bin"] and held.small.is_dir()
    in_memory = states()
    one_step()  # the folder's files now hold a later state than the one held
    assert save_checkpoint(accelerator, tmp_path, TrainState(step=1), RunIdentity(), contents=contents) == folder
    on_disk = states()
    one_step()
    assert held_step() == 1
    load_checkpoint(accelerator, folder, RunIdentity(), contents=contents, held=take_held(folder))
    assert all(torch.equal(now, then) for now, then in zip(states(), in_memory, strict=True))
    assert take_held(folder) is None and held_step() is None  # used once: the next load reads the files
    load_checkpoint(accelerator, folder, RunIdentity(), contents=contents, held=take_held(folder))
    assert all(torch.equal(now, then) for now, then in zip(states(), on_disk, strict=True))
    assert not held.small.exists()  # let go once loaded
    other, staged = tmp_path / "step_9", StagedWrites()
    write_checkpoint(accelerator, other, contents, staged, create=False)
    held = hold(other, staged, other, objects, (folder / "training_state.json").read_text())
    assert take_held(folder) is None and not held.small.exists()  # another step's: let go


def test_a_held_step_this_process_also_writes_in_the_background_loads_copies_of_the_optimizer_s_state(
    tmp_path, trained
):
    # an optimizer trains on the very tensors it loads (torch copies none of them on the same device): where the
    # held objects are also being written in the background (the writing survivor), the next group's steps must
    # not reach the files being written
    accelerator, objects = trained
    contents, model, optimizer = Contents(objects), *objects.models, *objects.optimizers
    from ddp_accel.checkpoint import RESCUE_WRITER
    from ddp_accel.rescue import finish_writes, write_in_background

    folder, held = saved_and_held(accelerator, tmp_path, contents)
    rescue, written = tmp_path / ".rescue_step_1", threading.Event()
    rescue.mkdir()
    (rescue / RESCUE_WRITER).write_text(str(os.getpid()))
    (tmp_path / "elsewhere").mkdir()
    write_in_background(written.wait, rescue, tmp_path / "elsewhere" / "step_1", "{}", 0, held)  # (in flight)
    being_written = held.files["optimizer.bin"]["state"][0]
    as_held = {name: value.clone() for name, value in being_written.items()}
    load_checkpoint(accelerator, folder, RunIdentity(), contents=contents, held=take_held(folder))
    accelerator.backward(model(torch.arange(7)).logsumexp(-1).mean())
    optimizer.step()  # (AdamW: its moments and step count updated in place)
    written.set()
    finish_writes()
    assert not torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], as_held["exp_avg"])
    assert all(torch.equal(being_written[name], value) for name, value in as_held.items()), sorted(as_held)


def test_a_process_given_a_peer_s_copy_of_the_step_loads_it_as_its_own_and_reads_nothing_of_its_folder(
    tmp_path, trained, monkeypatch
):
    # a replacement joining survivors that hold the step: it is given the first one's copy over the group
    # (peer_copy.share, proven across processes in test_recovery.py), keeps it as its own (its small files in a
    # folder of its own) and loads it whatever the step's folder holds meanwhile
    from ddp_accel import checkpoint_format

    accelerator, objects = trained
    contents, model, optimizer = Contents(objects), *objects.models, *objects.optimizers
    folder, survivor_s = saved_and_held(accelerator, tmp_path, contents)
    given = (2, survivor_s.files, checkpoint_format.contents_of(survivor_s.small))
    let_go_held()  # (this process, the replacement, holds nothing)
    weights = [value.clone() for value in model.state_dict().values()]
    moments = [value.clone() for value in optimizer.state_dict()["state"][0].values()]
    monkeypatch.setattr(checkpoint_format.peer_copy, "share", lambda held: given if held is None else held)
    for parameter in model.parameters():
        parameter.data.add_(1.0)
    save_checkpoint(accelerator, tmp_path, TrainState(step=1), RunIdentity(), contents=contents)  # other files now
    share_held(folder, 1)
    assert held_step() == 1 and HELD[0].given_by == 2 and HELD[0].small != survivor_s.small
    load_checkpoint(accelerator, folder, RunIdentity(), contents=contents, held=take_held(folder))
    assert all(torch.equal(now, then) for now, then in zip(model.state_dict().values(), weights, strict=True))
    now = optimizer.state_dict()["state"][0].values()
    assert all(torch.equal(now, then) for now, then in zip(now, moments, strict=True))


def test_a_survivor_writes_every_rank_s_streams_and_the_buffers_the_step_left(tmp_path, trained):
    accelerator, objects = trained
    streams = RandomStreams.now()
    torch.rand(5)  # (the survivor's own streams moved on after the step: the agreed ones are written)
    norm = objects.models[0].norm
    kept = {(0, "norm.running_mean"): norm.running_mean + 1.0}
    write_checkpoint(accelerator, tmp_path, Contents(objects), WriteNow(), replica=Replica(streams, kept, 3))
    for rank in range(3):
        written = torch.load(tmp_path / f"random_states_{rank}.pkl", weights_only=False)
        assert torch.equal(written["torch_manual_seed"], streams.accelerate["torch_manual_seed"]), rank
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "model.safetensors")
    assert torch.equal(weights["norm.running_mean"], norm.running_mean + 1.0)
    assert torch.equal(weights["norm.running_var"], norm.running_var)


def test_deepspeed_megatron_xla_and_fsdp1_are_saved_by_accelerates_own_writer(tmp_path):
    # their model and optimizer states go through their engines (a collective under ZeRO-3): Accelerate's
    # save_state writes that part, the run's components are written after it
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    written = []
    for kind, version in ((DistributedType.DEEPSPEED, None), (DistributedType.FSDP, 1), (DistributedType.XLA, None)):
        accelerator = SimpleNamespace(
            distributed_type=kind,
            state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=version)),
            save_state=lambda folder: written.append(folder),
            process_index=0,
            num_processes=1,
            is_main_process=True,
            project_configuration=SimpleNamespace(save_on_each_node=False),
        )
        folder = tmp_path / str(kind.value)
        write_checkpoint(accelerator, folder, Contents(components=[Counter(5)]), WriteNow())
        assert written[-1] == str(folder) and (folder / "counter.pt").is_file(), kind
    assert len(written) == 3

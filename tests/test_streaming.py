"""Tar shards read in place (ddp_accel.streaming, ddp_accel.vision.shards): the canonical order, a resume in it with
another worker count, and bad data in one line."""

import io
import os
import random
import shutil
import signal
import tarfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    STANDARD_PROBE_ARGS,
    assert_clean_error,
    assert_same_weights,
    check_ok,
    launch,
    metrics_of,
    rank_of,
    run_script,
    wait_for,
    workers,
)
from safetensors.torch import load_file
from test_imagenet import SMALL_ARCH, make_image_folder

from ddp_accel.errors import UserError
from ddp_accel.streaming import ShardManifest, ShardReader, WindowShuffle, read_members
from ddp_accel.vision.shards import write_shards

inprocess = pytest.mark.inprocess


def shards_of(tmp_path: Path, train: int = 8, per_shard: int = 5) -> Path:
    images = make_image_folder(tmp_path / "images", classes=3, train=train, val=2)
    write_shards(images, tmp_path / "shards", samples_per_shard=per_shard)
    return tmp_path / "shards"


@inprocess
def test_an_epoch_is_a_permutation_drawn_from_the_seed_and_the_epoch_alone_within_windows():
    counts = [7, 5, 9, 4]  # 25 samples in 4 shards
    order = WindowShuffle(counts, seed=3, window=6)
    first = list(order)
    assert sorted(first) == list(range(25)) and first == list(WindowShuffle(counts, seed=3, window=6))
    # whatever a rank drew before (Accelerate's shape of this bug: a permutation drawn from a generator whose state
    # the ranks had not agreed): the global generators are not read
    random.random(), np.random.rand(), torch.rand(3)
    assert list(WindowShuffle(counts, seed=3, window=6)) == first
    order.set_epoch(1)
    assert list(order) != first and sorted(order) == list(range(25))
    # each window of 6 holds 6 consecutive samples of the epoch's shard order: a worker reads one or two shards
    order.set_epoch(0)
    starts = np.cumsum([0, *counts])
    stream = [index for shard in order.shard_order() for index in range(starts[shard], starts[shard + 1])]
    for block in range(0, 25, 6):
        assert sorted(first[block : block + 6]) == sorted(stream[block : block + 6])
    assert list(WindowShuffle(counts, seed=3, window=6, shuffle=False)) == list(range(25))
    # the shards' order is drawn again each epoch (windows of one sample: the shards' order alone)
    shards_only = WindowShuffle([2] * 10, seed=3, window=1)
    epochs = set()
    for epoch in range(5):
        shards_only.set_epoch(epoch)
        epochs.add(tuple(shards_only))
    assert len(epochs) == 5


@inprocess
def test_the_writer_s_shards_hold_every_image_once_and_read_back_by_index(tmp_path):
    shards = shards_of(tmp_path)
    manifest = ShardManifest.of(shards / "train")
    assert manifest.counts == [5, 5, 5, 5, 4] and manifest.classes == ("class0", "class1", "class2")
    reader = ShardReader(manifest)
    images = sorted((tmp_path / "images" / "train").rglob("*.jpg"))
    read = sorted(reader.read(index)[2]["jpg"] for index in range(len(manifest)))
    assert read == sorted(path.read_bytes() for path in images)  # every image once, its bytes as they are
    labels = [int(reader.read(index)[2]["cls"]) for index in range(len(manifest))]
    assert sorted(labels) == [0] * 8 + [1] * 8 + [2] * 8
    assert len(set(labels[:5])) > 1  # in an order of the writer's seed, not class by class


@pytest.mark.parametrize("workers", [("2", "1")], ids=["workers-2-then-1"])
@inprocess
def test_a_run_on_shards_resumed_mid_epoch_with_another_worker_count_ends_bitwise(tmp_path, workers):
    shards = shards_of(tmp_path)  # 24 training images: 6 steps of 4 an epoch
    args = ["-a", SMALL_ARCH, "--image-size", "16", "--augment", "cifar", "-b", "4", "--lr", "0.05"]
    args += ["--epochs", "2", "--checkpointing-steps", "4"]
    check_ok(run_script("scripts/imagenet.py", shards, *args, "-j", workers[0], "--output-dir", tmp_path / "full"))
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_4", tmp_path / "cut" / "checkpoints" / "step_4")
    shutil.copy(tmp_path / "full" / "history.json", tmp_path / "cut" / "history.json")
    cut = ["-j", workers[1], "--output-dir", tmp_path / "cut", "--resume", "latest"]
    output = check_ok(run_script("scripts/imagenet.py", shards, *args, *cut))
    assert "skipping 4 batches" in output, output[-2000:]
    full = load_file(tmp_path / "full" / "model.safetensors")
    resumed = load_file(tmp_path / "cut" / "model.safetensors")
    assert all((full[key] == resumed[key]).all() for key in full)
    write_shards(tmp_path / "images", shards, samples_per_shard=5, seed=1)  # the same images, in other shards
    output = run_script("scripts/imagenet.py", shards, *args, *cut)
    assert_clean_error(output, "data: shard train/000000.tar changed")


@inprocess
def test_bad_shards_are_one_line_naming_the_shard(tmp_path):
    shards = shards_of(tmp_path)
    args = ["-a", SMALL_ARCH, "--image-size", "16", "--augment", "cifar", "-b", "4", "-j", "0", "--max-steps", "2"]
    first = shards / "train" / "000000.tar"
    intact = first.read_bytes()
    first.write_bytes(intact[: len(intact) // 2])  # truncated, as by a copy cut short
    output = run_script("scripts/imagenet.py", shards, *args, "--output-dir", tmp_path / "a")
    assert_clean_error(output, f"shard {first} changed since its manifest.json was written")
    with pytest.raises(UserError, match=f"shard {first} (is truncated|cannot be read)"):
        read_members(first)  # what a scan without a manifest says
    first.write_bytes(intact)
    (shards / "train" / "000001.tar").unlink()
    output = run_script("scripts/imagenet.py", shards, *args, "--output-dir", tmp_path / "b")
    assert_clean_error(output, f"shard {shards / 'train' / '000001.tar'} is missing from the folder")
    (shards / "train" / "manifest.json").unlink()  # foreign shards: counted from their headers, no class names
    output = run_script("scripts/imagenet.py", shards, *args, "--output-dir", tmp_path / "c")
    assert_clean_error(output, "has no manifest.json naming its classes")


@inprocess
def test_a_sample_without_its_label_is_named(tmp_path):
    images = make_image_folder(tmp_path / "images", classes=2, train=2, val=1)
    shards = tmp_path / "shards"
    write_shards(images, shards, samples_per_shard=10)
    train = shards / "train" / "000000.tar"
    with tarfile.open(train) as archive:
        members = [(info, archive.extractfile(info).read()) for info in archive.getmembers()]
    unlabelled = members[1][0].name.split(".")[0]
    with tarfile.open(train, "w") as archive:
        for info, data in members:
            if not (info.name.startswith(unlabelled) and info.name.endswith(".cls")):
                archive.addfile(info, io.BytesIO(data))
    replace(ShardManifest.scanned(shards / "train", ["000000.tar"]), classes=("class0", "class1")).write()
    args = ["-a", SMALL_ARCH, "--image-size", "16", "--augment", "cifar", "-b", "2", "-j", "0", "--epochs", "1"]
    output = run_script("scripts/imagenet.py", shards, *args, "--output-dir", tmp_path / "run")
    assert_clean_error(output, f"sample {unlabelled} has no label (.cls)")


@pytest.mark.parametrize("kind", ["ustar", "gnu", "pax"])
@inprocess
def test_a_tar_shard_s_index_is_what_tarfile_reads_in_each_format(tmp_path, kind):
    # headers read one by one, pax records and GNU long names included (the writers' formats); a member a header
    # of another kind announces is left to the standard library
    shard = tmp_path / "000000.tar"
    long = "x" * 120 if kind != "ustar" else "x"
    with tarfile.open(shard, "w", format=getattr(tarfile, f"{kind.upper()}_FORMAT")) as archive:
        for number, name in enumerate(["000.jpg", f"000.{long}.cls", "sub/001.png", f"{'y' * 90}/001.cls"]):
            info = tarfile.TarInfo(name if kind != "ustar" or len(name) < 100 else name[-20:])
            info.size, info.mtime = 7 * number + 3, 1.5
            archive.addfile(info, io.BytesIO(bytes(info.size)))
        folder = tarfile.TarInfo("folder")
        folder.type = tarfile.DIRTYPE  # not a sample
        archive.addfile(folder)
    with tarfile.open(shard) as archive:
        expected = [(info.name, info.offset_data, info.size) for info in archive if info.isfile()]
    members = read_members(shard)
    assert [(f"{m.key}.{ext}", *place) for m in members for ext, place in m.files.items()] == expected
    corrupt = bytearray(shard.read_bytes())
    corrupt[5] ^= 0x01  # a byte of the first header: its checksum no longer matches
    shard.write_bytes(bytes(corrupt))
    with pytest.raises(UserError, match=f"shard {shard} cannot be read"):
        read_members(shard)


@inprocess
def test_a_reader_in_the_canonical_order_indexes_each_shard_once(tmp_path, monkeypatch):
    # a window jumps at random between the shards it spans: a reader keeping fewer indexes than that builds them
    # again and again (a tar shard's index is a scan of its headers)
    import ddp_accel.streaming as streaming

    for shard in range(12):
        rows = "".join(f'{{"i": {shard * 10 + row}}}\n' for row in range(10 if shard < 11 else 3))
        (tmp_path / f"{shard:06d}.jsonl").write_text(rows)
    manifest = ShardManifest.of(tmp_path, (".jsonl",))
    built = []
    monkeypatch.setattr(streaming, "shard_index", lambda path: built.append(path.name) or streaming.JsonlIndex(path))
    reader = ShardReader(manifest, window=35)
    for epoch in range(3):
        built.clear()
        order = WindowShuffle(manifest.counts, seed=0, window=35)
        order.set_epoch(epoch)
        assert [reader.read(index)[2]["i"] for index in order] == list(order)
        assert len(built) == len(set(built)) and (epoch or len(built) == 12), built  # each at most once an epoch


@inprocess
def test_the_ranks_of_any_world_size_share_out_each_global_batch_of_the_order(tmp_path):
    # Accelerate's batch sharding of the canonical order: N processes x B take, step by step, the samples 1 x N*B
    # takes; a rank reads its own samples only
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    order = WindowShuffle([7, 5, 9, 4, 11], seed=1, window=8)

    def steps(processes: int, batch: int) -> list[list[set[int]]]:
        shards = [
            list(BatchSamplerShard(BatchSampler(order, batch, False), processes, rank, even_batches=False))
            for rank in range(processes)
        ]
        return [[set(shard[step]) for shard in shards] for step in range(len(shards[0]))]

    one = [step[0] for step in steps(1, 12)]
    for processes, batch in ((2, 6), (3, 4)):
        sharded = steps(processes, batch)
        assert [set().union(*step) for step in sharded] == one[: len(sharded)]
        assert all(not a & b for step in sharded for a in step for b in step if a is not b)


@pytest.mark.multiprocess
def test_on_shards_two_processes_train_what_one_does_and_a_resume_on_one_goes_on_from_their_checkpoint(tmp_path):
    # 24 images, a global batch of 8: 3 steps, one epoch (in so tiny a BatchNorm net, where a channel's statistics
    # come from a few values, a rounding difference can grow past float rounding within a few more steps)
    shards = shards_of(tmp_path)
    args = ["-a", SMALL_ARCH, "--image-size", "16", "--augment", "cifar", "--lr", "0.05", "-j", "0", "--epochs", "1"]
    args += ["--sync-bn", "--checkpointing-steps", "2"]  # SyncBatchNorm: the global batch's statistics, as on one
    check_ok(run_script("scripts/imagenet.py", shards, *args, "-b", "8", "--output-dir", tmp_path / "one"))
    check_ok(launch("scripts/imagenet.py", shards, *args, "-b", "4", "--output-dir", tmp_path / "two"))
    # the 2-process run's step 2 (mid-epoch), resumed on one process x 8: the same samples from there on
    shutil.copytree(tmp_path / "two" / "checkpoints" / "step_2", tmp_path / "resized" / "checkpoints" / "step_2")
    shutil.copy(tmp_path / "two" / "history.json", tmp_path / "resized" / "history.json")
    resume = ["-b", "8", "--output-dir", tmp_path / "resized", "--resume", "latest"]
    output = check_ok(run_script("scripts/imagenet.py", shards, *args, *resume))
    assert "skipping 2 batches" in output, output[-2000:]
    # every validation image counted once on 2 processes (the second's batch padded by Accelerate, dropped again)
    assert metrics_of(tmp_path / "two")["eval_samples"] == metrics_of(tmp_path / "one")["eval_samples"] == 6
    one = load_file(tmp_path / "one" / "model.safetensors")
    for other in ("two", "resized"):  # within float rounding: the gradient is summed in another order
        weights = load_file(tmp_path / other / "model.safetensors")
        for key in one:
            torch.testing.assert_close(one[key], weights[key], atol=1e-5, rtol=1e-4)


@inprocess
def test_a_loader_sharded_over_processes_passes_the_epoch_to_its_dataset():
    # Accelerate's DataLoaderShard.set_epoch sets a sharded loader's sampler's epoch and then not its dataset's:
    # with -j 0 each sample's augmentation seed (seed, epoch, index) stayed at epoch 0 on 2 processes, and the
    # run drew other augmentations than on one process from its second epoch on
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader, Dataset

    from ddp_accel.training import set_loader_epoch

    class Epochs(Dataset):
        epoch = 0

        def __len__(self):
            return 8

        def __getitem__(self, index):
            return index

        def set_epoch(self, epoch):
            self.epoch = epoch

    for processes in (1, 2):
        dataset = Epochs()
        loader = DataLoader(dataset, batch_size=2, sampler=WindowShuffle([8], seed=0, window=4))
        sharded = prepare_data_loader(loader, num_processes=processes, process_index=0, put_on_device=False)
        set_loader_epoch(sharded, 3)
        assert dataset.epoch == 3 and loader.sampler.epoch == 3, processes


SHARDED_PROBE = [*STANDARD_PROBE_ARGS, "--step-ms", "40", "--checkpointing-steps", "1000"]


@pytest.fixture(scope="module")
def sharded_reference(tmp_path_factory):
    """The probe's standard job on jsonl shards read in place (256 samples in 6 shards), uninterrupted."""
    from probe import write_id_shards

    root = tmp_path_factory.mktemp("sharded")
    write_id_shards(root / "shards", 256, per_shard=48)
    args = [*STANDARD_PROBE_ARGS, "--shards", root / "shards", "--output-dir", root / "reference"]
    check_ok(launch("tests/probe.py", *args, launcher="torchrun"))
    return root


@pytest.mark.multiprocess
@pytest.mark.parametrize("fault", ["rank-1-killed", "rank-1-preempted"])
def test_on_shards_a_lost_or_preempted_rank_s_run_resumes_where_the_stream_was(sharded_reference, tmp_path, fault):
    # killed: the survivor saves the step it reached, its place in the stream with it; preempted (SIGUSR1 to one
    # worker): the ranks agree on a step and save it. The group restarted in place resumes there, bitwise
    from test_faults import finish, resumed_steps, torchrun

    output_dir = tmp_path / fault
    command = [*SHARDED_PROBE, "--shards", sharded_reference / "shards", "--resume-from-checkpoint", "latest"]
    agent = torchrun(output_dir, *command, max_restarts=1)
    log_file = output_dir.with_suffix(".log")
    wait_for(lambda: "train:" in log_file.read_text(), alive=agent, what="the training")
    time.sleep(0.8)  # some steps in, mid-epoch (32 steps of 40 ms an epoch)
    rank_1 = next(pid for pid in wait_for(lambda: workers(agent)) if rank_of(pid) == 1)
    os.kill(rank_1, signal.SIGKILL if fault == "rank-1-killed" else signal.SIGUSR1)
    code, log = finish(agent, output_dir)
    assert code == 0, log[-3000:]
    said = "saved the step it reached for the restart" if fault == "rank-1-killed" else "preempted by SIGUSR1 at step"
    assert said in log, log[-3000:]
    resumed = resumed_steps(log)
    assert len(resumed) == 1 and resumed[0] % 32 != 0, log[-3000:]  # mid-epoch: a place inside the stream
    assert_same_weights(sharded_reference / "reference", output_dir)


@pytest.mark.multiprocess
def test_on_shards_a_run_stopped_on_2_processes_then_on_3_ends_on_1_as_the_uninterrupted_run(tmp_path):
    # the same global batch of 12 (2 x 6, 3 x 4, 1 x 12): each stop (SIGTERM: the step reached is saved) resumed on
    # another number of processes goes on with the same samples in the same order; with --exact-micro-batch (each
    # piece's gradient and dropout its own, added in the global order) the weights end bitwise the uninterrupted run's
    from probe import write_id_shards
    from test_faults import finish, read_marker, torchrun

    write_id_shards(tmp_path / "shards", 240, per_shard=50)
    common = [*SHARDED_PROBE, "--shards", tmp_path / "shards", "--exact-micro-batch", "2", "--epochs", "2"]
    check_ok(run_script("tests/probe.py", *common, "--batch-size", "12", "--output-dir", tmp_path / "reference"))
    output_dir = tmp_path / "resized"
    stopped = []
    for processes in (2, 3):
        resume = ["--batch-size", str(12 // processes), "--resume-from-checkpoint", "latest"]
        agent = torchrun(output_dir, *common, *resume, nproc=processes)
        wait_for(lambda: "train:" in output_dir.with_suffix(".log").read_text(), alive=agent, what="the training")
        time.sleep(0.6)
        agent.send_signal(signal.SIGTERM)
        wait_for(lambda: (read_marker(output_dir) or {}).get("step") not in (None, *stopped), timeout=60)
        finish(agent, output_dir)
        stopped.append(read_marker(output_dir)["step"])
    assert stopped[0] < stopped[1] < 40, stopped  # 20 steps an epoch
    resume = ["--batch-size", "12", "--resume-from-checkpoint", "latest", "--output-dir", output_dir]
    output = check_ok(run_script("tests/probe.py", *common, *resume))
    assert f"step_{stopped[1]}" in output, output[-3000:]
    assert_same_weights(tmp_path / "reference", output_dir)

"""Nothing a user trained is destroyed or falsified: a run's identity, artifacts committed once, a full disk, data
that parses but is wrong, values the libraries underneath reject. In-process through run_main."""

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import time

import numpy as np
import psutil
import pytest
from helpers import BIN, assert_clean_error, check_ok, metrics_of, run_script, snapshot
from PIL import Image

from ddp_accel.files import write_json

pytestmark = pytest.mark.inprocess

IMDB = ["--buckets", 1000, "--min-freq", 1, "--batch-size", 8, "--epochs", 2]


def reviews(path, count: int, offset: int = 0, labels=None):
    words = ["great fun", "awful mess"]
    rows = [
        {"text": f"{words[i % 2]} film {i + offset}", "label": labels[i] if labels else (i + 1) % 2}
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def text_files(tmp_path):
    return reviews(tmp_path / "train.jsonl", 60), reviews(tmp_path / "test.jsonl", 30, 100)


def test_a_new_test_file_is_evaluated_not_a_cached_one(tmp_path, text_files):
    train, test = text_files
    test10 = reviews(tmp_path / "test10.jsonl", 10, 500)
    out = tmp_path / "out"
    check_ok(run_script("scripts/imdb.py", *IMDB, "--train-file", train, "--test-file", test, "--output-dir", out))
    assert metrics_of(out)["test_samples"] == 30
    common = ["--train-file", train, "--test-file", test10, "--output-dir", out, "--overwrite-output-dir"]
    check_ok(run_script("scripts/imdb.py", *IMDB, *common))
    assert metrics_of(out)["test_samples"] == 10


def test_a_resume_under_another_identity_is_one_line_and_changes_nothing(tmp_path, text_files):
    train, _ = text_files
    out = tmp_path / "out"
    first = ["--train-file", train, "--output-dir", out, "--checkpointing-steps", 3, "--max-steps", 3]
    check_ok(run_script("scripts/imdb.py", *IMDB, *first))
    before = snapshot(out)
    resume = ["--train-file", train, "--output-dir", out, "--resume-from-checkpoint", "latest"]
    assert_clean_error(run_script("scripts/imdb.py", *IMDB, *resume, "--ngrams", 2), "--ngrams was 3, now 2")
    other = reviews(tmp_path / "other.jsonl", 60, 1000)
    assert_clean_error(
        run_script("scripts/imdb.py", *IMDB, *resume[2:], "--train-file", other), "train data was 'file sha256:"
    )
    assert snapshot(out) == before


def test_a_failed_command_leaves_every_file_of_the_output_dir_as_it_was(tmp_path, text_files):
    train, _ = text_files
    out = tmp_path / "out"
    check_ok(run_script("scripts/imdb.py", *IMDB, "--train-file", train, "--output-dir", out))
    before = snapshot(out)
    predicted = check_ok(run_script("scripts/imdb.py", "--output-dir", out, "--predict", "great fun film"))
    other = reviews(tmp_path / "other.jsonl", 60, 1000)
    mistyped = ["--resume-from-checkpoint", out / "checkpoints" / "step_9", "--overwrite-output-dir"]
    result = run_script("scripts/imdb.py", *IMDB, "--train-file", other, "--output-dir", out, *mistyped)
    assert_clean_error(result, "no such checkpoint")
    assert snapshot(out) == before  # vocab.json and args.json included: --predict still answers the same
    assert check_ok(run_script("scripts/imdb.py", "--output-dir", out, "--predict", "great fun film")) == predicted


def test_rerunning_a_finished_run_changes_nothing_and_a_longer_one_continues(tmp_path):
    out = tmp_path / "out"
    args = ["--batch-size", 4, "--epochs", 2, "--checkpointing-steps", 4, "--output-dir", out]
    check_ok(run_script("tests/probe.py", *args, "--resume-from-checkpoint", "latest"))
    before = snapshot(out)
    again = check_ok(run_script("tests/probe.py", *args, "--resume-from-checkpoint", "latest"))
    assert "is complete (32 steps); nothing to do" in again
    assert {k: v for k, v in snapshot(out).items() if not k.startswith("seen_rank")} == {
        k: v for k, v in before.items() if not k.startswith("seen_rank")
    }
    # the same run asked for on twice the processes (or at half the batch): complete by epochs and samples, although
    # its steps are counted at another global batch (64 of them at batch 2, 32 committed at batch 4)
    half = check_ok(run_script("tests/probe.py", "--batch-size", 2, *args[2:], "--resume-from-checkpoint", "latest"))
    assert "is complete (32 steps); nothing to do" in half, half[-2000:]
    longer = check_ok(
        run_script("tests/probe.py", *args[:2], "--epochs", 3, *args[4:], "--resume-from-checkpoint", "latest")
    )
    assert "resumed from" in longer and metrics_of(out)["steps"] == 48
    metrics = metrics_of(out)
    assert metrics["train_loss"] is not None and metrics["train_samples"] > 0


def test_a_resume_past_the_steps_asked_for_is_refused(tmp_path):
    out = tmp_path / "out"
    check_ok(
        run_script(
            "tests/probe.py", "--batch-size", 4, "--max-steps", 8, "--checkpointing-steps", 4, "--output-dir", out
        )
    )
    (out / "model.safetensors").unlink()  # an unfinished run: checkpoints up to step 8
    (out / "metrics.json").unlink()
    before = snapshot(out)
    result = run_script(
        "tests/probe.py", "--batch-size", 4, "--max-steps", 5, "--output-dir", out, "--resume-from-checkpoint", "latest"
    )
    assert_clean_error(result, "is at step 8, past the 5 steps this command asks for")
    assert snapshot(out) == before
    step_4 = out / "checkpoints" / "step_4"  # an earlier step, given explicitly: allowed
    check_ok(
        run_script(
            "tests/probe.py",
            "--batch-size",
            4,
            "--max-steps",
            5,
            "--output-dir",
            out,
            "--resume-from-checkpoint",
            step_4,
        )
    )


def test_the_imagenet_best_model_and_score_survive_a_rerun(tmp_path):
    from test_imagenet import SMALL, make_image_folder

    data = make_image_folder(tmp_path / "images", classes=3, train=4, val=2)
    out = tmp_path / "out"
    args = [data, *SMALL, "--epochs", 2, "--checkpointing-steps", "epoch", "--output-dir", out, "--resume", "latest"]
    check_ok(run_script("scripts/imagenet.py", *args))
    best = metrics_of(out)["best_top1"]
    assert best >= 0 and (out / "model_best.safetensors").is_file()
    before = snapshot(out)
    check_ok(run_script("scripts/imagenet.py", *args))
    assert snapshot(out) == before and metrics_of(out)["best_top1"] == best


def test_metrics_are_valid_json_without_nan(tmp_path):
    write_json(tmp_path / "m.json", {"loss": float("nan"), "list": [float("inf"), 1.0], "ok": 2})
    assert json.loads((tmp_path / "m.json").read_text()) == {"loss": None, "list": [None, 1.0], "ok": 2}


def test_a_second_run_into_one_output_dir_names_the_holder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    descriptor = os.open(out, os.O_RDONLY)  # this process plays the run that holds the folder
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = run_script("tests/probe.py", "--output-dir", out, "--max-steps", 2)
        assert_clean_error(result, f"is in use by another run (pid {os.getpid()}:")
        assert list(out.iterdir()) == []
    finally:
        os.close(descriptor)  # the holder ends: its lock goes with it
    check_ok(run_script("tests/probe.py", "--output-dir", out, "--max-steps", 2))


@contextlib.contextmanager
def tiny_disk(path, size: str = "3m"):
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a full disk is simulated with a tmpfs mount, which needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


FSDP = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}  # as accelerate launch hands fsdp.yaml to a process


@pytest.mark.parametrize(
    "extra, env",
    [
        ([], {}),
        (["--async-checkpoint"], {}),
        (["--async-checkpoint", "--eval-steps", 1], {}),  # the best model's staging too
        ([], FSDP),
        (["--async-checkpoint"], FSDP),
    ],
    ids=["ddp", "ddp-async", "ddp-async-best-model", "fsdp", "fsdp-async"],
)
def test_a_full_disk_is_one_line_naming_the_path_and_leaves_no_partial_files(tmp_path, extra, env):
    # under FSDP torch.distributed.checkpoint wraps the OSError in its CheckpointException (a 252-line traceback
    # from 2 ranks), safetensors in an "I/O error", and history.json and failures/ were written unguarded
    with tiny_disk(tmp_path / "disk") as disk:
        out = disk / "out"
        args = ["--hidden", 20000, "--max-steps", 3, "--checkpointing-steps", 1, "--output-dir", out, *extra]
        result = run_script("tests/probe.py", *args, env=env)  # a checkpoint of ~1 MB of weights, 2 MB of moments
        line = assert_clean_error(result, "no space left on its device")
        assert str(out) in line
        assert not list(out.rglob(".tmp_step_*")) and not list(out.rglob("*.partial")), sorted(out.rglob("*"))
        assert not (out / "failures").exists()


def test_data_that_parses_but_is_wrong_is_one_line(tmp_path):
    def imdb(train):
        return run_script("scripts/imdb.py", *IMDB, "--train-file", train, "--output-dir", tmp_path / "out")

    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"text": "a", "label": 1}\n{"text": "b", "label": "neg"}\n{"text": "c", "label": 0}\n')
    assert_clean_error(imdb(mixed), "labels of mixed types: row 1 has 1, row 2 has 'neg'")
    listed = tmp_path / "list.jsonl"
    listed.write_text('{"text": "a", "label": [1]}\n{"text": "b", "label": [0]}\n')
    assert_clean_error(imdb(listed), "row 1 has the label [1] (list)")
    one_class = reviews(tmp_path / "one.jsonl", 20, labels=["pos"] * 20)
    assert_clean_error(imdb(one_class), "every review is labelled positive")
    assert not (tmp_path / "out").exists()


def test_images_are_decoded_as_they_are_or_refused_with_a_line(tmp_path):
    from test_imagenet import SMALL, make_image_folder

    from ddp_accel.vision.data import load_image

    grey16 = tmp_path / "grey16.png"
    Image.fromarray((np.arange(32 * 32).reshape(32, 32) * 60).astype(np.uint16)).save(grey16)
    assert Image.open(grey16).mode == "I;16"
    assert 100 < np.asarray(load_image(str(grey16))).mean() < 160  # not clipped to white (255)
    Image.new("P", (8, 8), 3).save(tmp_path / "palette.png")
    Image.new("CMYK", (8, 8), (0, 0, 0, 0)).save(tmp_path / "cmyk.jpg")
    assert all(load_image(str(tmp_path / name)).mode == "RGB" for name in ("palette.png", "cmyk.jpg"))

    data = make_image_folder(tmp_path / "images", classes=2, train=2, val=1)
    run = ["scripts/imagenet.py", data, *SMALL, "--output-dir", tmp_path / "out"]
    os.symlink(data / "train", data / "train" / "class0" / "loop")  # a link back up: a file-system loop
    assert_clean_error(run_script(*run), "a symbolic-link loop", "class0/loop")
    (data / "train" / "class0" / "loop").unlink()
    limit = Image.MAX_IMAGE_PIXELS
    Image.new("L", (100, 100)).save(data / "train" / "class0" / "bomb.png")
    Image.MAX_IMAGE_PIXELS = 1000  # the 100x100 image is now over twice PIL's limit: a decompression bomb to PIL
    try:
        assert_clean_error(run_script(*run), "bomb.png has more pixels than PIL's decompression-bomb limit")
    finally:
        Image.MAX_IMAGE_PIXELS = limit
    (data / "train" / "class0" / "bomb.png").unlink()
    for path in (data / "train" / "class1").iterdir():
        path.unlink()
    (data / "train" / "class1").rmdir()
    (data / "val" / "class1").joinpath("0.jpg").unlink()
    (data / "val" / "class1").rmdir()
    assert_clean_error(run_script(*run), "has one class folder (class0)")


def test_values_that_would_not_fit_in_memory_are_refused_before_allocating(tmp_path):
    result = run_script("scripts/imagenet.py", "--dummy", "--dummy-classes", 10**12, "--output-dir", tmp_path / "out")
    assert_clean_error(result, "--dummy-classes 1000000000000 needs about", "GiB of memory")


def test_a_weights_file_that_is_not_a_state_dict_is_one_line(tmp_path):
    import torch

    from ddp_accel.errors import UserError
    from ddp_accel.vision.models import build_model

    torch.save([torch.zeros(3)], tmp_path / "list.pth")
    (tmp_path / "garbage.pth").write_bytes(b"not a torch file at all")
    for name, message in (("list.pth", "not a state dict"), ("garbage.pth", "cannot be read as weights")):
        with pytest.raises(UserError, match=message):
            build_model("cifar_resnet20", 10, pretrained=str(tmp_path / name))
    source = build_model("cifar_resnet20", 10)  # a classic checkpoint dict, DDP's module. prefix included
    wrapped = {"epoch": 3, "model_state_dict": {f"module.{k}": v for k, v in source.state_dict().items()}}
    torch.save(wrapped, tmp_path / "checkpoint.pth")
    loaded = build_model("cifar_resnet20", 10, pretrained=str(tmp_path / "checkpoint.pth"))
    assert all(
        torch.equal(a, b) for a, b in zip(source.state_dict().values(), loaded.state_dict().values(), strict=True)
    )


def test_a_save_longer_than_the_launchers_grace_is_warned_once(tmp_path):
    # under torch elastic (TORCHELASTIC_RUN_ID) with a grace far below any save time
    env = {"TORCHELASTIC_RUN_ID": "test", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "0"}
    result = run_script(
        "tests/probe.py", "--max-steps", 2, "--checkpointing-steps", 1, "--output-dir", tmp_path, env=env
    )
    output = check_ok(result)
    assert output.count("warning: saving a checkpoint takes") == 1, output[-2000:]
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in output and "GRACE_S" in output


@pytest.mark.inprocess
def test_each_launchers_grace_is_known_with_how_to_have_more(monkeypatch, capsys):
    from ddp_accel import stopping

    accelerate_launch = ["/venv/bin/python", "/venv/bin/accelerate", "launch", "--num_processes", "1", "x.py"]
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for version, grace in (("1.15.0", None), ("1.16.0", 5.0), ("1.17.0", 5.0)):
        monkeypatch.setattr("importlib.metadata.version", lambda name, version=version: version)
        found = stopping.launcher_grace(accelerate_launch)
        assert (found and found[0]) == grace, version
    assert stopping.launcher_grace(["bash", "-c", "python x.py"]) is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "90")
    assert stopping.launcher_grace(accelerate_launch)[0] == 90.0  # (a multi-process accelerate launch: torchrun)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setattr(stopping.launch_environments, "parent_command", lambda: accelerate_launch)
    grace = stopping.SaveGrace(is_main_process=True)
    grace.check(4.0)
    grace.check(6.0)
    grace.check(60.0)
    said = capsys.readouterr().err
    assert said.count("warning: saving a checkpoint takes 6 s, more than the 5 s") == 1, said
    assert "torchrun --nproc_per_node 1" in said


@pytest.mark.versions
def test_a_one_process_accelerate_launch_kills_its_script_as_launcher_grace_says(tmp_path):
    # the fact behind launcher_grace: Accelerate 1.16's one-process launcher passes a SIGTERM on and kills the
    # script 5 s later; before 1.16 the launcher died alone and the script went on (then launcher_grace is None)
    script = tmp_path / "slow_save.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from ddp_accel.stopping import launcher_grace\n"
        "signaled, launcher = [], os.getppid()\n"
        "signal.signal(signal.SIGTERM, lambda *_: signaled.append(time.monotonic()))\n"
        "grace = launcher_grace()\n"
        "print('grace', grace and grace[0], os.getpid(), flush=True)\n"
        "while not signaled and os.getppid() == launcher: time.sleep(0.05)  # signalled, or the launcher gone\n"
        "time.sleep(3 * (grace[0] if grace else 5))  # a save far longer than the grace\n"
        "print('saved', flush=True)\n"
    )
    log = tmp_path / "log.txt"
    with log.open("w") as out:
        launcher = subprocess.Popen(
            [str(BIN / "accelerate"), "launch", "--cpu", "--num_processes", "1", str(script)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 120
        while "grace" not in log.read_text() and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
    said = [line.split() for line in log.read_text().splitlines() if line.startswith("grace ")]
    assert said, log.read_text()[-2000:]
    grace, script_pid = said[0][1], int(said[0][2])
    try:
        gone_by = time.monotonic() + 30
        while time.monotonic() < gone_by and psutil.pid_exists(script_pid):
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(script_pid, signal.SIGKILL)
    output = log.read_text()
    if grace == "5.0":
        assert "saved" not in output, output[-2000:]  # killed within its grace, as said
    else:
        assert grace == "None" and "saved" in output, output[-2000:]  # the script went on alone


def test_a_file_system_failure_is_recognised_however_a_library_wraps_it():
    import errno

    from ddp_accel.files import NO_SPACE, file_system_reason

    class CheckpointException(BaseException):  # torch.distributed.checkpoint's: rank -> (exception, traceback)
        def __init__(self, failures):
            self.failures = failures

    assert file_system_reason(OSError(errno.ENOSPC, "No space left on device")) == NO_SPACE
    assert (
        file_system_reason(RuntimeError("I/O error: No space left on device (os error 28)")) == NO_SPACE
    )  # safetensors
    gathered = CheckpointException({1: (RuntimeError("[enforce fail] unexpected pos 704 vs 598"), "tb")})
    assert file_system_reason(gathered) == NO_SPACE
    assert file_system_reason(OSError(errno.EROFS, "Read-only file system")) == "Read-only file system"
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as quota:
            raise ValueError("could not save") from quota
    except ValueError as wrapped:
        assert file_system_reason(wrapped) == NO_SPACE
    assert file_system_reason(ValueError("a bug")) is None

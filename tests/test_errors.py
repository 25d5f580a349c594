"""Mistakes a user can make end in one clear line and a non-zero exit, never a traceback.

In-process through run_main (exit code and the one stderr line); one launched test per error channel (accelerate
launch, torchrun), and the errors whose point is several processes."""

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest
import torch
from helpers import (
    BIN,
    ROOT,
    Result,
    assert_clean_error,
    check_ok,
    free_port,
    launch,
    load_script,
    run_script,
    snapshot,
    wait_for_checkpoint,
    write,
)
from safetensors.torch import save_file

from ddp_accel.__main__ import main as ddp_accel_main
from ddp_accel.errors import UserError
from ddp_accel.runtime import check_topology

inprocess = pytest.mark.inprocess
multiprocess = pytest.mark.multiprocess


def check_config(*paths) -> Result:
    """`ddp-accel check-config PATHS` in-process."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = ddp_accel_main(["check-config", *map(str, paths)])
    return Result(code, stdout.getvalue(), stderr.getvalue())


@inprocess
def test_resume_paths_that_are_not_checkpoints(tmp_path):
    result = run_script("scripts/minimal.py", "--output-dir", tmp_path, "--resume-from-checkpoint", tmp_path / "nope")
    assert_clean_error(result, "no such checkpoint", "latest")
    (tmp_path / "empty").mkdir()
    result = run_script("scripts/minimal.py", "--output-dir", tmp_path, "--resume-from-checkpoint", tmp_path / "empty")
    assert_clean_error(result, "not a complete ddp_accel checkpoint")


@inprocess
def test_checkpoint_of_another_model(tmp_path):
    check_ok(run_script("tests/probe.py", "--output-dir", tmp_path, "--max-steps", 2, "--checkpointing-steps", 2))
    step_2 = tmp_path / "checkpoints" / "step_2"
    result = run_script(
        "tests/probe.py", "--output-dir", tmp_path / "other", "--hidden", 8, "--resume-from-checkpoint", step_2
    )
    assert_clean_error(result, "another model")


@inprocess
def test_a_checkpoint_of_another_optimizer_is_one_line(tmp_path):
    # AdamW's state resumed into SGD failed at the first step with a 46-line KeyError: 'momentum'
    common = ["--epochs", 3, "--checkpointing-steps", 2, "--output-dir", tmp_path]
    check_ok(run_script("tests/probe.py", *common, "--max-steps", 2))
    result = run_script("tests/probe.py", *common, "--optimizer", "sgd", "--resume-from-checkpoint", "latest")
    assert_clean_error(
        result, "was written with another optimizer (AdamW(4 params, amsgrad off)", "makes SGD(4 params, momentum on)"
    )


class _Unreadable:  # what accelerate.utils.load (weights_only) refuses, as numpy 1 refuses numpy 2's arrays
    pass


@inprocess
def test_random_states_this_accelerate_cannot_read_are_one_line_not_a_silently_inexact_resume(tmp_path):
    # Accelerate's load_state only logs that it could not load the random states and goes on with others
    import json

    import torch

    common = ["--epochs", 3, "--checkpointing-steps", 2, "--output-dir", tmp_path]
    check_ok(run_script("tests/probe.py", *common, "--max-steps", 2))
    step = tmp_path / "checkpoints" / "step_2"
    states = torch.load(step / "random_states_0.pkl", weights_only=False)
    torch.save({**states, "numpy_random_seed": _Unreadable()}, step / "random_states_0.pkl")
    files = json.loads((step / "files.json").read_text())  # (the sizes match: not a damaged checkpoint)
    files["random_states_0.pkl"] = (step / "random_states_0.pkl").stat().st_size
    (step / "files.json").write_text(json.dumps(files))
    result = run_script("tests/probe.py", *common, "--resume-from-checkpoint", "latest")
    assert_clean_error(result, "this Accelerate cannot read its random states (UnpicklingError", "numpy's major")


@inprocess
def test_output_dir_that_is_a_file_or_empty(tmp_path):
    (tmp_path / "file").write_text("x")
    assert_clean_error(run_script("scripts/minimal.py", "--output-dir", tmp_path / "file"), "is a file")
    assert_clean_error(run_script("scripts/minimal.py", "--output-dir", ""), "--output-dir is empty")


@inprocess
def test_unknown_yaml_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "accelerate_configs" / "multi_gpu.yaml").read_text() + "num_proceses: 4\n")
    assert_clean_error(check_config(bad), "unknown keys", "num_proceses")


@inprocess
def test_world_size_guard(monkeypatch):
    class OneProcess:
        num_processes = 1
        distributed_type = "DistributedType.NO"

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="each would train alone"):
        check_topology(OneProcess())
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_topology(OneProcess())


@inprocess
@pytest.mark.parametrize(
    "script,args,fragment",
    [
        ("scripts/template.py", ["--max-grad-norm", "-1"], "--max-grad-norm: must be > 0"),
        ("scripts/template.py", ["--lr", "nan"], "--lr: must be a finite number"),
        ("scripts/template.py", ["--seed", "4294967296"], "--seed: must be <= 4294967295"),
        ("scripts/template.py", ["--timeout-s", "100000000000000"], "--timeout-s: must be <= 31536000"),
        ("scripts/imdb.py", ["--max-length", "0"], "--max-length: must be >= 1"),
        ("scripts/imdb.py", ["--ngrams", "0"], "--ngrams: must be >= 1"),
        ("scripts/imdb.py", ["--val-fraction", "1.5"], "--val-fraction: must be < 1"),
        ("scripts/imdb.py", ["--buckets", "0"], "--buckets: must be >= 1"),
        ("scripts/imagenet.py", ["--dummy", "-b", "0"], "-b: must be >= 1"),
        ("scripts/imagenet.py", ["--dummy", "--label-smoothing", "inf"], "--label-smoothing: must be a finite number"),
        # an option that nothing would read: the run would differ from the command without a word
        ("scripts/template.py", ["--ema-warmup"], "--ema-warmup shapes the average of --ema-decay: add --ema-decay"),
        ("scripts/template.py", ["--compile-backend", "eager"], "--compile-backend eager is --compile's"),
        (
            "scripts/template.py",
            ["--compile", "--compile-backend", "foo"],
            "--compile-backend foo is not one of torch's",
        ),
        ("scripts/template.py", ["--warmup-epochs", "1"], "--warmup-epochs warms up the shared --lr-schedule"),
        (
            "scripts/template.py",
            ["--lr-schedule", "step", "--min-lr", "0.01"],
            "--min-lr is where cosine, onecycle and linear end",
        ),
        ("scripts/template.py", ["--lr-milestones", "3"], "--lr-milestones are multistep's"),
        ("scripts/template.py", ["--lr-schedule", "multistep", "--lr-milestones", "3", "2"], "in increasing order"),
        ("scripts/template.py", ["--lr-schedule", "multistep", "--lr-milestones", "50"], "past --epochs 10 never"),
        ("scripts/template.py", ["--lr-schedule", "cosine", "--warmup-epochs", "10"], "lasts all --epochs 10"),
        ("scripts/template.py", ["--time-budget", "15 minutes"], "--time-budget: '15 minutes' is not a duration"),
        ("scripts/template.py", ["--time-budget", "0m"], "--time-budget: '0m': a duration must be above 0"),
        (
            "scripts/imdb.py",
            ["--warmup", "0.1"],
            "--warmup is now --warmup-epochs, in epochs instead of a share of the steps (--warmup 0.1 with --epochs 3: "
            "--warmup-epochs 0.3)",
        ),
        (
            "scripts/imagenet.py",
            ["--dummy", "-e", "--time-budget", "1m"],
            "--time-budget plans a training run's epochs",
        ),
        ("scripts/template.py", ["--lr-gamma", "10"], "--lr-gamma: must be <= 1"),
        ("scripts/template.py", ["--betas", "0.8", "0.9"], "--betas are Adam's and AdamW's: --optimizer sgd"),
        ("scripts/imagenet.py", ["--dummy", "--mix-prob", "0.5"], "give --mixup-alpha or --cutmix-alpha"),
        ("scripts/imagenet.py", ["--dummy", "--mixup-alpha", "0.2", "--mix-switch-prob", "0.9"], "give both"),
        ("scripts/imagenet.py", ["--dummy", "--mixup-alpha", "0.2", "--mix-prob", "1.5"], "--mix-prob: must be <= 1"),
        ("scripts/imdb.py", ["--schedule", "linear"], "--schedule is now --lr-schedule linear"),
        ("scripts/imdb.py", ["--lr-schedule", "cosine", "--warmup", "0.1"], "--warmup is now --warmup-epochs"),
    ],
)
def test_bad_option_values_are_refused_before_anything_runs(tmp_path, script, args, fragment):
    assert_clean_error(run_script(script, *args, "--output-dir", tmp_path), fragment)
    assert not tmp_path.joinpath("args.json").exists()


@inprocess
def test_a_chance_of_one_is_accepted_where_it_means_always():
    # --mix-prob's own default, 1, was refused when given (an open upper end, as for dropout)
    options = ["DATA", "--mixup-alpha", "0.2", "--cutmix-alpha", "1", "--mix-prob", "1", "--mix-switch-prob", "1"]
    args = load_script("scripts/imagenet.py").parse_args([*options, "--random-erasing", "1"])
    assert (args.mix_prob, args.mix_switch_prob, args.random_erasing) == (1.0, 1.0, 1.0)


@inprocess
def test_an_empty_vocabulary_is_refused(tmp_path):
    result = run_script("scripts/imdb.py", "--dataset", "synthetic", "--min-freq", "100000", "--output-dir", tmp_path)
    assert_clean_error(result, "vocabulary is empty", "--min-freq")


@inprocess
def test_weights_safetensors_cannot_write_are_refused_before_training(tmp_path):
    # checkpoints and model.safetensors are safetensors: complex128 (no version writes it) ends the run at its start
    result = run_script("tests/probe.py", "--complex", "complex128", "--output-dir", tmp_path)
    assert_clean_error(result, "the model's 0.weight is complex128, which safetensors", "pip install -U safetensors")
    assert "step " not in result.stdout + result.stderr


@multiprocess
def test_a_loss_that_becomes_infinite_stops_every_rank_with_one_line(tmp_path):
    result = launch(
        "tests/probe.py", "--lr", "1e38", "--train-size", "256", "--batch-size", "4", "--output-dir", tmp_path
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "not finite" in errors[0] and "at step" in errors[0], output[-3000:]
    assert not (tmp_path / "model.safetensors").exists()


@inprocess
def test_a_trained_output_dir_is_not_overwritten_by_accident(tmp_path):
    check_ok(run_script("tests/probe.py", "--max-steps", 4, "--checkpointing-steps", 2, "--output-dir", tmp_path))
    before = snapshot(tmp_path)
    for resume in ([], ["--resume-from-checkpoint", "latest", "--epochs", 3, "--seed", 5]):
        if resume:  # `latest` without a checkpoint left is a new run too
            for step in tmp_path.glob("checkpoints/step_*"):
                for file in step.iterdir():
                    file.unlink()
                step.rmdir()
            before = snapshot(tmp_path)
        result = run_script("tests/probe.py", "--output-dir", tmp_path, *resume)
        assert_clean_error(result, "already holds a trained model", "--overwrite-output-dir")
        assert snapshot(tmp_path) == before  # every file byte-identical
    check_ok(run_script("tests/probe.py", "--max-steps", 3, "--output-dir", tmp_path, "--overwrite-output-dir"))
    assert not (tmp_path / "checkpoints").exists()  # the old run's checkpoints cannot be resumed by mistake


# The two ways a user error ends a launched process (an error found while the run starts, endings.py; a bad option,
# cli.py), each under one of the two torch elastic launchers: both launchers print the same error file
@multiprocess
def test_a_user_error_under_a_launcher_is_one_line_and_appears_in_the_launchers_report(tmp_path):
    result = launch(
        "scripts/minimal.py",
        "--output-dir",
        tmp_path,
        "--resume-from-checkpoint",
        tmp_path / "nope",
        launcher="torchrun",
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert sum(line.startswith("error: ") for line in output.splitlines()) == 1, output[-3000:]
    # torch elastic's failure report shows our line instead of "To enable traceback see ..."
    assert re.search(r"traceback\s*:\s*error: --resume-from-checkpoint .*no such checkpoint", output), output[-3000:]
    assert "Connection closed by peer" not in output


@multiprocess
@pytest.mark.parametrize(
    "args, fragment",
    [(["--bogus-option"], "unrecognized arguments: --bogus-option"), (["--lr", "1e38"], "not finite")],
    ids=["bad-option", "loss-not-finite"],
)
def test_a_user_error_does_not_burn_the_launchers_restarts(tmp_path, args, fragment):
    # torchrun restarts a failed group up to --max_restarts times whatever the cause: a typo made 4 attempts in 49 s,
    # printing its line each time. The failing worker stops its agent instead; crashes still restart (test_faults)
    command = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--max_restarts", "3", "--master_port", str(free_port())]
    command += ["tests/probe.py", "--output-dir", str(tmp_path), "--train-size", "256", "--batch-size", "4", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    errors = [line for line in output.splitlines() if "error: " in line and fragment in line]
    assert len(errors) == 1, output[-3000:]  # one attempt: each attempt printed it


@multiprocess
def test_a_crash_that_repeats_at_the_same_step_stops_restarting(tmp_path):
    # a bug at step 10 on rank 1: the first attempt and a restart from step_9 fail alike; the next one says so
    # and stops, instead of spending every restart on it
    command = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--max_restarts", "5", "--master_port", str(free_port())]
    command += ["tests/probe.py", "--output-dir", str(tmp_path), "--batch-size", "4", "--epochs", "2"]
    command += ["--checkpointing-steps", "3", "--crash-at-step", "10", "--resume-from-checkpoint", "latest"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    crashes = [line for line in output.splitlines() if line.startswith("RuntimeError: probe: a bug at step 10")]
    assert len(crashes) == 2, output[-4000:]  # two attempts crashed (their tracebacks)
    assert output.count("resumed from") == 2, output[-4000:]  # the restart that crashed, and the one that stopped
    stop = [line for line in output.splitlines() if "with the same error the last two times" in line]
    assert len(stop) == 1 and "after resuming from" in stop[0] and "step_9" in stop[0], output[-4000:]


@multiprocess
def test_a_bad_option_under_a_launcher_is_one_line_and_appears_in_the_launchers_report(tmp_path):
    # every process parses the same arguments; one says what is wrong
    result = launch(
        "scripts/imdb.py", "--output-dir", tmp_path / "out", "--model", "gcnn", "--sparse", "on", launcher="accelerate"
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert sum(line.startswith("imdb.py: error: --sparse on") for line in output.splitlines()) == 1, output[-3000:]
    # torch elastic's failure report shows it instead of "To enable traceback see ..." (for each process that
    # finished before the launcher stopped the other)
    assert re.search(r"traceback\s*:\s*error: --sparse on: only --model bag", output), output[-3000:]
    assert not (tmp_path / "out").exists()


@inprocess
def test_bad_data_and_files_give_one_line_naming_them(tmp_path):
    def imdb(*args):
        return run_script("scripts/imdb.py", *args, "--output-dir", tmp_path / "out")

    null = write(tmp_path / "null.jsonl", '{"text": "fine", "label": 1}\n{"text": null, "label": 0}\n')
    assert_clean_error(imdb("--train-file", null), "null.jsonl: row 2 has no text")
    number = write(tmp_path / "number.jsonl", '{"text": "fine", "label": 1}\n{"text": 5, "label": 0}\n')
    assert_clean_error(imdb("--train-file", number), "number.jsonl", "must hold strings")
    one = write(tmp_path / "one.jsonl", '{"text": "fine", "label": 1}\n')
    assert_clean_error(imdb("--train-file", one), "1 review(s) cannot be split")
    check_ok(imdb("--dataset", "synthetic", "--max-steps", 2, "--buckets", 100))
    assert_clean_error(imdb("--predict", "reviews.txt"), "looks like a file name", "--predict-file")
    assert_clean_error(imdb("--predict", " "), "empty text")
    latin1 = write(tmp_path / "latin1.txt", b"a fine film\nun film \xe9mouvant\n")
    assert_clean_error(imdb("--predict-file", latin1), "latin1.txt: line 2 is not UTF-8")
    assert_clean_error(imdb("--predict-file", tmp_path), "a directory")
    predicted = check_ok(imdb("--predict", "a wonderful film"))
    assert "trained on the built-in SYNTHETIC corpus" in predicted
    assert_clean_error(imdb("--predict", "a film", "--ngrams", 2), "--ngrams 2 (the model was trained with 3)")
    # a file where a folder should be
    assert_clean_error(run_script("scripts/minimal.py", "--output-dir", null / "out"), "null.jsonl/out")


@inprocess
def test_bad_weights_for_imagenet_resume_are_one_line(tmp_path):
    save_file({"weight": torch.zeros(3)}, str(tmp_path / "other.safetensors"))
    write(tmp_path / "cut.safetensors", (tmp_path / "other.safetensors").read_bytes()[:40])

    def run(path):
        return run_script(
            "scripts/imagenet.py",
            *("--dummy", "-a", "resnet18", "--image-size", "32", "-j", "0", "-e"),
            *("--resume", path, "--output-dir", tmp_path / "out"),
        )

    assert_clean_error(run(tmp_path / "other.safetensors"), "weights of another model than this ResNet")
    assert_clean_error(run(tmp_path / "cut.safetensors"), "not a readable .safetensors file")


@inprocess
@pytest.mark.parametrize(
    "content,fragment",
    [
        ("num_processes: two\n", "num_processes must be a whole number"),
        ("num_processes: 0\n", "num_processes must be a whole number"),
        ("", "is empty"),
    ],
)
def test_check_config_refuses_invalid_values(tmp_path, content, fragment):
    base = (ROOT / "accelerate_configs" / "multi_gpu.yaml").read_text()
    kept = "\n".join(line for line in base.splitlines() if not line.startswith("num_processes"))
    path = write(tmp_path / "c.yaml", kept + "\n" + content if content else "")
    assert_clean_error(check_config(path), fragment)
    assert_clean_error(check_config(tmp_path), "is a directory")


@pytest.mark.parametrize("start", ["forkserver", "fork"])
@inprocess
def test_an_unreadable_image_in_a_dataloader_worker_is_one_line(tmp_path, monkeypatch, start):
    # fork: what a dataset that cannot be pickled, a notebook or DDP_ACCEL_WORKER_START=fork gets; the forked
    # worker left behind by the error is killed without torch's SIGCHLD handler calling that a crash
    monkeypatch.setenv("DDP_ACCEL_WORKER_START", start)
    from test_imagenet import make_image_folder

    data = make_image_folder(tmp_path / "images", classes=3, train=2, val=1)
    (data / "train" / "class0" / "0.jpg").write_bytes(b"not a jpeg")
    result = run_script(
        "scripts/imagenet.py",
        *(data, "-a", "cifar_resnet20", "--image-size", "16", "-j", "1", "-b", "2"),
        *("--output-dir", tmp_path / "out"),
    )
    assert_clean_error(result, "cannot read image", "0.jpg")
    assert "Caught UserError in DataLoader worker" not in result.stdout + result.stderr


@multiprocess
def test_ctrl_c_says_where_the_newest_checkpoint_is(tmp_path):
    command = [sys.executable, str(ROOT / "tests" / "probe.py"), "--output-dir", str(tmp_path)]
    command += [
        "--train-size",
        "256",
        "--batch-size",
        "4",
        "--epochs",
        "5",
        "--step-ms",
        "20",
        "--checkpointing-steps",
        "5",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # as from a terminal: a shell that starts pytest in the background hands its children SIGINT ignored
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    wait_for_checkpoint(tmp_path, 5, alive=process)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 130, output[-2000:]
    assert "interrupted (Ctrl-C). The newest checkpoint is" in output and "--resume-from-checkpoint latest" in output
    assert "Traceback" not in output, output[-2000:]


@multiprocess
@pytest.mark.parametrize(
    "signum, code",
    [(signal.SIGINT, 130), (signal.SIGTERM, 0), (signal.SIGUSR1, 0)],
    ids=["ctrl-c", "preemption", "time-limit-warning"],
)
def test_a_stop_signal_while_an_env_launch_waits_for_its_group_ends_it_at_once(tmp_path, signum, code):
    # torch's env:// rendezvous blocks the main thread in C++ for the whole --timeout-s: Python's handlers waited
    # for it (Ctrl-C did nothing for 10 minutes). Rank 0 here is a port that accepts and never answers.
    with socket.socket() as rank_0:
        rank_0.bind(("127.0.0.1", 0))
        rank_0.listen()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RANK": "1", "LOCAL_RANK": "1"}
        env |= {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(rank_0.getsockname()[1])}
        command = [sys.executable, str(ROOT / "scripts" / "minimal.py"), "--output-dir", str(tmp_path)]
        as_from_a_terminal = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731 (see the test above)
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=env,
            preexec_fn=as_from_a_terminal,
        )
        try:
            rank_0.settimeout(120)
            connection, _ = rank_0.accept()  # rank 1 is in the rendezvous
            with connection:
                process.send_signal(signum)
                output, _ = process.communicate(timeout=20)  # not --timeout-s (600 s)
        finally:
            process.kill()  # (gone already, unless it never reached the rendezvous or the signal waited)
    assert process.returncode == code, output[-2000:]
    assert "Traceback" not in output, output[-2000:]
    if signum == signal.SIGINT:
        assert "interrupted (Ctrl-C) while the process group formed: nothing trained yet" in output, output[-2000:]
    else:  # a preemption before training: its marker, as during the imports
        marker = json.loads((tmp_path / "preempted.json").read_text())
        assert marker["phase"] == "startup" and marker["moment"] == "rendezvous"
        assert marker["signal"] == signal.Signals(signum).name


@inprocess
@pytest.mark.parametrize(
    "env,fragment",
    [
        ({"RANK": "1", "LOCAL_RANK": "1"}, "RANK=1 is set but WORLD_SIZE is not"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2 does not fit WORLD_SIZE=2"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, "must be whole numbers"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, "WORLD_SIZE=2 without MASTER_ADDR"),
        ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}, "SLURM started 2 tasks of this script without a launcher"),
    ],
)
def test_inconsistent_launcher_variables_are_one_line(tmp_path, env, fragment):
    result = run_script("scripts/template.py", "--output-dir", tmp_path / "out", "--epochs", 1, env=env)
    assert_clean_error(result, fragment)
    assert not (tmp_path / "out").exists()


@inprocess
def test_valid_env_launches_and_a_stray_rank_pass_the_launcher_check():
    from ddp_accel.runtime import check_launch_environment

    check_launch_environment({"RANK": "7"})  # a stray RANK in a shell: a lone process
    check_launch_environment({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    check_launch_environment({"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"})  # torchrun's own store
    check_launch_environment({"SLURM_STEP_NUM_TASKS": "2", "TORCHELASTIC_RUN_ID": "x"})  # a launcher under srun


@inprocess
def test_a_stray_rank_does_not_silence_a_lone_process(tmp_path):
    result = run_script("scripts/template.py", "--output-dir", tmp_path / "out", "--lr", "-1", env={"RANK": "7"})
    assert_clean_error(result, "--lr: must be > 0")


def config_with(**changes) -> str:
    """multi_gpu.yaml with some keys replaced, added, or (None) left out."""
    lines = (ROOT / "accelerate_configs" / "multi_gpu.yaml").read_text().splitlines()
    kept = [line for line in lines if line.split(":")[0] not in changes]
    return "\n".join(kept + [f"{key}: {value}" for key, value in changes.items() if value is not None]) + "\n"


@inprocess
@pytest.mark.parametrize(
    "content,fragment",
    [
        (config_with(main_process_port=99999), "main_process_port must be between 1 and 65535"),
        (config_with(main_process_port="'x'"), "main_process_port must be a whole number"),
        (config_with(mixed_precision="banana"), "mixed_precision must be one of no, fp16, bf16, fp8"),
        (config_with(machine_rank="'zero'"), "machine_rank must be a whole number"),
        (config_with(machine_rank=3, num_machines=2), "machine_rank must be between 0 and num_machines - 1"),
        (config_with(num_processes=None), "accelerate launch would refuse it: You need to manually pass in"),
        ("- a\n- list\n", "the top level must be a mapping"),
        ("just a string\n", "the top level must be a mapping"),
        ("key: [unclosed\n", "not valid YAML"),
        (b"num_processes: 2\n\xff\xfe\n", "not UTF-8 text"),
        (config_with(num_proceses=4), "unknown keys"),
    ],
)
def test_check_config_refuses_what_accelerate_launch_would_refuse(tmp_path, content, fragment):
    assert_clean_error(check_config(write(tmp_path / "bad.yaml", content)), fragment)


@inprocess
@pytest.mark.parametrize(
    "content,fragment",
    [
        (config_with(mixed_precision="fp8"), "mixed_precision fp8 needs one of"),
        (config_with(distributed_type="DEEPSPEED"), "DEEPSPEED needs the deepspeed package"),
    ],
)
def test_check_config_says_what_is_valid_but_not_on_this_machine(tmp_path, content, fragment):
    result = check_config(write(tmp_path / "bad.yaml", content))
    assert result.returncode == 3 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("valid, but not on this machine: ") and fragment in result.stderr, result.stderr


@inprocess
def test_small_inputs_that_used_to_be_misread_or_late(tmp_path):
    import gzip

    from ddp_accel.runtime import has_accelerator

    # fp16 on a CPU, asked by the option or by accelerate launch / the accelerate config (ACCELERATE_MIXED_PRECISION)
    if not has_accelerator():
        minimal = ["scripts/minimal.py", "--output-dir", tmp_path / "fp16"]
        assert_clean_error(run_script(*minimal, "--mixed-precision", "fp16"), "fp16", "needs a GPU")
        assert_clean_error(run_script(*minimal, env={"ACCELERATE_MIXED_PRECISION": "fp16"}), "needs a GPU")
    # -e into an --output-dir that is a file: said before the evaluation, not after it
    weights = tmp_path / "weights.safetensors"
    save_file({"weight": torch.zeros(2)}, str(weights))
    evaluate = ["--dummy", "-a", "resnet18", "-j", "0", "-e", "--resume", weights]
    result = run_script("scripts/imagenet.py", *evaluate, "--output-dir", write(tmp_path / "file", "x"))
    assert "top1" not in assert_clean_error(result, "is a file")
    # -e with options of training: one line naming them (they were read by nothing)
    result = run_script("scripts/imagenet.py", *evaluate, "--mixup-alpha", "0.2", "--ema-decay", "0.9", "--epochs", 3)
    assert_clean_error(
        result, "-e only evaluates the --resume weights: --epochs, --ema-decay, --mixup-alpha are options"
    )
    # a gzipped csv is read as csv (every .gz was read as JSON)
    rows = "text,label\n" + "".join(f"a {'good' if i % 2 else 'bad'} film number {i},{i % 2}\n" for i in range(40))
    gzipped = tmp_path / "train.csv.gz"
    gzipped.write_bytes(gzip.compress(rows.encode()))
    imdb = ["scripts/imdb.py", "--train-file", gzipped, "--max-steps", 1, "--buckets", 100, "--min-freq", 1]
    check_ok(run_script(*imdb, "--output-dir", tmp_path / "csv", "--cache-dir", tmp_path / "cache"))
    # an encoded-data cache that is a file: one line naming it, before any data is read
    result = run_script(*imdb, "--output-dir", tmp_path / "cached", "--cache-dir", write(tmp_path / "cache.txt", "x"))
    assert_clean_error(result, "cache.txt is a file")


@multiprocess
def test_accelerate_launch_asked_for_several_processes_that_starts_one_is_refused(tmp_path):
    # `accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes 2` runs one process: it said so
    # only in the banner
    from ddp_accel.runtime import processes_asked_of_accelerate_launch

    launch = ["/venv/bin/python", "/venv/bin/accelerate", "launch", "--config_file", "cpu.yaml", "--num_processes"]
    assert processes_asked_of_accelerate_launch([*launch, "2", "x.py"]) == 2
    assert processes_asked_of_accelerate_launch(["/venv/bin/accelerate", "launch", "--num-processes=3", "x.py"]) == 3
    assert processes_asked_of_accelerate_launch(["python", "x.py", "--num_processes", "2"]) is None  # not accelerate
    config = ROOT / "accelerate_configs" / "cpu.yaml"
    command = [str(BIN / "accelerate"), "launch", "--config_file", str(config), "--num_processes", "2"]
    command += ["scripts/minimal.py", "--output-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    # then accelerate's own traceback, which from 1.16 on holds the script's stderr again: the one line, twice
    errors = sorted({line for line in output.splitlines() if line.startswith("error: ")})
    assert result.returncode != 0 and len(errors) == 1, output[-3000:]
    assert "was asked for 2 processes" in errors[0] and "accelerate_configs/multi_gpu.yaml" in errors[0], errors
    assert not (tmp_path / "model.safetensors").exists()

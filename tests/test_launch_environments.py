"""The launch environments (ddp_accel.launch_environments), each on its own: what each answers for a process it
started, its check of the launcher's variables, and the typed outcome run_main records for a launcher in the same
process."""

import contextlib
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from helpers import run_script, torch_elastic_worker

from ddp_accel import group_wait, launch_environments
from ddp_accel.errors import UserError

pytestmark = pytest.mark.inprocess

TORCHRUN = {"TORCHELASTIC_RUN_ID": "job", "RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "2"}


def test_each_engine_is_read_from_its_launchers_variables_and_answers_for_it():
    lone = launch_environments.current({})
    assert type(lone) is launch_environments.LaunchEnvironment and (lone.rank, lone.world_size, lone.restarts) == (
        0,
        1,
        0,
    )
    spawned = launch_environments.current({"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert type(spawned) is launch_environments.EnvLaunch and (spawned.rank, spawned.world_size) == (3, 4)
    elastic = launch_environments.current({**TORCHRUN, "SLURM_JOB_ID": "9", "SLURM_RESTART_COUNT": "1"})
    assert type(elastic) is launch_environments.TorchElastic and (elastic.rank, elastic.world_size) == (1, 2)
    assert elastic.restarts == 3 and elastic.scheduler == "slurm"  # 2 agent restarts + 1 requeue
    assert "every process of the job step" in elastic.stop_signals() and "passes a SIGTERM" in elastic.stop_signals()
    pod = launch_environments.current({**TORCHRUN, "KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    assert pod.scheduler == "kubernetes" and "first process only" in pod.stop_signals()
    assert all(
        environment.even_placement and environment.banner() is None for environment in (lone, spawned, elastic, pod)
    )
    ray = launch_environments.RayWorker(TORCHRUN, workers=2, nodes=1)
    assert not ray.even_placement and ray.restarts == 0
    assert ray.banner().startswith("ray (2 workers on 1 node; SIGTERM/SIGUSR1 forwarded")


def test_a_launcher_in_this_process_chooses_the_engine_and_the_environment_decides_otherwise():
    assert not launch_environments.current().checks_only()
    with launch_environments.use(launch_environments.CheckOnly()):
        assert launch_environments.current().checks_only()
        with launch_environments.use(launch_environments.RayWorker(TORCHRUN)):
            assert launch_environments.current().name == "ray"
        assert launch_environments.current().name == "check only"
        assert launch_environments.current({}).name == "process"  # an explicit environment is read as such
    assert launch_environments.current().name != "check only"


@pytest.mark.parametrize(
    "env, message",
    [
        ({"SLURM_STEP_NUM_TASKS": "2"}, "SLURM started 2 tasks of this script without a launcher"),
        ({"RANK": "1", "LOCAL_RANK": "1"}, "RANK=1 is set but WORLD_SIZE is not"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "must be whole numbers"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2 does not fit"),
        ({"RANK": "1", "WORLD_SIZE": "2"}, "without MASTER_ADDR and MASTER_PORT"),
        ({**TORCHRUN, "RANK": "5"}, "RANK=5 does not fit WORLD_SIZE=2"),
    ],
)
def test_each_engine_checks_its_own_variables(env, message):
    with pytest.raises(UserError, match=message):
        launch_environments.current(env).check()


def test_run_main_records_a_typed_outcome_for_each_way_a_script_ends(tmp_path):
    result = run_script("tests/probe.py", "--output-dir", tmp_path / "done", "--max-steps", 2)
    outcome = launch_environments.last_outcome()
    assert result.returncode == 0 and outcome.kind == "completed" and outcome.metrics["steps"] == 2
    run_script(
        "tests/probe.py", "--output-dir", tmp_path / "done", "--max-steps", 2, "--resume-from-checkpoint", "latest"
    )
    assert (
        launch_environments.last_outcome().kind == "completed"
        and launch_environments.last_outcome().metrics["steps"] == 2
    )  # complete
    run_script("tests/probe.py", "--output-dir", tmp_path / "bad", "--best-metric", "bogus")
    outcome = launch_environments.last_outcome()
    assert (outcome.kind, outcome.code) == ("user_error", 2) and "--best-metric bogus" in outcome.message
    run_script("tests/probe.py", "--output-dir", tmp_path / "bad", "--no-such-option")
    assert (
        launch_environments.last_outcome().kind == "user_error"
        and "unrecognized arguments" in launch_environments.last_outcome().message
    )
    run_script("tests/probe.py", "--output-dir", tmp_path / "stop", "--batch-size", 4, "--sigterm-at-batch", 3)
    outcome = launch_environments.last_outcome()
    assert outcome.kind == "preempted" and outcome.stop["step"] == 3 and outcome.stop["signal"] == signal.SIGTERM.name
    assert outcome.metrics is None
    run_script("tests/probe.py", "--output-dir", tmp_path / "crash", "--crash-at-step", 1)
    outcome = launch_environments.last_outcome()
    assert (outcome.kind, outcome.code) == ("crashed", 1) and "probe: a bug at step 1" in outcome.message


def test_a_torch_elastic_worker_knows_when_another_worker_of_its_attempt_reported_its_failure(tmp_path):
    # the agent ends the other workers after one failed: their SIGTERM is that ending, not a preemption
    env = torch_elastic_worker(tmp_path, local_rank=1)
    worker = launch_environments.current(env)
    assert not worker.peer_failed()
    Path(env["TORCHELASTIC_ERROR_FILE"]).write_text('{"message": "error: mine"}')
    assert not worker.peer_failed()  # its own line is no peer's
    (Path(env["TORCHELASTIC_ERROR_FILE"]).parent.parent / "0" / "error.json").write_text('{"message": "error: x"}')
    assert worker.peer_failed()
    assert not launch_environments.current({**env, "TORCHELASTIC_ERROR_FILE": os.devnull}).peer_failed()  # no log dir
    assert not launch_environments.current(
        {k: v for k, v in env.items() if k != "TORCHELASTIC_ERROR_FILE"}
    ).peer_failed()
    assert (
        not launch_environments.LaunchEnvironment().peer_failed()
        and not launch_environments.current({"RANK": "1", "WORLD_SIZE": "2"}).peer_failed()
    )


def test_a_stop_signal_from_a_launcher_ending_the_group_for_a_failed_peer_leaves_no_marker(monkeypatch, tmp_path):
    # after the imports (the guard's subprocess test is test_launchers.py's): a rank still starting when another
    # failed; a preempted.json would have a job script requeue the failure
    from ddp_accel.endings import run_main
    from ddp_accel.stopping import PREEMPTED_MARKER

    env = torch_elastic_worker(tmp_path, local_rank=1)
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    def signalled_while_starting(output_dir: Path):
        def main(signals):
            signals.set_output_dir(output_dir)
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
            raise AssertionError("the handler raises")

        with pytest.raises(SystemExit) as ended:
            run_main(main)
        return ended.value.code, launch_environments.last_outcome()

    code, outcome = signalled_while_starting(tmp_path / "preempted")  # no peer failed: a preemption
    assert (code, outcome.kind) == (0, "preempted") and (tmp_path / "preempted" / PREEMPTED_MARKER).exists()
    (tmp_path / "torchelastic" / "attempt_0" / "0" / "error.json").write_text('{"message": "error: --bad"}')
    code, outcome = signalled_while_starting(tmp_path / "ended")
    assert (code, outcome.kind, outcome.message) == (128 + signal.SIGTERM, "ended_for_a_peer", None)
    assert not (tmp_path / "ended" / PREEMPTED_MARKER).exists()


def test_the_start_up_guard_leaves_a_scripts_thread_alone():
    # Ray Train runs a script in a thread of its worker, where handlers cannot be installed (ValueError)
    import threading

    from ddp_accel.startup import stop_during_imports

    before = signal.getsignal(signal.SIGTERM)
    errors: list[BaseException] = []

    def in_a_thread():
        try:
            stop_during_imports("unused")
        except BaseException as error:
            errors.append(error)

    worker = threading.Thread(target=in_a_thread)
    worker.start()
    worker.join()
    assert not errors and signal.getsignal(signal.SIGTERM) is before


def test_a_script_ends_the_processes_helpers_unless_the_process_outlives_it(monkeypatch):
    # a command's own process: the forkserver and the resource tracker end with the script (nothing is left when the
    # command returns); a Ray worker or a driver's check goes on after the script: their helpers are the process's
    from ddp_accel import endings

    ended: list[str] = []
    monkeypatch.setattr(endings, "end_worker_processes", lambda: ended.append("workers and helpers"))
    monkeypatch.setattr(endings, "kill_leftover_workers", lambda: ended.append("workers"))

    def run() -> None:
        with contextlib.suppress(SystemExit):
            endings.run_main(lambda: None)

    run()
    with launch_environments.use(launch_environments.RayWorker(workers=2)):
        run()
    with launch_environments.use(launch_environments.CheckOnly()):
        run()
    assert ended == ["workers and helpers", "workers", "workers"]
    assert (
        not launch_environments.LaunchEnvironment().outlives_the_script
        and not launch_environments.TorchElastic().outlives_the_script
    )


def test_an_env_launch_says_what_its_group_waits_for_and_a_launchers_worker_has_nothing_to_say():
    with socket.socket() as listening:  # a rank 0 that answers
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        spawned = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        rank_0, rank_1 = (launch_environments.current({**spawned, "RANK": rank}) for rank in ("0", "1"))
        line = rank_0.waiting_line(12.3, 600)
        assert line.startswith(f"rank 0 of 2: waiting at 127.0.0.1:{port} for the other processes to join")
        assert line.endswith("12 s so far, --timeout-s 600 ends the wait")
        assert "rank 1 of 2: waiting for the group at" in rank_1.waiting_line(12, 600)
        assert "rank 0 answers there" in rank_1.waiting_line(12, 600)
    assert "nothing answers there yet" in rank_1.waiting_line(12, 600)  # closed: a peer that failed before it
    for quiet in (
        launch_environments.current({}),
        launch_environments.current({**TORCHRUN, "MASTER_ADDR": "h", "MASTER_PORT": "1"}),
    ):
        assert quiet.waiting_line(12, 600) is None
    assert launch_environments.current({"WORLD_SIZE": "1", "RANK": "0"}).waiting_line(12, 600) is None


def test_a_group_that_forms_late_is_reported_until_it_forms_and_one_that_forms_at_once_is_not(monkeypatch, capsys):
    monkeypatch.setattr(group_wait, "FIRST_REPORT_S", 0.05)
    monkeypatch.setattr(group_wait, "REPORT_S", 0.05)
    spawned = launch_environments.EnvLaunch({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with launch_environments.use(spawned):
        with group_wait.while_the_group_forms(30, None):
            pass
        assert capsys.readouterr().err == ""
        with group_wait.while_the_group_forms(30, None):
            time.sleep(0.4)
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) >= 2 and all(line.startswith("waiting: rank 0 of 2: waiting at h:1") for line in lines), lines
        time.sleep(0.2)
        assert capsys.readouterr().err == "", "the report ends when the group forms"
    assert signal.set_wakeup_fd(-1) == -1, "the wakeup descriptor is put back"
    with (
        launch_environments.use(launch_environments.TorchElastic(TORCHRUN)),
        group_wait.while_the_group_forms(30, None),
    ):
        time.sleep(0.2)  # a launcher's worker: nothing added
    assert capsys.readouterr().err == ""


def test_the_wait_is_reported_first_after_its_first_interval_then_at_its_own(monkeypatch, capsys):
    # the rhythm: one line after FIRST_REPORT_S (or half the timeout), then one every REPORT_S, not every first one
    monkeypatch.setattr(group_wait, "FIRST_REPORT_S", 0.1)
    monkeypatch.setattr(group_wait, "REPORT_S", 2.0)
    spawned = launch_environments.EnvLaunch({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with launch_environments.use(spawned):
        with group_wait.while_the_group_forms(30, None):
            time.sleep(0.7)
        assert len(capsys.readouterr().err.splitlines()) == 1
        with group_wait.while_the_group_forms(0.4, None):  # half of a short timeout comes before FIRST_REPORT_S
            time.sleep(0.35)
        assert len(capsys.readouterr().err.splitlines()) == 1


def test_a_rank_whose_rank_0_never_starts_says_so_then_ends_at_the_timeout_with_one_line(monkeypatch, tmp_path):
    # torch's env:// rendezvous: rank 1 waited for rank 0's port for twice --timeout-s without a word, then printed
    # 60 lines of C++ frames and "lost contact with the others" for a group that never formed
    monkeypatch.setattr(group_wait, "FIRST_REPORT_S", 0.3)
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    import torch.distributed

    entered = []  # torch's rendezvous is not entered before rank 0 answers (its client's failed connect: C++ frames)
    init = torch.distributed.init_process_group
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: entered.append(1) or init(*a, **k))
    result = run_script("scripts/minimal.py", "--output-dir", tmp_path, "--timeout-s", 1, env=env)
    assert entered == [], "torch's rendezvous was entered with nothing at rank 0's address"
    assert result.returncode != 0
    waiting = [line for line in result.stderr.splitlines() if line.startswith("waiting: ")]
    assert waiting and f"rank 1 of 2: waiting for the group at 127.0.0.1:{port}: nothing answers" in waiting[0]
    assert "--timeout-s 1 ends the wait" in waiting[0], waiting
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    assert f"rank 1 of 2: the process group did not form within --timeout-s 1 at 127.0.0.1:{port}" in errors[0]
    assert "(nothing answers there); start rank 0 there" in errors[0] and "frame #" not in result.stderr

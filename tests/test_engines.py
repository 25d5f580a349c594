"""The engine adapters (ddp_accel.engines), each on its own: what each answers for a process it started, its check
of the launcher's variables, and the typed outcome run_main records for a launcher in the same process."""

import contextlib
import signal

import pytest
from helpers import run_script

from ddp_accel import engines
from ddp_accel.errors import UserError

pytestmark = pytest.mark.inprocess

TORCHRUN = {"TORCHELASTIC_RUN_ID": "job", "RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "2"}


def test_each_engine_is_read_from_its_launchers_variables_and_answers_for_it():
    lone = engines.current({})
    assert type(lone) is engines.Engine and (lone.rank, lone.world_size, lone.restarts) == (0, 1, 0)
    spawned = engines.current({"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert type(spawned) is engines.EnvLaunch and (spawned.rank, spawned.world_size) == (3, 4)
    elastic = engines.current({**TORCHRUN, "SLURM_JOB_ID": "9", "SLURM_RESTART_COUNT": "1"})
    assert type(elastic) is engines.TorchElastic and (elastic.rank, elastic.world_size) == (1, 2)
    assert elastic.restarts == 3 and elastic.scheduler == "slurm"  # 2 agent restarts + 1 requeue
    assert "every process of the job step" in elastic.stop_signals() and "passes a SIGTERM" in elastic.stop_signals()
    pod = engines.current({**TORCHRUN, "KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    assert pod.scheduler == "kubernetes" and "first process only" in pod.stop_signals()
    assert all(engine.even_placement and engine.banner() is None for engine in (lone, spawned, elastic, pod))
    ray = engines.RayWorker(TORCHRUN, workers=2, nodes=1)
    assert not ray.even_placement and ray.restarts == 0
    assert ray.banner().startswith("ray (2 workers on 1 node; SIGTERM/SIGUSR1 forwarded")


def test_a_launcher_in_this_process_chooses_the_engine_and_the_environment_decides_otherwise():
    assert not engines.current().checks_only()
    with engines.use(engines.CheckOnly()):
        assert engines.current().checks_only()
        with engines.use(engines.RayWorker(TORCHRUN)):
            assert engines.current().name == "ray"
        assert engines.current().name == "check only"
        assert engines.current({}).name == "process"  # an explicit environment is read as such
    assert engines.current().name != "check only"


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
        engines.current(env).check()


def test_run_main_records_a_typed_outcome_for_each_way_a_script_ends(tmp_path):
    result = run_script("tests/probe.py", "--output-dir", tmp_path / "done", "--max-steps", 2)
    outcome = engines.last_outcome()
    assert result.returncode == 0 and outcome.kind == "completed" and outcome.metrics["steps"] == 2
    run_script(
        "tests/probe.py", "--output-dir", tmp_path / "done", "--max-steps", 2, "--resume-from-checkpoint", "latest"
    )
    assert engines.last_outcome().kind == "completed" and engines.last_outcome().metrics["steps"] == 2  # complete
    run_script("tests/probe.py", "--output-dir", tmp_path / "bad", "--best-metric", "bogus")
    outcome = engines.last_outcome()
    assert (outcome.kind, outcome.code) == ("user_error", 2) and "--best-metric bogus" in outcome.message
    run_script("tests/probe.py", "--output-dir", tmp_path / "bad", "--no-such-option")
    assert engines.last_outcome().kind == "user_error" and "unrecognized arguments" in engines.last_outcome().message
    run_script("tests/probe.py", "--output-dir", tmp_path / "stop", "--batch-size", 4, "--sigterm-at-batch", 3)
    outcome = engines.last_outcome()
    assert outcome.kind == "preempted" and outcome.stop["step"] == 3 and outcome.stop["signal"] == signal.SIGTERM.name
    assert outcome.metrics is None
    run_script("tests/probe.py", "--output-dir", tmp_path / "crash", "--crash-at-step", 1)
    outcome = engines.last_outcome()
    assert (outcome.kind, outcome.code) == ("crashed", 1) and "probe: a bug at step 1" in outcome.message


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
    from ddp_accel import runtime

    ended: list[str] = []
    monkeypatch.setattr(runtime, "end_worker_processes", lambda: ended.append("workers and helpers"))
    monkeypatch.setattr(runtime, "kill_leftover_workers", lambda: ended.append("workers"))

    def run() -> None:
        with contextlib.suppress(SystemExit):
            runtime.run_main(lambda: None)

    run()
    with engines.use(engines.RayWorker(workers=2)):
        run()
    with engines.use(engines.CheckOnly()):
        run()
    assert ended == ["workers and helpers", "workers", "workers"]
    assert not engines.Engine().outlives_the_script and not engines.TorchElastic().outlives_the_script

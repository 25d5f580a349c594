"""The test tiers, and the state every test starts from (shared helpers live in helpers.py).

Every test belongs to exactly one tier (a pytest marker; collection fails otherwise):
- inprocess: no process is started; scripts run through `run_script` inside pytest (`pytest -m inprocess`: < 60 s)
- multiprocess: real 2-process jobs under accelerate launch / torchrun on the CPU (gloo), and single launches
- system: services and long chains: SLURM, etcd, network namespaces, real data, chained preemption
"""

import gc
import os
import shutil
import signal
import tempfile

import pytest

TIERS = ("inprocess", "multiprocess", "system")

# the IMDB pipeline's encoded-data cache: one per test session, shared by its runs, not the user's own; removed at
# the session's end (~180 MB a session)
SESSION_CACHE = None if "XDG_CACHE_HOME" in os.environ else tempfile.mkdtemp(prefix="ddp_accel_test_cache_")
if SESSION_CACHE is not None:
    os.environ["XDG_CACHE_HOME"] = SESSION_CACHE


# a launched process that dies of a native crash (SIGSEGV, SIGABRT) prints the Python stack of each of its threads:
# the crash is explained in the test's output instead of a bare exit code
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

# training_curves.png is drawn by the runs that check it (DDP_ACCEL_CURVES=1 in their environment), not by every
# process the suite starts: matplotlib's import and a plot are half a second of CPU at each run's end
os.environ["DDP_ACCEL_CURVES"] = "0"


def pytest_sessionfinish(session, exitstatus):
    if SESSION_CACHE is not None:
        shutil.rmtree(SESSION_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    untiered = [item.nodeid for item in items if sum(item.get_closest_marker(tier) is not None for tier in TIERS) != 1]
    if untiered:
        raise pytest.UsageError(f"tests without exactly one tier marker ({', '.join(TIERS)}): {untiered[:5]}")


# what collection imports (torch, torchvision, datasets, every test module) lives as long as the session: the cyclic
# collector would walk it all again each time it grew by a quarter (~1.3 s of full collections while collecting);
# it is off until collection ends, when those objects are frozen out of its sight
gc.disable()


def pytest_collection_finish(session):
    # frozen, the full collections a run makes (a process group's teardown, accelerate's cache clearing) walk what
    # the tests made, not ~1.5 million objects each time (0.3 s a collection)
    gc.freeze()
    gc.enable()
    # the in-process runs' DataLoader workers come from one forkserver, which the session keeps (run_script):
    # started now, so that its imports run while the first tests do
    if any(item.get_closest_marker("inprocess") is not None for item in session.items):
        from ddp_accel import startup

        startup.start_forkserver(startup.WORKER_SERVER_MODULES)


@pytest.fixture(scope="session")
def standard_reference(tmp_path_factory):
    """The probe's standard job (helpers.STANDARD_PROBE_ARGS) under torchrun, uninterrupted: made once a session
    for every test that ends the same job after a fault."""
    from helpers import STANDARD_PROBE_ARGS, check_ok, launch

    output_dir = tmp_path_factory.mktemp("standard") / "reference"
    check_ok(launch("tests/probe.py", *STANDARD_PROBE_ARGS, "--output-dir", output_dir, launcher="torchrun"))
    return output_dir


@pytest.fixture(scope="session")
def short_job(tmp_path_factory):
    """The short job (helpers.SHORT_PROBE_ARGS) under accelerate launch, uninterrupted, with all its checkpoints:
    made once a session; its readers leave it as it is."""
    from helpers import SHORT_PROBE_ARGS, check_ok, launch

    output_dir = tmp_path_factory.mktemp("short") / "job"
    check_ok(launch("tests/probe.py", *SHORT_PROBE_ARGS, "--output-dir", output_dir))
    return output_dir


@pytest.fixture(autouse=True)
def _the_session_keeps_its_forkserver(monkeypatch):
    """This process outlives each script it runs (run_main in-process), as a notebook's does: its forkserver serves
    the next run (started again per run, it cost the in-process tier a second each; and one ended is not started
    again in a process). A command's own ending is proven in launched tests."""
    from ddp_accel import endings, loaders

    monkeypatch.setattr(endings, "end_worker_processes", loaders.kill_leftover_workers)


@pytest.fixture(autouse=True)
def _signal_state_restored():
    """Each test starts with SIGTERM/SIGUSR1 unblocked and leaves pytest's handlers as it found them: a signal
    blocked in pytest is blocked in every process a later test starts (a launcher that never hears the SIGTERM a
    test sends it); and the garbage collector on, which the start-up guard pauses until run_main starts."""
    signums = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT)
    assert not {signal.SIGTERM, signal.SIGUSR1} & signal.pthread_sigmask(signal.SIG_BLOCK, []), (
        "SIGTERM/SIGUSR1 are blocked in pytest: an imported script blocked them at import"
    )
    handlers = {s: signal.getsignal(s) for s in signums}
    yield
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGUSR1})
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    from ddp_accel import startup

    if startup._collector_paused:  # stop_during_imports called alone: the garbage collector on again, nothing frozen
        startup._collector_paused = False
        gc.enable()


# --cpu-durations N: the CPU each test cost (pytest's own process + the processes it started and reaped, as
# /usr/bin/time counts them), the N largest and each tier's sum; what the suite's CPU budget is spent on
def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N", help="the N tests that cost most CPU")


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


_cpu_by_test: dict[str, tuple[str, float]] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = _cpu_seconds()
    yield
    if item.config.getoption("cpu_durations") is not None:
        tier = next(tier for tier in TIERS if item.get_closest_marker(tier) is not None)
        _cpu_by_test[item.nodeid] = (tier, _cpu_seconds() - start)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    count = config.getoption("cpu_durations")
    if count is None or not _cpu_by_test:
        return
    terminalreporter.section(f"CPU seconds (user + system, with reaped child processes), {count} largest")
    ranked = sorted(_cpu_by_test.items(), key=lambda entry: -entry[1][1])
    for nodeid, (tier, seconds) in ranked[: count or None]:
        terminalreporter.write_line(f"{seconds:8.1f}  {tier:12}  {nodeid}")
    for tier in TIERS:
        spent = [seconds for t, seconds in _cpu_by_test.values() if t == tier]
        if spent:
            terminalreporter.write_line(f"{sum(spent):8.1f}  {tier:12}  ({len(spent)} tests)")

"""The test tiers, and the state every test starts from (shared helpers live in helpers.py).

Every test belongs to exactly one tier (a pytest marker; collection fails otherwise):
- inprocess: no process is started; scripts run through `run_script` inside pytest (`pytest -m inprocess`: < 60 s)
- multiprocess: real 2-process jobs under accelerate launch / torchrun on the CPU (gloo), and single launches
- system: services and long chains: SLURM, etcd, network namespaces, real data, chained preemption
"""

import os
import signal
import tempfile

import pytest

TIERS = ("inprocess", "multiprocess", "system")

# the IMDB pipeline's encoded-data cache: one per test session, shared by its runs, not the user's own
os.environ.setdefault("XDG_CACHE_HOME", tempfile.mkdtemp(prefix="ddp_accel_test_cache_"))


def pytest_collection_modifyitems(config, items):
    untiered = [item.nodeid for item in items if sum(item.get_closest_marker(tier) is not None for tier in TIERS) != 1]
    if untiered:
        raise pytest.UsageError(f"tests without exactly one tier marker ({', '.join(TIERS)}): {untiered[:5]}")


@pytest.fixture(autouse=True)
def _signal_state_restored():
    """Each test starts with SIGTERM/SIGUSR1 unblocked and leaves pytest's handlers as it found them: a signal
    blocked in pytest is blocked in every process a later test starts (a launcher that never hears the SIGTERM a
    test sends it)."""
    signums = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT)
    assert not {signal.SIGTERM, signal.SIGUSR1} & signal.pthread_sigmask(signal.SIG_BLOCK, []), (
        "SIGTERM/SIGUSR1 are blocked in pytest: an imported script blocked them at import"
    )
    handlers = {s: signal.getsignal(s) for s in signums}
    yield
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGUSR1})
    for signum, handler in handlers.items():
        signal.signal(signum, handler)

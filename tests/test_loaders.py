"""DataLoader workers: started by a forkserver, never forked from the training process (whose other threads may hold
locks at the moment of a fork), shielded from preemption signals, always shut down."""

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from helpers import helper_process
from torch.utils.data import DataLoader, Dataset

from ddp_accel import loaders, startup
from ddp_accel.errors import UserError

inprocess = pytest.mark.inprocess

# held by a thread of the training process while its workers start: a forked worker inherits it held, forever
HELD_AT_FORK = threading.Lock()


def signal_masks(pid: int) -> dict[str, int]:
    """SigBlk / SigIgn of a process, from /proc."""
    lines = open(f"/proc/{pid}/status").read().splitlines()
    return {line.split(":")[0]: int(line.split()[1], 16) for line in lines if line.startswith(("SigBlk", "SigIgn"))}


def has(mask: int, signum: int) -> bool:
    return bool(mask & (1 << (signum - 1)))


class WhereAmI(Dataset):
    """Each sample: the worker's parent, whether it ignores SIGTERM and SIGUSR1; it first takes HELD_AT_FORK."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        with HELD_AT_FORK:
            ignored = signal_masks(os.getpid())["SigIgn"]
        return torch.tensor([os.getppid(), has(ignored, signal.SIGTERM), has(ignored, signal.SIGUSR1), gc.isenabled()])


def read_all(loader) -> torch.Tensor:
    with loaders.batches(loader) as batches:
        return torch.cat(list(batches))


@inprocess
def test_workers_start_while_another_thread_holds_a_lock_they_need():
    # what CPython gh-112275 does with an interpreter lock (Debian 12's Python 3.11.2), here with a lock of our own:
    # a worker forked while another thread holds it inherits it held and waits forever (the loader's timeout says so)
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with HELD_AT_FORK:
            taken.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(10)
    try:
        values = read_all(DataLoader(WhereAmI(), batch_size=2, num_workers=2, timeout=10))
    finally:
        release.set()
        holder.join()
    assert len(values) == 8
    parents = set(values[:, 0].tolist())
    server = helper_process(startup.FORKSERVER_COMMAND)
    assert parents == {server} and server != os.getpid(), (parents, server, os.getpid())
    assert values[:, 1:3].all(), "every worker ignores SIGTERM and SIGUSR1 (the training process decides when to stop)"
    assert values[:, 3].all(), "the forkserver's workers collect garbage again once started"
    blocked = signal_masks(server)["SigBlk"]  # a job-wide SIGTERM does not end the forkserver
    assert has(blocked, signal.SIGTERM) and has(blocked, signal.SIGUSR1)
    # nor SLURM's SIGUSR1 the resource tracker (its successor would print a KeyError for each queue released)
    tracker = helper_process("from multiprocessing.resource_tracker import main")
    assert tracker is not None and has(signal_masks(tracker)["SigBlk"], signal.SIGUSR1)


@inprocess
def test_a_loader_with_its_own_start_method_keeps_it():
    loader = DataLoader(WhereAmI(), batch_size=2, num_workers=1, multiprocessing_context="spawn")
    loaders.shield_workers(loader)
    assert loader.multiprocessing_context.get_start_method() == "spawn"


@inprocess
def test_the_start_method_can_be_chosen_and_a_wrong_one_is_one_line(monkeypatch):
    monkeypatch.setenv(loaders.WORKER_START_VARIABLE, "fork")
    assert loaders.worker_start_method() == "fork"
    monkeypatch.setenv(loaders.WORKER_START_VARIABLE, "threads")
    with pytest.raises(UserError, match="DDP_ACCEL_WORKER_START='threads' is not a start method"):
        loaders.worker_start_method()
    monkeypatch.delenv(loaders.WORKER_START_VARIABLE)
    assert loaders.worker_start_method() == "forkserver"


@inprocess
def test_an_interactive_session_forks_its_workers(monkeypatch):
    # a notebook's `__main__` cannot be imported again by a forkserver's children, so classes defined in it could
    # not reach the workers
    class Interactive:
        pass

    monkeypatch.setitem(__import__("sys").modules, "__main__", Interactive())
    assert loaders.worker_start_method() == "fork"


@inprocess
def test_a_first_batch_that_fails_shuts_its_workers_down():
    class Broken(Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> int:
            raise ValueError("broken sample")

    loader = DataLoader(Broken(), batch_size=2, num_workers=1, multiprocessing_context="fork")
    before = {child.pid for child in multiprocessing.active_children()}
    with pytest.raises(ValueError, match="broken sample"):
        read_all(loader)
    left = [child for child in multiprocessing.active_children() if child.pid not in before and child.daemon]
    assert not left, "a worker that ignores SIGTERM would hang the interpreter's exit"


@inprocess
def test_a_dataset_that_cannot_be_pickled_is_forked_with_a_warning(capsys):
    class Local(Dataset):  # defined in a function: a forkserver's worker could not unpickle it
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> int:
            return os.getppid()

    parents = read_all(DataLoader(Local(), batch_size=2, num_workers=1))
    assert set(parents.tolist()) == {os.getpid()}
    assert "warning: DataLoader workers are forked from the training process" in capsys.readouterr().err


@inprocess
def test_encoded_reviews_reach_a_worker_by_their_arrow_table_and_read_the_same():
    import pickle

    import datasets

    from ddp_accel.text.pipeline import EncodedReviews

    encoded = datasets.Dataset.from_dict(
        {"input_ids": [[1, 2, 3], [4], [5, 6]], "label": [0, 1, 0], "length": [3, 1, 2]}
    )
    reviews = EncodedReviews(encoded)
    copy = pickle.loads(pickle.dumps(reviews))
    for index in range(3):
        assert copy[index][0].tolist() == reviews[index][0].tolist() and copy[index][1] == reviews[index][1]


@pytest.mark.parametrize(
    ("argv", "asked"),
    [([], 4), (["-j", "2"], 2), (["-j0"], 0), (["--workers=3"], 3), (["--workers", "x"], 0), (["-e", "-j", "1"], 1)],
)
@inprocess
def test_the_workers_a_command_asks_for_are_read_as_argparse_will(argv, asked):
    assert startup.workers_asked(argv, ("-j", "--workers"), default=4) == asked


EARLY_START = """
import os, sys
sys.argv = ["train.py", *sys.argv[1:]]
from ddp_accel.startup import FORKSERVER_COMMAND, start_worker_server_early
asked = start_worker_server_early(("-j", "--workers"), default=0)
import psutil
servers = [c for c in psutil.Process().children() if FORKSERVER_COMMAND in " ".join(c.cmdline())]
print(asked, len(servers), "torch" in sys.modules, flush=True)
"""


@inprocess
@pytest.mark.parametrize(("args", "asked"), [(["-j", "2"], True), ([], False), (["-j", "0"], False)])
def test_a_command_that_asks_for_workers_starts_their_server_before_its_own_imports(tmp_path, args, asked):
    # what the scripts run first: the forkserver imports beside the script, which has imported no torch yet
    result = subprocess.run(
        [sys.executable, "-c", EARLY_START, *args], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(asked), str(int(asked)), "False"]


@inprocess
def test_the_forkserver_preloads_the_modules_a_script_imports_at_its_top_level(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "from __future__ import annotations\n"
        "if __name__ == '__main__':\n    import never_at_the_top\n"
        "import os, torch.utils.data\nfrom ddp_accel.vision import build_model\nfrom . import relative\n"
        "try:\n    import optional\nexcept ImportError:\n    pass\nimport os\n"
    )
    assert startup.modules_imported_by(script) == ["os", "torch.utils.data", "ddp_accel.vision"]
    script.write_text("def broken(:\n")
    assert startup.modules_imported_by(script) == []
    assert startup.modules_imported_by(tmp_path / "missing.py") == []


FORKED_SERVER = """
if __name__ == "__main__":
    from ddp_accel.startup import start_worker_server_early, stop_during_imports

    stop_during_imports(default_output_dir="out")
    start_worker_server_early(("-j",), default=0)

import atexit, gc, os, sys, threading, time
import torch
import torchvision  # imported by the script: preloaded in the forkserver
from torch.utils.data import DataLoader, Dataset
from ddp_accel import UserError, loaders, run_main

COLLECTED_DURING_IMPORTS = gc.isenabled()

HELD_AT_FORK = threading.Lock()


class TornDown:
    def __del__(self):  # runs when Python's exit tears the modules down
        print("modules torn down", flush=True)


TORN_DOWN = TornDown()


class WhereAmI(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        with HELD_AT_FORK:  # held by the training process's other thread while the workers start
            return torch.tensor([os.getppid()])


def main():
    import psutil

    from ddp_accel.startup import FORKSERVER_COMMAND

    servers = [c for c in psutil.Process().children() if FORKSERVER_COMMAND in " ".join(c.cmdline())]
    server = servers[0].pid
    if "--help" in sys.argv:  # what argparse does: SystemExit from inside main, past run_main's own ending
        print(server, flush=True)
        sys.exit(0)
    preloaded = [name for name in ("'torch'", "'torchvision'", "'ddp_accel'") if name in " ".join(servers[0].cmdline())]
    taken, release = threading.Event(), threading.Event()

    def hold():
        with HELD_AT_FORK:
            taken.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(10)
    try:
        with loaders.batches(DataLoader(WhereAmI(), batch_size=2, num_workers=2, timeout=20)) as batches:
            parents = set(torch.cat(list(batches))[:, 0].tolist())
    finally:
        release.set()
        holder.join()
    print(server, ",".join(preloaded), parents == {server}, flush=True)
    print(COLLECTED_DURING_IMPORTS, gc.isenabled(), gc.get_freeze_count() > 100_000, flush=True)
    global LOG
    LOG = open("never_closed.txt", "w")
    LOG.write("written, never flushed nor closed")
    threading.Thread(target=lambda: (time.sleep(0.2), open("thread.txt", "w").write("a thread ends"))).start()
    atexit.register(print, "atexit ran")
    raise UserError("a user error's exit code")


if __name__ == "__main__":
    run_main(main)
"""


@pytest.mark.multiprocess
def test_the_forkserver_starts_with_what_the_script_imported_and_is_gone_when_the_command_returns(tmp_path):
    # started at the script's start (Python's own forkserver, what the script imports preloaded); its workers come
    # from it, never from the training process, whose other thread holds a lock they need; the process then leaves
    # as any Python program does, and its forkserver is gone when the command returns
    (tmp_path / "train.py").write_text(FORKED_SERVER)
    result = subprocess.run(
        [sys.executable, "train.py", "-j", "2"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 2 and "error: a user error's exit code" in result.stderr, result.stderr
    server, preloaded, from_server = result.stdout.strip().split("\n")[0].split()
    assert preloaded == "'torch','torchvision','ddp_accel'" and from_server == "True", result.stdout
    # the garbage collector was off during the imports, and runs again from run_main on, the imports' objects frozen
    assert result.stdout.strip().split("\n")[1].split() == ["False", "True", "True"], result.stdout
    assert not os.path.exists(f"/proc/{server}"), result.stdout
    # Python's own exit: the atexit handlers, a thread's end, a file never closed flushed, the modules torn down
    assert "atexit ran" in result.stdout and "modules torn down" in result.stdout, result.stdout
    assert (tmp_path / "never_closed.txt").read_text() == "written, never flushed nor closed"
    assert (tmp_path / "thread.txt").read_text() == "a thread ends"
    # a main that leaves by SystemExit (--help, a wrong option): its forkserver is ended by then all the same
    result = subprocess.run(
        [sys.executable, "train.py", "-j", "2", "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    server = result.stdout.split()[0]
    assert result.returncode == 0 and not os.path.exists(f"/proc/{server}"), (result.stdout, result.stderr[-2000:])

"""Imported only inside the forkserver process that starts a training process's DataLoader workers (see
`ddp_accel.loaders.worker_context`), never in a training process.

- It blocks the preemption signals: a job-wide SIGTERM (SLURM, torchrun, Kubernetes) must not kill the forkserver
  (the training process decides when to stop), and a worker forked from it starts with them blocked until its first
  act ignores them (`loaders._ignore_preemption`), so that no worker dies of a signal before it can ignore it.
- It dies with the training process (Linux's parent-death signal). A forkserver otherwise outlives a training
  process killed with SIGKILL (out of memory, a lost node, a test): each worker holds the pipe that tells it its
  client is gone, and torch's workers watch their own parent, the forkserver, which stays; both would live on.
  The workers die with the forkserver the same way (`loaders._ignore_preemption`, their first act): torch's own
  watch of its parent starts only with its loop, and a worker that was still starting when the forkserver died
  lived on for good (2 kills in about 15, right after the first batch).
- It turns the cyclic garbage collector off until a worker has started (`loaders._ignore_preemption` freezes what
  the worker inherited, then turns it on: `WORKER_SERVER_VARIABLE` tells it so): a collection in a freshly forked
  worker walks every object it inherited (torch, accelerate, ...), which writes to each page and so copies it:
  measured, unpickling a 10,000-sample dataset took 0.19 s instead of 1 ms, and the workers' memory was no longer
  shared.
- It imports the training script (as `__mp_main__`, as spawn does: its `if __name__ == "__main__":` block does not
  run), with the training process's `sys.path`, so that each worker finds it imported. Python's forkserver means to
  do that, but never receives the script's path and ignores `sys.path` (3.11-3.13): each worker then runs the
  script's module body again, imports and all (0.65 s a worker for a script that imports torchvision). A script
  that fails to import here is imported by each worker, as Python does.
"""

import ctypes
import gc
import json
import multiprocessing.process
import multiprocessing.spawn
import os
import signal
import sys

# standard library only, up to the parent-death signal: a training process that dies while this one imports torch
# (seconds; it may start with the script's own imports) must not leave it behind
from ddp_accel.startup import (
    FORKSERVER_MAIN_MODULE_VARIABLE,
    FORKSERVER_MAIN_VARIABLE,
    FORKSERVER_SYS_PATH_VARIABLE,
    PR_SET_PDEATHSIG,
    SIGNALS,
    WORKER_SERVER_VARIABLE,
)

signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)

if sys.platform.startswith("linux"):  # had the training process died already, multiprocessing's own pipe ends us
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
os.environ[WORKER_SERVER_VARIABLE] = str(os.getpid())  # the workers' parent, which they die with
gc.disable()

import ddp_accel.loaders  # noqa: E402, F401  what each worker's first function is unpickled from

_main_path = os.environ.pop(FORKSERVER_MAIN_VARIABLE, "")
_main_name = os.environ.pop(FORKSERVER_MAIN_MODULE_VARIABLE, "")
_sys_path = os.environ.pop(FORKSERVER_SYS_PATH_VARIABLE, "")
if _sys_path:
    sys.path[:] = json.loads(_sys_path)
if _main_path or _main_name:
    multiprocessing.process.current_process()._inheriting = True  # type: ignore[attr-defined]
    try:
        if _main_name:
            multiprocessing.spawn._fixup_main_from_name(_main_name)  # type: ignore[attr-defined]
        else:
            multiprocessing.spawn.import_main_path(_main_path)
    except Exception:  # each worker imports it then, and reports what fails there
        pass
    finally:
        del multiprocessing.process.current_process()._inheriting  # type: ignore[attr-defined]

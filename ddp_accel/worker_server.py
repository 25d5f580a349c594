"""Preloaded in the forkserver that starts a training process's DataLoader workers (see
`ddp_accel.loaders.worker_context`), never imported in a training process. Python's forkserver imports its preload
list at its start (`multiprocessing.set_forkserver_preload`); this module is the list's first entry.

- It blocks the preemption signals: a job-wide SIGTERM (SLURM, torchrun, Kubernetes) must not kill the forkserver
  (the training process decides when to stop), and a worker forked from it starts with them blocked until its first
  act ignores them (`loaders._ignore_preemption`), so that no worker dies of a signal before it can ignore it. (The
  forkserver is started with them blocked too, for the moment before this import: `startup.start_forkserver`.)
- It dies with the training process (Linux's parent-death signal). A forkserver otherwise outlives a training
  process killed with SIGKILL (out of memory, a lost node, a test): each worker holds the pipe that tells it its
  client is gone, and torch's workers watch their own parent, the forkserver, which stays; both would live on.
  The workers die with the forkserver the same way (`loaders._ignore_preemption`, their first act).
- It turns the cyclic garbage collector off until a worker has started (`loaders._ignore_preemption` freezes what
  the worker inherited, then turns it on: `WORKER_SERVER_VARIABLE` tells it so): a collection in a freshly forked
  worker walks every object it inherited (torch, accelerate, ...), which writes to each page and so copies it:
  unpickling a 10,000-sample dataset took 0.19 s instead of 1 ms, and the workers' memory was no longer shared.
"""

import ctypes
import gc
import os
import signal
import sys

# standard library only, up to the parent-death signal: a training process that dies while this one imports torch
# must not leave it behind
from ddp_accel.startup import PR_SET_PDEATHSIG, SIGNALS, WORKER_SERVER_VARIABLE

signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)

if sys.platform.startswith("linux"):  # had the training process died already, multiprocessing's own pipe ends us
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
os.environ[WORKER_SERVER_VARIABLE] = str(os.getpid())  # the workers' parent, which they die with
gc.disable()

import ddp_accel.loaders  # noqa: E402, F401  what each worker's first function is unpickled from

"""The C allocator of a training process (Linux, glibc): the memory a step frees is kept for the next step.

PyTorch allocates CPU tensors with malloc. glibc serves a large allocation (above 128 KiB, a threshold it raises
up to 32 MiB as it goes) with its own mmap, and gives it back to the system when it is freed; it also gives back
the free memory at the top of its heap beyond a small threshold. A training step allocates the same activations
and gradients again each step, so each step faults its pages in again, zeroed by the kernel (the system time and
steps this costs, measured: docs/benchmarks.md, the allocator). jemalloc and tcmalloc, which PyTorch's CPU tuning
guide suggests preloading, keep freed memory alike.

So when a training loop on the CPU starts, glibc is told to serve every allocation from its heap (no mmap) and to
give back free memory at its top only beyond KEEP_FREE_BYTES (mallopt: for the whole process, never undone). What
was allocated before (the data, the model) keeps where it is. Left alone: a run on a GPU (its tensors are not
malloc's; the setting is not measured there), another allocator preloaded (LD_PRELOAD), glibc's own MALLOC_* tuning
variables set, or DDP_ACCEL_MALLOC=system.
"""

from __future__ import annotations

import ctypes
import os

ALLOCATOR_VARIABLE = "DDP_ACCEL_MALLOC"  # "system": glibc's defaults
KEEP_FREE_BYTES = 512 * 1024 * 1024
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
GLIBC_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

_kept = False


def keep_freed_memory(device_type: str) -> bool:
    """Tell glibc to keep what the training steps on `device_type` ("cpu", "cuda", ...) free (once per process);
    True when it is (now or before)."""
    global _kept
    if _kept or device_type != "cpu" or not applies():
        return _kept
    libc = ctypes.CDLL(None)
    _kept = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREE_BYTES))
    return _kept


def describe() -> str | None:
    """The banner's line, when the memory is kept."""
    return f"glibc keeps what a step frees for the next ({ALLOCATOR_VARIABLE}=system: its defaults)" if _kept else None


def applies() -> bool:
    """glibc's allocator, which the user has neither replaced nor tuned."""
    if os.environ.get(ALLOCATOR_VARIABLE, "").strip().lower() == "system":
        return False
    if any(name in os.environ.get("LD_PRELOAD", "") for name in OTHER_ALLOCATORS):
        return False
    if any(os.environ.get(name) for name in GLIBC_VARIABLES):
        return False
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")  # type: ignore[union-attr]
    except (ValueError, OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return False

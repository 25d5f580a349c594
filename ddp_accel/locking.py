"""One run per output dir at a time: the main process holds an exclusive `flock` on the folder itself (no lock file
in it). The kernel drops the lock when its holder exits, however it ends: a killed run never blocks its own resume."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from ddp_accel.errors import UserError


def lock_output_dir(output_dir: Path) -> int | None:
    """Create `output_dir` if needed and lock it; another run holding it is one line naming that process. Returns
    the descriptor that holds the lock (close it to release), or None where the file system has no flock."""
    output_dir.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(output_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(descriptor)
        if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None  # a file system without flock (some network mounts): no protection, no failure
        raise UserError(
            f"--output-dir {output_dir} is in use by another run ({holder(output_dir)}); wait for it to end, stop it, "
            "or pick another --output-dir"
        ) from None
    return descriptor


def holder(folder: Path) -> str:
    """The process holding the flock on `folder`, from /proc/locks (Linux; the same machine), as 'pid N: command'."""
    inode = os.stat(folder).st_ino
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return "process unknown"
    for line in lines:
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
            pid = fields[4]
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                command = ""
            return f"pid {pid}: {command.strip()[:120]}" if command.strip() else f"pid {pid}"
    return "a process on another machine, or one this machine cannot see"

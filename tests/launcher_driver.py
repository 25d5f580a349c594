"""python tests/launcher_driver.py notebook|debug PROBE_ARGS...: tests/probe.py through Accelerate's in-process
launchers, the way a notebook calls them (2 forked processes)."""

import sys

import probe
from accelerate import debug_launcher, notebook_launcher
from helpers import free_port

from ddp_accel import launched

if __name__ == "__main__":
    which, sys.argv = sys.argv[1], ["probe.py", *sys.argv[2:]]  # probe parses sys.argv in each worker
    if which == "notebook":
        notebook_launcher(launched(probe.main), num_processes=2, use_port=str(free_port()))
    else:
        debug_launcher(launched(probe.main), num_processes=2)

"""Run a plain PyTorch training script (pytorch/examples' imagenet/main.py) as it is, and say when it reached each
moment of its start-up, as metrics.json's `startup_phases` says it for ours: one JSON line on stdout at its first
optimizer step (rank 0), seconds from the process's start.

    python benchmarks/peer_phases.py PEER_SCRIPT ARGS...

Nothing of the script changes: its top-level imports are done first (the same modules, read from its source), then
it runs as `__main__`. The moments come from public hooks and from wrappers of the functions it calls: the process
group (`init_process_group`), the model (torchvision's builder), the data (`ImageFolder`), the first batch (the
DataLoader's first item) and the first optimizer step (`register_optimizer_step_post_hook`).
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ddp_accel.startup import modules_imported_by, process_started_at  # noqa: E402  (standard library only)

MOMENTS: dict[str, float] = {}


def reached(moment: str) -> None:
    MOMENTS.setdefault(moment, time.time())


def after(function, moment: str):  # noqa: ANN001, ANN201
    @functools.wraps(function)
    def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        result = function(*args, **kwargs)
        MOMENTS[moment] = time.time()  # the last call counts (train, then val)
        return result

    return timed


def main() -> None:
    script = Path(sys.argv[1]).resolve()
    for module in modules_imported_by(script):
        __import__(module)
    reached("imports")

    import torch
    import torch.distributed
    import torchvision
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils.data import DataLoader

    torch.distributed.init_process_group = after(torch.distributed.init_process_group, "process_group")
    for name in [name for name in vars(torchvision.models) if name.islower() and not name.startswith("_")]:
        if callable(builder := getattr(torchvision.models, name)) and not isinstance(builder, type(torchvision)):
            setattr(torchvision.models, name, after(builder, "model"))
    torchvision.datasets.ImageFolder.__init__ = after(torchvision.datasets.ImageFolder.__init__, "data")
    first_iter = DataLoader.__iter__

    def iterate(loader):  # noqa: ANN001, ANN202
        for item in first_iter(loader):
            reached("first_batch")
            yield item

    DataLoader.__iter__ = iterate

    def first_step(optimizer, args, kwargs) -> None:  # noqa: ANN001
        if "first_step" in MOMENTS:
            return
        reached("first_step")
        if os.environ.get("RANK", "0") == "0":
            started = process_started_at()
            order = sorted(MOMENTS, key=MOMENTS.get)
            print(json.dumps({"peer_phases": {name: round(MOMENTS[name] - started, 3) for name in order}}), flush=True)

    register_optimizer_step_post_hook(first_step)
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()

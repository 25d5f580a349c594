"""torch._dynamo imported when something compiles, not at an optimizer's first use (ddp_accel/lazy_compiler.py);
whole runs that import neither the compiler nor what Accelerate asks about (ddp_accel/lazy_libraries.py)."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import ROOT
from torch.optim.optimizer import _use_grad_for_differentiable

from ddp_accel import lazy_compiler

inprocess = pytest.mark.inprocess


def probe_optimizer_class():
    """torch's two decorations on an optimizer of the test's own (a new class each time), so that no class of
    torch's is changed."""

    class ProbeOptimizer(torch.optim.Optimizer):
        def __init__(self, params, differentiable=False):
            super().__init__(params, {"differentiable": differentiable})
            self.calls = []

        @_use_grad_for_differentiable
        def step(self, closure=None):
            self.calls.append(("step", torch.is_grad_enabled()))

        @torch._disable_dynamo
        def cleared(self, value):
            self.calls.append(("cleared", value))
            return value

    return ProbeOptimizer


def make(optimizer_class, differentiable=False):
    return optimizer_class([torch.nn.Parameter(torch.ones(1))], differentiable=differentiable)


@inprocess
def test_until_the_compiler_is_imported_the_wrapped_functions_run_as_they_are(monkeypatch):
    import torch._dynamo  # noqa: F401

    make(probe_optimizer_class())  # torch's base class's wrappers made with the compiler, as in pytest's process
    probe = probe_optimizer_class()
    monkeypatch.setitem(sys.modules, lazy_compiler.COMPILER, None)  # as if never imported; an import raises
    assert lazy_compiler.defer_compiler_import(owners=[probe]) == 2
    optimizer, differentiable = make(probe), make(probe, differentiable=True)
    assert optimizer.cleared(7) == 7  # torch's own wrapper would import torch._dynamo here: ImportError
    with torch.enable_grad():
        optimizer.step()
        assert torch.is_grad_enabled()  # the grad mode the step found, back after it
        differentiable.step()
    assert optimizer.calls == [("cleared", 7), ("step", False)] and differentiable.calls == [("step", True)]
    assert lazy_compiler.defer_compiler_import(owners=[probe]) == 0  # idempotent


@inprocess
def test_once_the_compiler_is_imported_torchs_own_wrappers_run_again(monkeypatch):
    import torch._dynamo  # noqa: F401 (the compiler imported, as --compile does)

    probe = probe_optimizer_class()
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, lazy_compiler.COMPILER, None)
        lazy_compiler.defer_compiler_import(owners=[probe])
    optimizer = make(probe)
    function = vars(probe)["cleared"].__wrapped__
    deferred = getattr(function, "__dynamo_disable")
    assert optimizer.cleared(3) == 3
    assert getattr(function, "__dynamo_disable") is not deferred  # torch's torch._dynamo.disable(fn) now
    called = []
    monkeypatch.setattr(torch._dynamo, "graph_break", lambda: called.append("graph break"))
    optimizer.step()
    assert called == ["graph break", "graph break"] and optimizer.calls[-1] == ("step", False)


@inprocess
def test_the_stand_in_answers_as_the_unimported_compiler_would_and_imports_it_for_anything_else(monkeypatch):
    import torch._dynamo.utils

    default_mode = torch._dynamo.utils.get_optimize_ddp_mode()
    stand_in = lazy_compiler._stand_in()
    monkeypatch.setitem(sys.modules, lazy_compiler.COMPILER, None)
    assert stand_in.utils.get_optimize_ddp_mode() == default_mode == "ddp_optimizer"
    assert not isinstance(torch.nn.Linear(1, 1), stand_in.eval_frame.OptimizedModule)
    with pytest.raises(ImportError):  # anything else is the module's to answer: imported
        getattr(stand_in, "config")  # noqa: B009
    monkeypatch.undo()
    assert stand_in.config is torch._dynamo.config
    assert stand_in.eval_frame.OptimizedModule is torch._dynamo.eval_frame.OptimizedModule


RUN_WITHOUT_THE_COMPILER = textwrap.dedent(
    """
    import runpy, sys
    import torch
    sys.argv = ["minimal.py", "--output-dir", sys.argv[1], "--epochs", "1"]
    from ddp_accel.runtime import run_main
    module = runpy.run_path("scripts/minimal.py", run_name="minimal")  # run_main below: not the script's exit
    try:
        run_main(module["main"])
    except SystemExit as ended:
        assert ended.code == 0, ended.code
    # DDP on a world of one: its constructor and its forward asked torch._dynamo before
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    optimizer.load_state_dict(optimizer.state_dict())
    from accelerate.utils import extract_model_from_parallel
    assert extract_model_from_parallel(model) is model.module
    # a data loader prepared for rank 0 of 2 (the run above had one process): Accelerate asks about `datasets`
    from accelerate.data_loader import prepare_data_loader
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    assert len(prepare_data_loader(loader, num_processes=2, process_index=0, put_on_device=False)) == 2
    torch.distributed.destroy_process_group()
    for module in ["torch._dynamo", "datasets"]:  # (torch.distributed.tensor: the final save asks about DTensor)
        print(module, "imported:", module in sys.modules)
    """
)


@pytest.mark.multiprocess
def test_a_run_and_ddp_train_without_importing_the_compiler_or_datasets(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT_THE_COMPILER, str(tmp_path / "run")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    imported = [line for line in result.stdout.splitlines() if " imported: " in line]
    assert imported == ["torch._dynamo imported: False", "datasets imported: False"], result.stdout[-2000:]
    assert (tmp_path / "run" / "model.safetensors").is_file()


@pytest.mark.multiprocess
def test_on_two_processes_only_rank_0_imports_dtensor_to_write_the_model(short_job):
    """DTensor's module (~0.55 s of CPU with sympy) is imported by rank 0's final save (huggingface_hub's sharding
    asks about DTensor; so does Accelerate's unwrap, for FSDP) and by nothing else: Accelerate's prepare does not
    ask (ddp_accel/lazy_libraries.py), nor does any other rank write the model. Neither rank imports the compiler
    or `datasets`."""
    imported = {rank: json.loads((short_job / f"imported_rank{rank}.json").read_text()) for rank in (0, 1)}
    assert imported == {0: ["torch.distributed.tensor"], 1: []}

"""torch's compiler (torch._dynamo) imported when something compiles, not at an optimizer's first use.

torch.optim imports torch._dynamo at an optimizer's first `add_param_group`, `zero_grad`, `state_dict` and
`step`, to keep the compiler out of those functions (`torch._disable_dynamo`) or to break its graph around the step
(`torch._dynamo.graph_break()`). Until torch._dynamo is imported nothing can be compiling, so both are no-ops, and
the import costs about 0.6 s of CPU in every process that trains (measured on 2 cores: 3.0 -> 2.4 s of CPU for
a one-process command). `defer_compiler_import` makes those functions call the undecorated function while
torch._dynamo is not imported; from the moment it is (`--compile`, or anything else importing it), each call goes
through torch's own wrapper again, as if nothing had been changed.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import _use_grad_for_differentiable

COMPILER = "torch._dynamo"
_DISABLED_ATTRIBUTE = "__dynamo_disable"  # where torch._compile's wrapper caches torch._dynamo.disable(fn)


def compiler_imported() -> bool:
    return sys.modules.get(COMPILER) is not None


def _wrapper_code(make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Any:
    return make(lambda *args: None).__code__


_DISABLE_DYNAMO_CODE = _wrapper_code(torch._disable_dynamo)
_USE_GRAD_CODE = _wrapper_code(_use_grad_for_differentiable)


def _defer_disable_dynamo(wrapper: Callable[..., Any]) -> bool:
    """A `torch._disable_dynamo` wrapper: its function called as it is until torch._dynamo is imported. The wrapper
    reads a cached `torch._dynamo.disable(fn)` from the function; it finds this one instead, which steps aside (the
    cache emptied, the wrapper called again) once the compiler is there."""
    function = getattr(wrapper, "__wrapped__", None)
    if function is None or getattr(wrapper, "__code__", None) is not _DISABLE_DYNAMO_CODE:
        return False
    if getattr(function, _DISABLED_ATTRIBUTE, None) is not None:  # already cached (or deferred)
        return False

    def until_the_compiler(*args: Any, **kwargs: Any) -> Any:
        if compiler_imported():
            if function.__dict__.get(_DISABLED_ATTRIBUTE) is until_the_compiler:  # (another thread may have)
                function.__dict__.pop(_DISABLED_ATTRIBUTE, None)
            return wrapper(*args, **kwargs)
        return function(*args, **kwargs)

    setattr(function, _DISABLED_ATTRIBUTE, until_the_compiler)
    return True


def _step_without_compiler(use_grad: Callable[..., Any]) -> Callable[..., Any]:
    """An optimizer's `step` as torch.optim's `_use_grad_for_differentiable` runs it, minus the compiler's graph
    breaks (no-ops outside a compiled function) while the compiler is not imported or not compiling."""
    step = getattr(use_grad, "__wrapped__")  # noqa: B009 (functools.update_wrapper's, untyped)

    @functools.wraps(step)
    def step_with_grad_mode(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or compiler_imported():
            return use_grad(*args, **kwargs)
        was_enabled = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(args[0].defaults["differentiable"])
            return step(*args, **kwargs)
        finally:
            torch.set_grad_enabled(was_enabled)

    return step_with_grad_mode


def _wrapping_chain(value: Any) -> list[Any]:
    chain = [value]
    while hasattr(chain[-1], "__wrapped__") and len(chain) < 8:
        chain.append(chain[-1].__wrapped__)
    return chain


def _optimizer_classes() -> list[type]:
    found: list[type] = []
    pending: list[type] = [torch.optim.Optimizer]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


def defer_compiler_import(owners: list[type] | None = None) -> int:
    """Defer torch._dynamo's import in the optimizers defined so far (torch's and the script's), and in DDP's
    wrappers; idempotent. A class whose `step` an optimizer already wrapped (torch's profiling hook, at its first
    instance) keeps torch's step. How many things were changed (0 once the compiler is imported). `owners`: the
    classes to look at instead of every optimizer and DDP (tests)."""
    if compiler_imported():
        return 0
    changed = 0
    if owners is None and "_dynamo" not in vars(torch):  # not yet asked for (torch's __getattr__ would import it)
        torch._dynamo = _stand_in()
        changed += 1
    for cls in owners or [*_optimizer_classes(), torch.nn.parallel.DistributedDataParallel]:
        for name, value in list(vars(cls).items()):
            if getattr(value, "__code__", None) is _USE_GRAD_CODE and name == "step":
                setattr(cls, name, _step_without_compiler(value))
                changed += 1
            else:  # the wrapper itself, or under another decorator (DDP's forward context: contextlib's)
                changed += any(_defer_disable_dynamo(wrapper) for wrapper in _wrapping_chain(value))
    return changed


class _NeverCompiled:
    """What `torch._dynamo.eval_frame.OptimizedModule` is before torch._dynamo is imported: nothing can be an
    instance of a class torch.compile makes, when torch.compile has never run (Accelerate's `unwrap_model` asks)."""


class _CompilerStandIn(types.ModuleType):
    """`torch._dynamo` as torch's attribute until the module is imported. It answers the two questions asked of it
    outside compilation with what the module would say before anything changed it: DDP's constructor reads the
    default `optimize_ddp` mode, Accelerate asks whether a model is compiled. Anything else imports torch._dynamo
    (which then replaces this attribute) and is answered by it. (`from torch import _dynamo` before that import
    keeps this object: what it reads comes from the module, what it sets stays here; torch itself never does it.)"""

    def __init__(self, name: str, known: dict[str, Any]):
        super().__init__(name)
        self._known = known

    def __getattr__(self, name: str) -> Any:
        if not compiler_imported() and name in self._known:
            return self._known[name]
        return getattr(importlib.import_module(self.__name__), name)


def _stand_in() -> _CompilerStandIn:
    def get_optimize_ddp_mode() -> str:  # torch._dynamo.config.optimize_ddp's default, True
        return "ddp_optimizer"

    utils = _CompilerStandIn(f"{COMPILER}.utils", {"get_optimize_ddp_mode": get_optimize_ddp_mode})
    eval_frame = _CompilerStandIn(f"{COMPILER}.eval_frame", {"OptimizedModule": _NeverCompiled})
    return _CompilerStandIn(COMPILER, {"utils": utils, "eval_frame": eval_frame})

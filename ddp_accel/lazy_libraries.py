"""Two of Accelerate's questions answered without importing a module that cannot be the answer.

In every process of every run Accelerate's `prepare` asks of a model whether it holds DTensor parameters, and on
more than one process of a data loader whether its dataset is a Hugging Face `datasets.IterableDataset`. Each answer
imports a module only for an `isinstance`: torch.distributed.tensor with sympy (~0.55 s of CPU) and `datasets`
(~0.8 s of CPU), measured on 2 cores with accelerate 1.15 and torch 2.14. Nothing can be an instance of a class
whose module was never imported, so while it is not, the answer is "no" without the import; once anything imports
it (a DTensor model, FSDP, a script that loads its data with `datasets`), Accelerate's own function answers.

Left as it is: `unwrap_model` imports FSDP's module (and DTensor's with it) to ask whether a model is FSDP-wrapped
(rank 0 unwraps the model it writes at the end). Answered without that import, a run under Accelerate's
`debug_launcher` failed at the launcher's end: the rendezvous file it deletes itself was already gone (seen, not
explained: tests/test_launchers.py's debug run).

Only a function whose one user is the known question is changed: another Accelerate that asks it elsewhere keeps its
own function (slower, never wrong).
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import accelerate.accelerator
import accelerate.data_loader
import accelerate.state

DTENSOR = "torch.distributed.tensor"  # DTensor's class lives in a submodule: its import imports this package
DATASETS = "datasets"

# (Accelerate's module, the function its code calls, the module whose classes the answer is about, where it is called)
QUESTIONS = [
    (accelerate.accelerator, "model_has_dtensor", DTENSOR, {"Accelerator.prepare_model"}),
    (accelerate.data_loader, "is_datasets_available", DATASETS, {"prepare_data_loader"}),
    (accelerate.state, "is_datasets_available", DATASETS, {"PartialState.split_between_processes"}),
]


def imported(module: str) -> bool:
    return sys.modules.get(module) is not None


_DEFERRED: set[Callable[..., bool]] = set()  # the functions made here (so that a second call changes nothing)


def _no_until_imported(module: str, answer: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(answer)
    def answer_once_imported(*args: Any, **kwargs: Any) -> bool:
        return imported(module) and answer(*args, **kwargs)

    _DEFERRED.add(answer_once_imported)
    return answer_once_imported


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _codes(constant)


def callers(module: types.ModuleType, name: str) -> set[str]:
    """The functions and methods defined in `module` whose code (nested functions included) calls `name`."""
    found = set()
    for key, value in vars(module).items():
        if getattr(value, "__module__", None) != module.__name__:
            continue
        members = [(f"{key}.{member}", item) for member, item in vars(value).items()] if inspect.isclass(value) else []
        for label, item in members or [(key, value)]:
            function = getattr(item, "__func__", getattr(item, "fget", item))
            code = getattr(inspect.unwrap(function) if callable(function) else None, "__code__", None)
            if code is not None and any(name in nested.co_names for nested in _codes(code)):
                found.add(label)
    return found


def defer_library_imports(questions: list[tuple[types.ModuleType, str, str, set[str]]] = QUESTIONS) -> int:
    """Answer Accelerate's DTensor and `datasets` questions without their imports while those modules are
    not imported; idempotent. How many functions were changed. `questions`: others than Accelerate's (tests)."""
    changed = 0
    for owner, name, module, asked_by in questions:
        answer = getattr(owner, name, None)
        if answer is None or answer in _DEFERRED or callers(owner, name) != asked_by:
            continue
        setattr(owner, name, _no_until_imported(module, answer))
        changed += 1
    return changed

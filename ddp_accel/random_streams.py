"""A process's random generators at one moment, and a digest that tells whether two processes' are the same.

What a survivor of a lost peer saves as every rank's streams must be every rank's: the ranks compare a digest of
their streams at each step (ddp_accel.agreement.StepAgreement), and a digest blind to one field would call two
different streams the same. So the digest covers every value of every state, whatever its shape: each state is
reduced to its leaves (numbers, strings, the bytes of an array or a tensor), tagged with their types and positions.

The generators are those Accelerate's `save_state` writes into random_states_N.pkl, under its own keys (Python's,
numpy's legacy global one, torch's CPU one, and the accelerator device's where there is one), and any a callback
draws from on each rank (`Callback.random_generators()`: a torch.Generator, a numpy Generator or RandomState, a
random.Random).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch

DIGEST_BITS = 52  # exact in a float64: the agreement's all-reduce carries it
_SCALARS = frozenset((int, float, str, bytes, bool, type(None)))


def generator_state(generator: Any) -> Any:
    """The state of one of a callback's generators (what it would save and restore)."""
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    if isinstance(generator, numpy.random.Generator):
        return generator.bit_generator.state
    if isinstance(generator, numpy.random.RandomState):
        return generator.get_state()
    if isinstance(generator, random.Random):
        return generator.getstate()
    raise TypeError(
        f"a random generator must be a torch.Generator, numpy.random.Generator, numpy.random.RandomState or "
        f"random.Random, found {type(generator).__name__}"
    )


def device_states() -> dict[str, Any]:
    """The accelerator device's generators, as Accelerate's save_state keys them: `torch_<device>_manual_seed`, every
    device's (one state on MPS); none on a machine without one."""
    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if device is None:
        return {}
    module = torch.get_device_module(device.type)
    states = module.get_rng_state() if device.type == "mps" else module.get_rng_state_all()
    return {f"torch_{device.type}_manual_seed": states}


@dataclass(frozen=True)
class RandomStreams:
    """`accelerate`: Accelerate's generators under its keys of random_states_N.pkl; `registered`: a callback's, by
    the name it gave them."""

    accelerate: dict[str, Any]
    registered: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def now(cls, generators: Mapping[str, Any] | None = None) -> RandomStreams:
        states = {
            "random_state": random.getstate(),
            "numpy_random_seed": numpy.random.get_state(),
            "torch_manual_seed": torch.get_rng_state(),
            **device_states(),
        }
        return cls(states, {name: generator_state(one) for name, one in (generators or {}).items()})

    def digest(self) -> int:
        """DIGEST_BITS bits of a hash of every value of every state."""
        blake = hashlib.blake2b(digest_size=8)
        feed(blake, {"accelerate": self.accelerate, "registered": self.registered})
        return int.from_bytes(blake.digest(), "little") & ((1 << DIGEST_BITS) - 1)

    def accelerate_states(self, step: int) -> dict[str, Any]:
        """What Accelerate's save_state writes into random_states_N.pkl."""
        return {"step": step, **self.accelerate}


def feed(blake: Any, value: Any) -> None:
    """Every leaf of `value` into the hash, with its type and its place (a tuple's length, a mapping's keys), so
    that no two different states feed the same bytes. (It runs at every step: the common types are tested first.)"""
    kind = type(value)
    if kind in _SCALARS or isinstance(value, numpy.generic):
        blake.update(f"{kind.__name__} {value!r};".encode())
    elif kind is tuple or kind is list:
        if _SCALARS.issuperset(map(type, value)):  # (Python's 625 words at once)
            blake.update(f"{kind.__name__} {value!r};".encode())
            return
        blake.update(f"{kind.__name__} {len(value)}:".encode())
        for item in value:
            feed(blake, item)
    elif isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        blake.update(f"tensor {flat.dtype} {tuple(value.shape)}:".encode())
        blake.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    elif isinstance(value, numpy.ndarray):
        blake.update(f"array {value.dtype.str} {value.shape}:".encode())
        blake.update(numpy.ascontiguousarray(value).tobytes())
    elif isinstance(value, Mapping):
        blake.update(f"mapping {len(value)}:".encode())
        for key in sorted(value, key=repr):
            blake.update(f"{key!r}=".encode())
            feed(blake, value[key])
    else:
        raise TypeError(f"a random state holds a {kind.__name__}, which the streams' digest cannot read")

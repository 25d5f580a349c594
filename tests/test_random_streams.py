"""The ranks' random streams, as the per-step agreement compares them: every generator Accelerate saves (bitwise, as
its own save_state writes them on this machine and this version) and every callback's, and a digest that no single
changed value of any of them leaves the same."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddp_accel import Callback
from ddp_accel.agreement import StepAgreement
from ddp_accel.callbacks import Callbacks
from ddp_accel.random_streams import RandomStreams

pytestmark = pytest.mark.inprocess


def same(one, other) -> bool:
    """Bitwise equality of two nested states."""
    if isinstance(one, torch.Tensor):
        return isinstance(other, torch.Tensor) and one.dtype == other.dtype and torch.equal(one, other)
    if isinstance(one, np.ndarray):
        return isinstance(other, np.ndarray) and one.dtype == other.dtype and np.array_equal(one, other)
    if isinstance(one, dict):
        return isinstance(other, dict) and one.keys() == other.keys() and all(same(one[k], other[k]) for k in one)
    if isinstance(one, (tuple, list)):
        return type(one) is type(other) and len(one) == len(other) and all(map(same, one, other))
    return type(one) is type(other) and one == other


def test_the_streams_are_every_generator_accelerate_saves_as_its_save_state_writes_them(tmp_path):
    # Accelerate's own writer of random_states_N.pkl, in this process: the survivor's copy must hold the same keys
    # and the same values, whichever Accelerate version and device this is
    from accelerate import PartialState
    from accelerate.checkpointing import save_accelerator_state
    from accelerate.state import AcceleratorState

    PartialState(cpu=True)  # (Accelerate's logging asks for one)
    random.random(), np.random.standard_normal(), torch.rand(3)  # (a cached Gaussian, positions inside a block)
    streams = RandomStreams.now()
    save_accelerator_state(str(tmp_path), [], [], [], [], 0, 17, None, save_on_each_node=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    written = torch.load(tmp_path / "random_states_0.pkl", weights_only=False)
    ours = streams.accelerate_states(17)
    assert ours.keys() == written.keys()
    for key in written:
        assert same(ours[key], written[key]), key


class Noise(Callback):
    """A callback that draws from generators of its own on each rank."""

    def __init__(self, seed: int):
        self.torch = torch.Generator().manual_seed(seed)
        self.numpy = np.random.default_rng(seed)
        self.legacy = np.random.RandomState(seed)
        self.python = random.Random(seed)

    def random_generators(self):
        return {"torch": self.torch, "numpy": self.numpy, "legacy": self.legacy, "python": self.python}


def leaves(value, path=()):
    """(path, leaf) of every value of a nested state, an array's and a tensor's elements each."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, (*path, key))
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from leaves(item, (*path, index))
    elif isinstance(value, (np.ndarray, torch.Tensor)):
        for index in range(value.reshape(-1).shape[0]):
            yield (*path, ("element", index)), value
    else:
        yield path, value


def changed(value, path):
    """A copy of `value` with the one leaf at `path` changed (of the same type where it has one)."""
    if not path:
        if isinstance(value, bool):
            return not value
        if isinstance(value, int):
            return value + 1
        if isinstance(value, float):
            return np.nextafter(value, np.inf).item()
        if isinstance(value, str):
            return value + "x"
        return 0.5  # None: a Gaussian cached where none was
    head, rest = path[0], path[1:]
    if isinstance(head, tuple) and head[0] == "element":
        copy = value.copy() if isinstance(value, np.ndarray) else value.clone()
        flat = copy.reshape(-1)
        flat[head[1]] = flat[head[1]] ^ 1
        return copy
    if isinstance(value, dict):
        return {**value, head: changed(value[head], rest)}
    items = list(value)
    items[head] = changed(items[head], rest)
    return type(value)(items)


def test_no_single_changed_value_of_any_generator_leaves_the_digest_the_same():
    # every field of every state: Accelerate's generators and each kind a callback may register, one value at a
    # time. A digest that leaves out a generator, a field (numpy's position, its cached Gaussian) or part of a
    # state's bytes fails here
    np.random.standard_normal()  # numpy's legacy generator now holds a cached Gaussian
    streams = RandomStreams.now(Callbacks([Noise(3)]).random_generators())
    states = {"accelerate": streams.accelerate, "registered": streams.registered}
    assert {"random_state", "numpy_random_seed", "torch_manual_seed"} <= streams.accelerate.keys()
    assert streams.registered.keys() == {"Noise.torch", "Noise.numpy", "Noise.legacy", "Noise.python"}
    original, checked, blind = streams.digest(), 0, []
    for path, _ in leaves(states):
        other = changed(states, path)
        if RandomStreams(other["accelerate"], other["registered"]).digest() == original:
            blind.append(path)
        checked += 1
    assert not blind, f"the digest is blind to {len(blind)} of {checked} values, such as {blind[:3]}"
    assert checked > 10_000  # (every element of the tensors and arrays was changed once)


def test_ranks_whose_numpy_stream_stands_at_another_place_of_one_block_differ():
    # numpy's key array changes once per 624 draws: two ranks that drew 1 and 2 values hold the same keys, at
    # other positions; a Gaussian drawn in pairs leaves one cached on one rank only
    def after(draw):
        np.random.seed(0)
        draw()
        return RandomStreams.now()

    one, two = after(lambda: np.random.random_sample()), after(lambda: np.random.random_sample(2))
    assert np.array_equal(one.accelerate["numpy_random_seed"][1], two.accelerate["numpy_random_seed"][1])
    assert one.digest() != two.digest()
    cached, none_cached = after(lambda: np.random.standard_normal()), after(lambda: np.random.standard_normal(2))
    assert cached.accelerate["numpy_random_seed"][3] != none_cached.accelerate["numpy_random_seed"][3]
    assert cached.digest() != none_cached.digest()


def test_ranks_agree_their_streams_differ_where_only_a_callback_s_generator_does(monkeypatch):
    # two ranks' agreements in one process, their MAX all-reduce done here (the second rank's call sees both):
    # the same global streams on both, the callback's generator drawn once more on one rank
    from ddp_accel import agreement as stopping

    def agreed_alike(callbacks) -> bool:
        sent = []

        def all_reduce(tensor, op):
            sent.append(tensor.clone())
            if len(sent) == 2:
                tensor.copy_(torch.maximum(*sent))

        monkeypatch.setattr(stopping.dist, "all_reduce", all_reduce)
        for rank, callback in enumerate(callbacks):
            accelerator = SimpleNamespace(
                device=torch.device("cpu"), process_index=rank, optimizer_step_was_skipped=False, scaler=None
            )
            agreement = StepAgreement(accelerator, generators=Callbacks([callback]).random_generators())
            agreement.streams = agreement.distributed = True  # (as with two processes)
            agreement._host = torch.zeros(4, dtype=torch.float64)
            torch.manual_seed(0)  # the global streams: the same on both ranks
            agreement.step_done(5, None)
        return agreement.agreed_streams[2]

    assert agreed_alike([Noise(1), Noise(1)])
    drawn = Noise(1)
    torch.rand(1, generator=drawn.torch)
    assert not agreed_alike([Noise(1), drawn])


def test_a_run_compares_its_callbacks_generators_with_the_streams(tmp_path, monkeypatch):
    # a one-process fit: what the run hands its agreement (with two processes, these are compared at each step)
    from test_pieces import fit_small

    from ddp_accel import training

    handed = []
    real = training.StepAgreement

    def spy(*args, **kwargs):
        handed.append(kwargs.get("generators"))
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "StepAgreement", spy)
    noise = Noise(2)
    fit_small(tmp_path / "run", noise)
    assert handed and handed[0] == {f"Noise.{name}": one for name, one in noise.random_generators().items()}

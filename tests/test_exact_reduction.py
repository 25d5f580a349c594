"""--exact-micro-batch M (ddp_accel.exact_reduction): a step's gradient bitwise the same on any number of processes.
The processes are faked in this process (one thread each for the ordered sum); tests/test_streaming.py proves it
launched, across a resume on another world size."""

import contextlib
import importlib.metadata
import queue
import threading

import pytest
import torch
from helpers import assert_clean_error, assert_same_weights, check_ok, run_script
from packaging import version

from ddp_accel import UserError
from ddp_accel.exact_reduction import ExactReduction, ProcessChain, pieces, refusal
from ddp_accel.vision.mixing import BatchMixing

PROBE = "tests/probe.py"
GLOBAL_BATCH = 12
pytestmark = pytest.mark.inprocess


class FakeGroup:
    """The processes of one fake world, one thread each for `reduce`: what ProcessChain does over torch.distributed,
    through queues and a barrier."""

    def __init__(self, size: int):
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size)
        self.mailboxes = {(a, b): queue.Queue() for a in range(size) for b in range(size)}

    def chain(self, rank: int) -> "FakeChain":
        return FakeChain(self, rank)

    def all_gather(self, rank: int, value):
        self.slots[rank] = value
        self.barrier.wait()
        gathered = list(self.slots)
        self.barrier.wait()  # every process has read the slots before the next exchange writes them
        return gathered


class FakeChain(ProcessChain):
    def __init__(self, group: FakeGroup, rank: int):
        self.group, self.rank = group, rank

    def send(self, tensor, rank):
        self.group.mailboxes[self.rank, rank].put(tensor.clone())

    def receive(self, tensor, rank):
        tensor.copy_(self.group.mailboxes[rank, self.rank].get(timeout=30))

    def broadcast(self, tensor, rank):
        tensor.copy_(self.group.all_gather(self.rank, tensor.clone())[rank])

    def sum(self, count, device):
        return sum(self.group.all_gather(self.rank, count))


class FakeAccelerator:
    """The parts of an Accelerator ExactReduction uses, for one rank of a FakeGroup."""

    def __init__(self, group: FakeGroup, rank: int):
        self.num_processes, self.process_index = group.size, rank

    def no_sync(self, model):
        return contextlib.nullcontext()


def make_model(dropout: float = 0.3) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(7, 33), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(33, 3)]
    return torch.nn.Sequential(*layers)


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def mixed_loss_fn(mixing: BatchMixing):
    def loss(model, batch):
        x, y = mixing(batch[0].view(-1, 1, 1, 7), batch[1])  # MixUp mixes images: (N, C, H, W)
        return torch.nn.functional.cross_entropy(model(x.view(-1, 7)), y)

    return loss


def data(steps: int, accumulation: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    samples = steps * accumulation * GLOBAL_BATCH
    return torch.randn(samples, 7, generator=generator), torch.randint(3, (samples,), generator=generator)


def step_gradients(
    processes: int, accumulation: int = 1, micro_batch: int = 2, steps: int = 2, dropout: float = 0.3, mixup: float = 0
) -> list[list]:
    """Each step's gradients on every fake process, from the same global batches (GLOBAL_BATCH samples a micro-batch
    step, cut among the processes as Accelerate's batch sharding does: rank r takes the r-th of each global batch's
    per-process batches)."""
    x, y = data(steps, accumulation)
    batch_size = GLOBAL_BATCH // processes
    group = FakeGroup(processes)
    losses = [mixed_loss_fn(BatchMixing(3, seed=5, mixup_alpha=mixup)) if mixup else loss_fn for _ in range(processes)]
    models = [make_model(dropout) for _ in range(processes)]
    reductions = [
        ExactReduction(FakeAccelerator(group, rank), models[rank], micro_batch, batch_size, 5, group.chain(rank))
        for rank in range(processes)
    ]
    results = []
    for step in range(steps):
        for micro in range(accumulation):
            start = (step * accumulation + micro) * GLOBAL_BATCH
            for rank, reduction in enumerate(reductions):  # one process at a time: dropout draws the global generator
                first = start + rank * batch_size
                reduction.compute((x[first : first + batch_size], y[first : first + batch_size]), losses[rank], step)
        threads = [threading.Thread(target=reduction.reduce) for reduction in reductions]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        results.append([[p.grad.clone() for p in model.parameters()] for model in models])
        for model in models:
            model.zero_grad(set_to_none=True)
    return results


@pytest.mark.parametrize("accumulation, mixup", [(1, 0), (2, 0), (1, 1.0)])
def test_a_step_s_gradients_are_bitwise_the_same_on_1_2_3_and_6_processes(accumulation, mixup):
    # dropout, and MixUp's draws (ddp_accel.vision.mixing), keyed by each piece's place in the global batch
    reference = step_gradients(1, accumulation, mixup=mixup)
    for processes in (2, 3, 6):
        for step, on_every_process in enumerate(step_gradients(processes, accumulation, mixup=mixup)):
            for rank, grads in enumerate(on_every_process):
                for a, b in zip(reference[step][0], grads, strict=True):
                    assert torch.equal(a, b), (processes, step, rank)


def test_the_gradient_is_the_mean_over_the_global_batch():
    # what a plain backward of the whole global batch gives, within float rounding (dropout off: the same draws)
    exact = step_gradients(2, micro_batch=3, steps=1, dropout=0.0)[0][1]
    model = make_model(dropout=0.0)
    loss_fn(model, data(1, 1)).backward()
    for a, b in zip(exact, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_a_one_process_run_with_complex_weights_trains_as_without_it(tmp_path):
    # the pieces' mean is the batch's mean; a complex parameter's gradient goes through the rows as its real view
    common = [PROBE, "--complex", "--dropout", "0", "--batch-size", "4", "--epochs", "1"]
    if version.parse(importlib.metadata.version("safetensors")) < version.parse("0.7"):  # it cannot write complex64
        assert_clean_error(run_script(*common, "--output-dir", tmp_path), "0.weight is complex64")
        return
    check_ok(run_script(*common, "--output-dir", tmp_path / "plain"))
    output = check_ok(run_script(*common, "--exact-micro-batch", "2", "--output-dir", tmp_path / "exact"))
    assert "gradients                    pieces of 2 samples added in the global batch's order" in output, output[:3000]
    assert_same_weights(tmp_path / "plain", tmp_path / "exact", atol=1e-5)


def test_pieces_cut_tensors_tuples_and_dicts_in_order():
    x, y = torch.arange(10).view(5, 2), torch.arange(5)
    assert [len(piece) for piece in pieces(x, 2)] == [2, 2, 1]
    first, second, last = pieces({"x": x, "y": (y, y * 2)}, 2)
    assert torch.equal(second["x"], x[2:4]) and torch.equal(last["y"][1], y[4:] * 2)
    with pytest.raises(UserError, match="this loader gives str"):
        pieces("text", 2)
    with pytest.raises(UserError, match="different numbers of samples"):
        pieces((x, torch.arange(3)), 2)


def test_runs_whose_gradients_cannot_be_exact_are_refused():
    batch_norm = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    plain = type("Plain", (), {"distributed_type": "MULTI_CPU", "scaler": None})()
    assert "1 (BatchNorm1d) keeps running statistics" in refusal(plain, batch_norm, 2)
    assert refusal(plain, torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3)), 2) is None
    fp16 = type("Fp16", (), {"distributed_type": "MULTI_CPU", "scaler": object()})()
    assert "fp16's loss scale" in refusal(fp16, torch.nn.Linear(3, 3), 2)


def test_options_that_contradict_it_are_refused(tmp_path):
    uneven = run_script(PROBE, "--output-dir", tmp_path / "a", "--batch-size", "4", "--exact-micro-batch", "3")
    assert_clean_error(uneven, "--exact-micro-batch 3: --batch-size 4 is not a whole number of pieces of 3")
    hooked = run_script(PROBE, "--output-dir", tmp_path / "b", "--exact-micro-batch", "2", "--ddp-comm-hook", "bf16")
    assert_clean_error(hooked, "--exact-micro-batch 2 adds the gradients itself: not with --ddp-comm-hook")
    norm = run_script(PROBE, "--output-dir", tmp_path / "c", "--exact-micro-batch", "2", "--batchnorm")
    assert_clean_error(norm, "keeps running statistics")


def test_imagenet_s_norm_group_puts_group_norm_in_place_of_every_batch_norm_so_exact_runs(tmp_path):
    import torchvision

    from ddp_accel.vision import build_model, with_group_norm

    for model in (torchvision.models.resnet18(num_classes=10), build_model("cifar_resnet20", 10)):
        batch_norms = sum(isinstance(module, torch.nn.BatchNorm2d) for module in model.modules())
        model, changed = with_group_norm(model)
        assert changed == batch_norms > 0
        assert not any(isinstance(module, torch.nn.modules.batchnorm._BatchNorm) for module in model.modules())
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    job = ["--dummy", "-a", "cifar_resnet20", "--image-size", "32", "-b", "8", "-j", "0", "--dummy-classes", "10"]
    job += ["--max-steps", "2", "--exact-micro-batch", "4"]
    refused = run_script("scripts/imagenet.py", *job, "--output-dir", tmp_path / "batch")
    assert_clean_error(refused, "(BatchNorm2d) keeps running statistics")
    check_ok(run_script("scripts/imagenet.py", *job, "--norm", "group", "--output-dir", tmp_path / "group"))

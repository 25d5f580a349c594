"""`--time-budget`: as many epochs as fit in the command's wall-clock time, chosen once, at the start.

The learning-rate schedule, the progress bar and the checks of a resume all read the run's length from its first
step, so the length is settled before it: a few training batches and evaluation batches are timed on the prepared
model, optimizer and loaders (`measure_costs`), everything they changed is put back (weights, buffers, the
optimizer's state, the random generators, Accelerate's step count), and `plan_epochs` counts the epochs whose
training, evaluations and test fit in what is left of the budget. Every rank takes the slowest rank's figures.
The plan is part of the training state: a resume keeps it (a preempted run ends as the uninterrupted one would),
and so does a rerun of a complete run.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
import torch.distributed as dist
from accelerate.utils import DistributedType

from ddp_accel import loaders
from ddp_accel.batch_size import buffers_and_generators_kept, distributed
from ddp_accel.callbacks import Callback
from ddp_accel.config import format_duration
from ddp_accel.context import RunContext
from ddp_accel.errors import UserError

WARM_BATCHES = 2  # compilation, allocator and kernel caches: not timed
TIMED_BATCHES = 5
EVAL_TIMED_BATCHES = 4
# an epoch's bookkeeping, not timed: its evaluation's history.json rewrite and log line, a best model's file, the
# loader's start (about 10 ms an epoch on a small CPU)
BOOKKEEPING_S = 0.015
FIXED_RESERVE_S = 5.0  # of a plan's reserve, beside 3% of the budget: the checkpoints, the final files, the exit

_command_started: float | None = None  # time.time() when this command began (run_main); None: fit's own start
COMMAND_START_VARIABLE = "DDP_ACCEL_COMMAND_START"  # a launcher's own start (time.time()), for workers it reuses


def note_command_start(started_as_script: bool | None) -> None:
    """run_main: a script started as `python script.py` (or by a launcher) counts from its process's start, its
    imports included; one run in a longer-lived process from the launcher's start where it says so (Ray's
    workers: DDP_ACCEL_COMMAND_START), else from now (a test, a notebook). None: the command ended (a fit()
    called later counts from its own start)."""
    global _command_started
    given = os.environ.get(COMMAND_START_VARIABLE)
    if started_as_script is None:
        _command_started = None
    elif given:
        _command_started = float(given)
    else:
        _command_started = psutil.Process().create_time() if started_as_script else time.time()


def command_started(default: float) -> float:
    return _command_started if _command_started is not None else default


@dataclass
class Costs:
    """Seconds, the slowest rank's: a training micro-batch and an evaluation batch in steady state, and what the
    first batch of a pass costs beyond them (its workers starting, its first batch loading)."""

    train_batch_s: float
    train_start_s: float
    eval_batch_s: float = 0.0
    eval_start_s: float = 0.0
    spent_s: float = 0.0  # of the budget, when the measurement ended


@dataclass
class BudgetPlan:
    """What --time-budget chose, kept in the training state and metrics.json."""

    budget_s: float
    epochs: int
    max_epochs: int
    estimated_s: float  # the whole command as planned, the reserve not included
    epoch_s: float  # an epoch's training
    evaluation_s: float  # one evaluation (raw and EMA weights)
    reserve_s: float = 0.0  # for the checkpoints, the final files and the exit
    test_s: float = 0.0  # the test set's evaluation at the end

    def describe(self) -> str:
        return (
            f"{format_duration(self.budget_s)}: {epochs_text(self.epochs)} of {self.max_epochs} fit (an epoch "
            f"{format_duration(self.epoch_s)}, an evaluation {format_duration(self.evaluation_s)}; the command "
            f"about {format_duration(self.estimated_s)}, and {format_duration(self.reserve_s)} in reserve)"
        )

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> BudgetPlan:
        return cls(**{key: state[key] for key in cls.__dataclass_fields__ if key in state})


def epochs_text(count: int) -> str:
    return f"{count} epoch" + ("" if count == 1 else "s")


@dataclass
class RunShape:
    """What the plan counts per epoch: batches (micro-batches) and optimizer steps, the evaluations (how many
    batches, how often, and how many weights each evaluates: 2 with the EMA's), the test at the end, and the most
    epochs the command allows."""

    batches_per_epoch: int
    max_epochs: int
    eval_batches: int = 0
    evaluations_per_eval: int = 1
    eval_every_epochs: int = 1
    eval_every_steps: int | None = None
    steps_per_epoch: int = 1
    test_batches: int = 0


def plan_epochs(budget_s: float, costs: Costs, shape: RunShape) -> BudgetPlan:
    """The most epochs (at most `shape.max_epochs`) whose training, evaluations and test end within `budget_s`,
    `costs.spent_s` of it gone; a reserve of 3% (and 5 s) covers the checkpoints, the final files and the exit,
    and BOOKKEEPING_S an epoch what the timed batches leave out."""
    epoch_s = costs.train_start_s + shape.batches_per_epoch * costs.train_batch_s
    evaluation_s = (costs.eval_start_s + shape.eval_batches * costs.eval_batch_s) * shape.evaluations_per_eval
    test_s = costs.eval_start_s + shape.test_batches * costs.eval_batch_s if shape.test_batches else 0.0
    reserve_s = 0.03 * budget_s + FIXED_RESERVE_S

    def command_s(count: int) -> float:
        evaluations = 0
        if shape.eval_batches:
            evaluations = math.ceil(count / shape.eval_every_epochs)  # the last epoch is always evaluated
            if shape.eval_every_steps:
                evaluations += count * shape.steps_per_epoch // shape.eval_every_steps
        return costs.spent_s + count * (epoch_s + BOOKKEEPING_S) + evaluations * evaluation_s + test_s

    count = 0
    while count < shape.max_epochs and command_s(count + 1) + reserve_s <= budget_s:
        count += 1
    estimated_s = command_s(max(count, 1))
    return BudgetPlan(budget_s, count, shape.max_epochs, estimated_s, epoch_s, evaluation_s, reserve_s, test_s)


@contextlib.contextmanager
def leaves_no_trace(accelerator: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Training steps inside change nothing the run goes on from: the weights and buffers (this rank's, also a
    shard's), the optimizer's state, the gradient scaler, Accelerate's micro-batch count and every random
    generator come back as they were."""
    parameters = list(model.parameters())
    saved_parameters = [parameter.detach().clone() for parameter in parameters]
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    scaler = accelerator.scaler
    saved_scaler = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
    saved_step = accelerator.step
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with buffers_and_generators_kept(model):
        try:
            yield
        finally:
            for parameter in parameters:  # not optimizer.zero_grad: Accelerate's skips it inside an accumulation group
                parameter.grad = None
            with torch.no_grad():
                for parameter, saved in zip(parameters, saved_parameters, strict=True):
                    parameter.copy_(saved)
            optimizer.load_state_dict(saved_optimizer)
            if scaler is not None:
                scaler.load_state_dict(saved_scaler)
            accelerator.step = saved_step
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def time_batches(loader: Any, work: Callable[[Any], Any], warm: int, timed: int, device: torch.device) -> Costs:
    """Two passes over the first batches of `loader`: `warm` batches (one-off costs: compilation, caches), then
    a fresh pass whose first batch gives the cost of starting a pass, and `timed` more the steady cost of one."""

    def one_pass(count: int) -> list[float]:
        marks = [time.perf_counter()]
        with loaders.batches(loader) as batches:
            for batch in batches:
                work(batch)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                marks.append(time.perf_counter())
                if len(marks) > count:
                    break
        return marks

    one_pass(warm)
    marks = one_pass(1 + timed)
    if len(marks) < 3:  # a loader of one batch: that batch is the whole pass
        return Costs(marks[-1] - marks[0], 0.0)
    intervals = sorted(later - earlier for earlier, later in zip(marks[1:], marks[2:], strict=False))
    if len(intervals) >= 4:  # one slow batch (a recompile for a last, smaller batch) is not the steady cost
        intervals = intervals[:-1]
    batch_s = sum(intervals) / len(intervals)
    return Costs(batch_s, max(0.0, marks[1] - marks[0] - batch_s))


@dataclass
class Timing:
    """What --time-budget times, before the first step: the prepared model, optimizer and loaders, a training
    micro-batch (`train_batch`: the loop's step, on a probe of its own), the evaluation function, the gradient
    accumulation, and when the command started (time.time())."""

    accelerator: Any
    train_batch: Callable[[Any], Any]
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    train_loader: Any
    eval_fn: Callable[[torch.nn.Module, Any], Any] | None
    eval_loader: Any
    accumulation: int
    started: float


def measure_costs(timing: Timing) -> Costs:
    """Costs on this rank, then the slowest rank's on every rank (the same plan everywhere). Whole accumulation
    groups are timed, so that the probe ends where an optimizer step ends."""
    accumulation, model, eval_fn, eval_loader = timing.accumulation, timing.model, timing.eval_fn, timing.eval_loader
    whole = lambda count: accumulation * math.ceil(count / accumulation)  # noqa: E731
    device = timing.accelerator.device
    with leaves_no_trace(timing.accelerator, model, timing.optimizer):  # each pass whole accumulation groups
        costs = time_batches(
            timing.train_loader, timing.train_batch, whole(WARM_BATCHES), whole(1 + TIMED_BATCHES) - 1, device
        )
    if eval_loader is not None and eval_fn is not None:
        model.eval()
        with torch.no_grad():
            evaluation = time_batches(eval_loader, lambda batch: eval_fn(model, batch), 1, EVAL_TIMED_BATCHES, device)
        model.train()
        costs.eval_batch_s, costs.eval_start_s = evaluation.train_batch_s, evaluation.train_start_s
    costs.spent_s = time.time() - timing.started
    if distributed():
        figures = torch.tensor(list(asdict(costs).values()), dtype=torch.float64, device=device)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        costs = Costs(*figures.tolist())
    return costs


def plan_run(
    config: Any, kept: BudgetPlan | None, trained_without: Path | None, timing: Timing, shape: RunShape
) -> tuple[BudgetPlan, bool]:
    """--time-budget's plan: the run's own (`kept`: a resume, or a rerun of the complete run), still at most
    --epochs, else a new one from batches timed here. Returns (plan, kept?)."""
    assert config.time_budget
    if kept is not None:
        if abs(kept.budget_s - config.time_budget) > 0.5:
            raise UserError(
                f"--time-budget {format_duration(config.time_budget)}: the run was planned for "
                f"{format_duration(kept.budget_s)} ({epochs_text(kept.epochs)}), and a resume keeps its plan: give "
                f"--time-budget {kept.budget_s:g}s, or --epochs without --time-budget to change its length"
            )
        return dataclasses.replace(kept, epochs=min(kept.epochs, config.epochs)), True
    if trained_without is not None:
        raise UserError(
            f"--time-budget plans a run from its start, and {trained_without} was trained without one: resume "
            "without --time-budget (--epochs decides), or start a new run"
        )
    accelerator = timing.accelerator
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise UserError("--time-budget times steps on whole weights: not with FSDP or DeepSpeed (give --epochs)")
    accelerator.print(f"--time-budget {format_duration(config.time_budget)}: timing a few batches ...")
    costs = measure_costs(timing)
    plan = plan_epochs(config.time_budget, costs, shape)
    check_plan(plan, costs.spent_s, config)
    return plan, False


class BudgetGuard(Callback):
    """The budget kept when the machine slows down after the plan (a loaded node): at each epoch's end, when the
    next epoch at the slower of the planned and the last epoch's pace would end past the budget (less half its
    reserve),
    training ends there (evaluated, tested, committed: `end_reason` says so). The ranks agree (the slowest rank's
    view), so every rank ends at the same epoch; the decision is in the training state, so a resume of that
    checkpoint ends too. A resumed run is guarded too, against what its earlier commands left of the budget (the
    training state carries the time spent, `budget_spent_s`): the run's commands in all end within the budget plus
    at most one epoch at the pace they ran. An epoch far slower than the plan's (the batches timed at the start
    misled it) is said once."""

    MISLED = 10.0  # an epoch this many times the planned one: the plan's measurement was wrong

    def __init__(self, plan: BudgetPlan, started: float):
        self.plan, self.started = plan, started
        self.epoch_began = time.time()
        self.spent_before = 0.0  # by the run's earlier commands (a resume's checkpoint says)
        self.said_misled = False

    def on_start(self, run: RunContext) -> None:
        self.epoch_began = time.time()
        self.spent_before = run.state.budget_spent_s

    def on_step_end(self, run: RunContext) -> None:
        run.state.budget_spent_s = self.spent_before + time.time() - self.started  # (saved with the step)

    def on_epoch_end(self, run: RunContext) -> None:
        plan, now, state = self.plan, time.time(), run.state
        epoch_s, self.epoch_began = now - self.epoch_began, now
        state.budget_spent_s = self.spent_before + now - self.started
        if epoch_s > self.MISLED * (plan.epoch_s + plan.evaluation_s) and not self.said_misled:
            self.said_misled = True
            run.accelerator.print(
                f"warning: --time-budget {format_duration(plan.budget_s)}: an epoch took {format_duration(epoch_s)}, "
                f"planned {format_duration(plan.epoch_s)} from the batches timed at the start; the budget still "
                "holds: training ends at the epoch the next would pass it"
            )
        if state.epoch >= plan.epochs or state.ended:
            return
        pace_s = max(epoch_s, plan.epoch_s + plan.evaluation_s)
        projected_s = state.budget_spent_s + pace_s + plan.test_s
        # half the reserve absorbs the plan pace's noise; the rest is the final files' and the exit's
        late = torch.tensor(float(projected_s > plan.budget_s - plan.reserve_s / 2), device=run.accelerator.device)
        if distributed():
            dist.all_reduce(late, op=dist.ReduceOp.MAX)
        if not late.item():
            return
        state.out_of_time = True
        run.accelerator.print(
            f"warning: --time-budget {format_duration(plan.budget_s)}: an epoch now takes {format_duration(epoch_s)} "
            f"(planned {format_duration(plan.epoch_s)}): the next would end past the budget, so training ends after "
            f"{epochs_text(state.epoch)} of the {plan.epochs} planned"
        )


def budget_line(plan: BudgetPlan, command_s: float, resumed: bool) -> str:
    """The command's time against its --time-budget, a warning when over it."""
    took, budget = format_duration(command_s), format_duration(plan.budget_s)
    if resumed:
        return f"time budget: this command, a resume of a run planned for {budget}, took {took}"
    planned = f"planned {format_duration(plan.estimated_s)}, with {format_duration(plan.reserve_s)} in reserve"
    if command_s <= plan.budget_s:
        return f"time budget: the command took {took} of its --time-budget {budget} ({planned})"
    return (
        f"warning: the command took {took}, over its --time-budget {budget} ({planned}): this machine ran slower "
        "than in the batches timed at the start"
    )


def check_plan(plan: BudgetPlan, spent_s: float, config: Any) -> None:
    """One line when the budget cannot hold the run, or cuts it where the schedule needs more epochs."""
    budget, schedule, fit = format_duration(plan.budget_s), config.lr_schedule, epochs_text(plan.epochs)
    if plan.epochs == 0:
        raise UserError(
            f"--time-budget {budget}: not even one epoch fits on this machine (an epoch's training takes about "
            f"{format_duration(plan.epoch_s)}, an evaluation {format_duration(plan.evaluation_s)}; "
            f"{format_duration(spent_s)} went before the first step, and {format_duration(plan.reserve_s)} are "
            "kept for the checkpoints, the final files and the exit): give a larger budget"
        )
    if schedule and config.warmup_epochs >= plan.epochs:
        raise UserError(
            f"--time-budget {budget} leaves {fit} here, within --warmup-epochs {config.warmup_epochs:g}: a larger "
            "budget, or a shorter warm-up"
        )
    late = [milestone for milestone in config.lr_milestones or [] if milestone >= plan.epochs]
    if schedule == "multistep" and late:
        raise UserError(
            f"--time-budget {budget} leaves {fit} here: --lr-milestones {' '.join(map(str, late))} would never "
            "come (a larger budget, or earlier milestones)"
        )
    if schedule == "step" and config.lr_step_epochs >= plan.epochs:
        raise UserError(
            f"--time-budget {budget} leaves {fit} here: the first decay of --lr-schedule step (every "
            f"--lr-step-epochs {config.lr_step_epochs}) would never come (a larger budget, a smaller "
            "--lr-step-epochs, or --lr-schedule cosine, which follows the run's length)"
        )

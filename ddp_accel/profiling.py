"""A profiler window (`--profile-steps START:END`): torch.profiler records optimizer steps START+1..END on the main
process, writes a Chrome/Perfetto trace (OUTPUT_DIR/profile/trace_rank0.json, also readable by TensorBoard's
profiler plugin) and prints the operators that took the most time. Off by default: no callback, no cost."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ddp_accel.callbacks import Callback

if TYPE_CHECKING:
    from ddp_accel.context import RunContext


class ProfilerWindow(Callback):
    """Records the optimizer steps after `start` up to `end` (counted as the run counts them)."""

    def __init__(self, start: int, end: int, top: int = 15):
        self.start, self.end, self.top = start, end, top
        self.profiler: torch.profiler.profile | None = None

    def check(self, total_steps: int, chosen_by: str = "") -> None:
        """Before the run touches its output dir (--overwrite-output-dir deletes only once every check passed).
        `chosen_by`: what set the run's length, when not --epochs or --max-steps (--time-budget's plan)."""
        if self.end > total_steps:
            from ddp_accel.errors import UserError

            raise UserError(
                f"--profile-steps {self.start}:{self.end} ends past this run's {total_steps} steps{chosen_by}; "
                "choose a window inside it"
            )

    def on_start(self, run: RunContext) -> None:
        if run.state.step >= self.start:  # a resume past the window's start: nothing to record
            self.start = self.end = -1
        elif self.start == 0:
            self._begin(run)

    def on_step_end(self, run: RunContext) -> None:
        step = run.state.step
        if step == self.start:
            self._begin(run)
        elif step == self.end and self.profiler is not None:
            self._finish(run)

    def on_close(self, run: RunContext) -> None:
        if self.profiler is not None:  # the run ended or stopped inside the window: nothing written
            self.profiler.__exit__(None, None, None)
            self.profiler = None

    def _begin(self, run: RunContext) -> None:
        if not run.accelerator.is_main_process:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=False)
        self.profiler.__enter__()

    def _finish(self, run: RunContext) -> None:
        profiler, self.profiler = self.profiler, None
        assert profiler is not None
        profiler.__exit__(None, None, None)
        folder = Path(run.folder.path) / "profile"
        folder.mkdir(parents=True, exist_ok=True)
        trace = folder / f"trace_rank{run.accelerator.process_index}.json"
        profiler.export_chrome_trace(str(trace))
        sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=self.top)
        (folder / "top_operators.txt").write_text(table)
        print(
            f"profile of steps {self.start + 1}..{self.end} (rank {run.accelerator.process_index}): {trace} "
            f"(chrome://tracing, ui.perfetto.dev)\n{table}",
            flush=True,
        )

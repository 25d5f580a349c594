"""Goodput projected to scale: a first-order model of the time a data-parallel job loses to failures, fed with the
costs measured here (benchmarks/goodput.py) and a published failure rate.

    python benchmarks/goodput_model.py
    python benchmarks/goodput_model.py --save-s 120 --async-stall-s 4 --restart-s 600 --gpus 1024 8192 16384

The model (Young 1974, Daly 2006, first order): a job of N GPUs fails every M = 1 / (N x rate) hours. Between
checkpoints, every tau seconds of training, a save stalls training C seconds. A failure costs the restart R and the
work since the last checkpoint, tau / 2 on average; a failure a survivor's save covers (a share `covered` of them,
where every rank holds the whole state: DDP) costs R and that save (a synchronous one, S) instead, no work. Per
second of useful training the job then spends C / tau + (1 - covered) (tau / 2 + R) / M + covered (R + S) / M
more; goodput = 1 / (1 + that), at the tau that minimises it. Recovered in process (`ddp-accel launch
--recover in-process`), a covered failure costs the survivors' copy of the step into memory (C: they go on from
it while it is written in the background) and their regroup I, instead of S and R: the processes, their imports
and their memory stay (measured here: the kill to the next step 0.14x of the restart's). Assumptions: failures
independent and memoryless, each GPU alike, one failure at a time, no failure during a restart; planned
interruptions (with grace: a stop saves the step reached) left out.

Published rate: Meta's Llama 3 405B pre-training, 54 days on 16,384 H100 GPUs: 466 interruptions, 419 of them
unexpected, about 78% of those hardware (GPUs, their memory, hosts), The Llama 3 Herd of Models, 2024, section 3.3.4.
"""

from __future__ import annotations

import argparse

LLAMA3_UNEXPECTED = 419
LLAMA3_GPU_HOURS = 54 * 24 * 16_384
RATE_PER_GPU_HOUR = LLAMA3_UNEXPECTED / LLAMA3_GPU_HOURS
# the kill to the next step, recovered in process against restarted (resnet20-exact-3, 2 pairs: 0.7 s against 5.0 s)
IN_PROCESS_RATIO = 0.7 / 5.0


def overhead(tau_s: float, stall_s: float, covered_s: float, restart_s: float, mtbf_s: float, covered: float) -> float:
    """Seconds lost per second of useful training at an interval of tau_s (`stall_s`: a periodic save's stall;
    `covered_s`: what a failure a survivor's save covers costs: that save, and the restart or the regroup)."""
    uncovered = (1 - covered) * (tau_s / 2 + restart_s) / mtbf_s
    return stall_s / tau_s + uncovered + covered * covered_s / mtbf_s


def best(stall_s: float, covered_s: float, restart_s: float, mtbf_s: float, covered: float) -> tuple[float, float]:
    """(interval, goodput) at the interval that loses least (a search over a log grid, 1 s to 10^7 s)."""
    grid = [10 ** (exponent / 200) for exponent in range(0, 1401)]
    tau = min(grid, key=lambda tau: overhead(tau, stall_s, covered_s, restart_s, mtbf_s, covered))
    return tau, 1 / (1 + overhead(tau, stall_s, covered_s, restart_s, mtbf_s, covered))


def duration(seconds: float) -> str:
    return (
        f"{seconds / 3600:.1f} h"
        if seconds >= 5400
        else f"{seconds / 60:.0f} min"
        if seconds >= 90
        else f"{seconds:.0f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", nargs="+", type=int, default=[1024, 8192, 16_384])
    parser.add_argument("--rate", type=float, default=RATE_PER_GPU_HOUR, help="failures per GPU-hour")
    parser.add_argument("--save-s", type=float, required=True, help="a synchronous save's stall (s)")
    parser.add_argument("--async-stall-s", type=float, required=True, help="an asynchronous save's stall (s)")
    parser.add_argument("--restart-s", type=float, required=True, help="a failure to the next step (s)")
    parser.add_argument("--covered", type=float, default=0.78, help="the share of failures a survivor's save covers")
    parser.add_argument(
        "--in-process-s",
        type=float,
        help="a covered failure to the next step when the survivors keep their processes (s; default: the restart "
        f"x {IN_PROCESS_RATIO:.2f}, the ratio measured by benchmarks/goodput.py --recovery restart in-process)",
    )
    args = parser.parse_args()
    in_process_s = args.in_process_s if args.in_process_s is not None else args.restart_s * IN_PROCESS_RATIO
    strategies = {  # a periodic save's stall, a covered failure's cost, the share covered
        "checkpoint-restart": (args.save_s, 0.0, 0.0),
        "async checkpoints": (args.async_stall_s, 0.0, 0.0),
        "just-in-time + async": (args.async_stall_s, args.restart_s + args.save_s, args.covered),
        # the survivors copy the step into memory (an asynchronous save's stall) and go on; it is written meanwhile
        "in-process + async": (args.async_stall_s, in_process_s + args.async_stall_s, args.covered),
    }
    print(
        f"costs: synchronous save {args.save_s:g} s, asynchronous stall {args.async_stall_s:g} s, restart "
        f"{args.restart_s:g} s, regroup in process {in_process_s:g} s; {args.rate:.3g} failures per GPU-hour; a "
        f"survivor's save covers {args.covered:.0%}\n"
    )
    print("| GPUs | time between failures | " + " | ".join(f"{name}: goodput (interval)" for name in strategies) + " |")
    print("|---|---|" + "---|" * len(strategies))
    for gpus in args.gpus:
        mtbf_s = 3600 / (gpus * args.rate)
        cells = []
        for stall_s, covered_s, covered in strategies.values():
            tau, goodput = best(stall_s, covered_s, args.restart_s, mtbf_s, covered)
            cells.append(f"{goodput:.3f} ({duration(tau)})")
        print(f"| {gpus:,} | {duration(mtbf_s)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

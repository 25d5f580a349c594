"""`ddp-accel ray SCRIPT [ARGS...]`: run one of the training scripts, unchanged, on a Ray cluster with Ray Train.

    ddp-accel ray --workers 2 scripts/template.py --output-dir runs/ray --epochs 3
    ray job submit --working-dir . -- ddp-accel ray --workers 4 --gpus-per-worker 1 scripts/imagenet.py ...

The driver (this process) first runs the script itself up to its Accelerator (launch_environments.CheckOnly): a bad
option, path or --output-dir is one `error:` line there, exit 2, before any worker starts. Then Ray Train starts the
workers; each runs the script as `__main__` with the same arguments, and the script makes its process group itself
(Ray's backend only gives each worker the torch launcher variables), so `--timeout-s` applies as under torchrun.

The script's outcome comes back typed (launch_environments.last_outcome: run_main records it), not read from the output
dir.

- Restarts resume: `--resume-from-checkpoint latest` is added unless the command names a checkpoint; a group
  restarted after a failure (a killed worker, a lost node) continues from the newest complete checkpoint.
- A user error (exit 2 of the script: an identity mismatch, bad data found late) ends the run with its line; it is
  never retried (`UserErrorsAreFinal`). Other failures are retried up to `--max-failures` times.
- Our checkpoints stay in place: Ray's storage is OUTPUT_DIR's parent, the run's name OUTPUT_DIR's, and the newest
  checkpoint is reported to Ray once, at the end, without a copy (`result.checkpoint`, `result.metrics` are ours).
  Ray keeps every checkpoint it is given (no `num_to_keep`): it deletes nothing of ours.

Ray Train runs the training function in a thread of each worker process, where signal handlers cannot be
installed: a SIGTERM to a worker ends it (Ray's own handler) and the group restarts from the newest checkpoint.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddp_accel import launch_environments
from ddp_accel.accelerate_config import worker_environment
from ddp_accel.cli import ArgumentParser
from ddp_accel.errors import UserError

USER_ERROR_EXIT_CODE = 2


@dataclass
class RayJob:
    """What `ddp-accel ray` runs: the script, its arguments, and the workers Ray gives it."""

    script: str
    script_args: list[str] = field(default_factory=list)
    workers: int = 2
    min_workers: int | None = None  # an elastic group: between min_workers and workers
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    address: str | None = None  # None: RAY_ADDRESS, else a new local Ray instance
    max_failures: int = 3
    start_timeout_s: float = 120.0  # a group that finds no room for its workers this long is one failed start
    resize_check_s: float = 60.0  # an elastic group: how often Ray looks for room to grow (Ray's default)
    cwd: str = field(default_factory=os.getcwd)
    config_file: str | None = None  # an accelerate config: its precision and strategy (FSDP) reach every worker

    def environment(self) -> dict[str, str]:
        """The variables each worker (and the driver's check) runs the script with."""
        return worker_environment(self.config_file) if self.config_file else {}

    def check(self) -> None:
        """What Ray would reject later, or never: one line each, before anything starts."""
        if importlib.util.find_spec("ray") is None:  # not imported: a wrong option's line comes without Ray's import
            raise UserError("Ray is not installed here: pip install -e '.[ray]'")
        if self.workers < 1:
            raise UserError(f"--workers must be at least 1, not {self.workers}")
        if self.min_workers is not None and not 1 <= self.min_workers <= self.workers:
            raise UserError(f"--min-workers must be between 1 and --workers ({self.workers}), not {self.min_workers}")
        if self.cpus_per_worker <= 0 or self.gpus_per_worker < 0:
            raise UserError("--cpus-per-worker must be above 0 and --gpus-per-worker at least 0")
        if self.start_timeout_s <= 0:
            raise UserError(f"--start-timeout-s must be above 0, not {self.start_timeout_s}")
        if self.resize_check_s <= 0:
            raise UserError(f"--resize-check-s must be above 0, not {self.resize_check_s}")
        if self.max_failures < 0:
            raise UserError(f"--max-failures must be at least 0, not {self.max_failures}: endless retries hide a fault")
        if not Path(self.script).is_file():
            raise UserError(f"{self.script}: no such script")
        self.environment()  # a config that cannot be launched is one line here

    def resources(self) -> dict[str, float]:
        """Each worker's: its CPUs, and GPUs when asked."""
        return {"CPU": self.cpus_per_worker} | ({"GPU": self.gpus_per_worker} if self.gpus_per_worker else {})

    def command(self) -> list[str]:
        """The script's arguments as each worker runs them: restarts resume from the newest checkpoint."""
        named = any(
            arg.split("=")[0] in ("--resume-from-checkpoint", "--resume_from_checkpoint") for arg in self.script_args
        )
        return list(self.script_args) + ([] if named else ["--resume-from-checkpoint", "latest"])


class ScriptUserError(RuntimeError):
    """The script ended with a user error (exit 2) in a worker: final, not retried."""


def check_in_driver(job: RayJob) -> Path | int:
    """Run the script in this process up to its Accelerator: options, --output-dir and trackers are checked as the
    workers will check them. Returns the output dir, or the script's exit status once it printed its error line."""
    from ddp_accel.runtime import OptionsChecked
    from ddp_accel.stopping import PREEMPTION_SIGNALS, StopSignals

    script = Path(job.script)
    argv, path = sys.argv, list(sys.path)
    handlers = {signum: signal.getsignal(signum) for signum in PREEMPTION_SIGNALS}  # the script's guard takes them
    sys.argv = [str(script), *job.command()]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        with launch_environments.use(launch_environments.CheckOnly()):
            runpy.run_path(str(script), run_name="__main__")
    except OptionsChecked as checked:
        return Path(checked.config.output_dir).resolve()
    except SystemExit as exit:  # an argparse error, run_main's one line for a user error, or --help: nothing to run
        return exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
    finally:
        sys.argv, sys.path[:] = argv, path
        if StopSignals.current is not None:  # run_main's, left installed by the early return
            StopSignals.current.uninstall()
        for signum, handler in handlers.items():  # the driver's own, not the guard the script installed
            if handler is not None:
                signal.signal(signum, handler)
    raise UserError(f"{job.script} does not make its Accelerator with ddp_accel.make_accelerator: it cannot be checked")


def train_worker(spec: dict[str, Any]) -> None:
    """Ray Train's function in each worker: the script as `__main__`, its exit status turned into Ray's terms."""
    import builtins

    import ray.train
    from ray.train.v2._internal.logging import patch_print

    from ddp_accel.budget import COMMAND_START_VARIABLE

    builtins.print = patch_print._original_print  # Ray Train logs each print, and tees it: every line came twice

    context = ray.train.get_context()
    rank, size = context.get_world_rank(), context.get_world_size()
    if Path(spec["cwd"]).is_dir():  # a cluster whose nodes share the driver's folder; otherwise Ray's working_dir
        os.chdir(spec["cwd"])
    nodes = _nodes_of_the_group()
    if isinstance(nodes, int):  # the banner's num_nodes (torchrun's NNODES)
        os.environ["NNODES"] = str(nodes)
    sys.argv = [spec["script"], *spec["command"]]
    sys.path.insert(0, str(Path(spec["script"]).resolve().parent))
    os.environ.update(spec["environment"])  # --config-file's precision and strategy, as accelerate launch gives them
    os.environ[COMMAND_START_VARIABLE] = str(spec["started"])  # --time-budget counts from the driver's start
    watching = threading.Event()
    threading.Thread(target=_watch_preemption_notice, args=(rank, watching), daemon=True).start()
    _training_ended.clear()
    launch_environments.forget_outcome()  # (a worker process may have run an earlier attempt)
    code: Any = 0
    try:
        with launch_environments.use(launch_environments.RayWorker(dict(os.environ), workers=size, nodes=nodes)):
            runpy.run_path(spec["script"], run_name="__main__")
    except SystemExit as exit:
        code = exit.code
    finally:
        watching.set()
        _training_ended.set()
    _report_outcome(rank, code, launch_environments.last_outcome(), Path(spec["output_dir"]))


def _report_outcome(rank: int, code: Any, outcome: launch_environments.Outcome | None, output_dir: Path) -> None:
    """The script's outcome in Ray's terms: its metrics reported, or an error Ray's failure policy decides on (a
    user error ends the run; a stop that saved, or a crash, restarts the group, which resumes)."""
    message = outcome.message if outcome is not None else None
    if code == USER_ERROR_EXIT_CODE:
        raise ScriptUserError(message or f"rank {rank}: the script ended with a user error (exit 2)")
    if code not in (0, None):
        raise RuntimeError(f"rank {rank}: the script exited with status {code}" + (f": {message}" if message else ""))
    if outcome is not None and outcome.kind == "preempted" and outcome.stop is not None:  # saved at an agreed step
        raise RuntimeError(
            f"rank {rank}: stopped by {outcome.stop.get('signal')} in phase {outcome.stop.get('phase')} and saved; "
            "the group restarts and resumes from the saved step"
        )
    if outcome is None or outcome.metrics is None:
        raise RuntimeError(f"rank {rank}: the script stopped before the end of training ({output_dir} has no metrics)")
    _report_to_ray(output_dir, outcome.metrics)


def _watch_preemption_notice(rank: int, done: threading.Event) -> None:
    """Ray's notice that a node of the group is drained for preemption (its PreemptionWatcher marks each worker,
    a local read; `ray.train.get_preemption_info` would be a barrier of every rank at every step): the script
    stops as on SIGTERM, so every rank saves the step they agree on before the node goes."""
    from ray.train.v2._internal.execution.context import get_train_context

    from ddp_accel.stopping import request_stop

    context = get_train_context()
    while not done.wait(0.2):
        info = context.preemption_context.preemption_info
        if info is not None:
            left = f"{max(0.0, info.deadline_ms / 1000 - time.time()):.0f} s" if info.deadline_ms else "no deadline"
            print(
                f"ray: rank {rank}: node preemption notice for ranks {sorted(info.preempted_ranks)} ({left} before "
                "the node goes): saving at an agreed step",
                file=sys.stderr,
                flush=True,
            )
            request_stop(signal.SIGTERM)
            return


_training_ended = threading.Event()  # in a worker: its script has returned (saved at a stop, or done)
RESIZE_SAVE_TIMEOUT_S = 600.0


def _stop_and_wait(old_size: int, new_size: int, timeout_s: float) -> bool:
    """In a worker, on the actor's main thread while the script trains in its own: stop as on SIGTERM (the ranks
    agree on a step and save it), and wait for the script to end."""
    from ddp_accel.stopping import request_stop

    if _training_ended.is_set():
        return True
    print(f"ray: the group is resized from {old_size} to {new_size} workers: saving at an agreed step", flush=True)
    request_stop(signal.SIGTERM)
    return _training_ended.wait(timeout_s)


def _save_before_resize() -> Any:
    """Ray Train resizes a running elastic group (a node joined: room for more workers) by ending its workers and
    starting the group again: without this, the steps since the newest checkpoint would be trained again. Before
    the group ends, every rank saves the step they agree on, and the new group resumes from it."""
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

    class SaveBeforeResize(ControllerCallback, WorkerGroupCallback):
        def __init__(self) -> None:
            self.worker_group: Any = None

        def after_worker_group_start(self, worker_group: Any) -> None:
            self.worker_group = worker_group

        def before_worker_group_shutdown(self, worker_group: Any) -> None:
            self.worker_group = None

        def before_controller_execute_resize_decision(self, resize_decision: Any) -> None:
            group = self.worker_group
            if group is None:  # the first start, or a restart after a failure: nothing is training
                return
            old_size = len(group.get_workers())
            try:
                group.execute(_stop_and_wait, old_size, resize_decision.num_workers, RESIZE_SAVE_TIMEOUT_S)
            except Exception as error:  # a worker gone meanwhile: the new group resumes from the newest checkpoint
                print(f"ray: the save before the resize failed ({_first_line(error)})", file=sys.stderr, flush=True)

    return SaveBeforeResize()


def _nodes_of_the_group() -> int | str:
    """How many nodes the workers' placement group spans (Ray places them as resources allow)."""
    import ray.util

    try:
        group = ray.util.get_current_placement_group()
        return len(set(ray.util.placement_group_table(group)["bundles_to_node_id"].values()))
    except Exception:  # not in a placement group: unknown
        return "?"


def _report_to_ray(output_dir: Path, metrics: dict[str, Any]) -> None:
    """Every rank reports once (a barrier in Ray): our metrics, and our newest checkpoint in place."""
    import ray.train
    from ray.train.v2.api.report_config import CheckpointUploadMode

    from ddp_accel.checkpoint import complete_checkpoints

    checkpoints = complete_checkpoints(output_dir / "checkpoints")
    checkpoint = ray.train.Checkpoint(str(checkpoints[-1])) if checkpoints else None
    flat = {key: value for key, value in metrics.items() if isinstance(value, int | float | str)}
    ray.train.report(flat, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)


def _user_error_of(error: BaseException) -> str | None:
    """The one line of a worker's user error inside Ray's WorkerGroupError, else None."""
    for failure in getattr(error, "worker_failures", {}).values():
        cause = getattr(failure, "cause", failure)
        if isinstance(cause, ScriptUserError) or "ScriptUserError" in str(failure):
            text = str(cause) if isinstance(cause, ScriptUserError) else str(failure)
            lines = [line for line in text.splitlines() if line.startswith("error:")] or [text.splitlines()[-1]]
            return lines[0]
    return None


def _final_failures_policy() -> None:
    """Ray retries every worker error; a user error fails the same way at every retry: raise it at once."""
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision
    from ray.train.v2.api import data_parallel_trainer

    class UserErrorsAreFinal(DefaultFailurePolicy):
        def make_decision(self, training_failed_error: Any) -> FailureDecision:
            if _user_error_of(training_failed_error) is not None:
                return FailureDecision.RAISE
            return super().make_decision(training_failed_error)

    data_parallel_trainer.create_failure_policy = UserErrorsAreFinal  # type: ignore[assignment]


def _backend_config(cpu: bool) -> Any:
    """Ray's torch backend, less its process group: each worker gets MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK
    ... and the script makes the group itself (with its --timeout-s, and our checks of an inherited group)."""
    from ray.train._internal.utils import get_address_and_port
    from ray.train.torch.config import TorchConfig, _set_torch_distributed_env_vars, _TorchBackend

    class VariablesOnlyBackend(_TorchBackend):
        def on_start(self, worker_group: Any, backend_config: Any) -> None:
            address, port = worker_group.execute_single(0, get_address_and_port)

            def set_variables(address: str, port: int) -> None:
                from ddp_accel.stopping import forward_stop_signals

                os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
                _set_torch_distributed_env_vars()
                forward_stop_signals()  # an actor's task runs on the main thread: the script's thread cannot

            worker_group.execute(set_variables, address=address, port=port)

    class ScriptTorchConfig(TorchConfig):
        @property
        def backend_cls(self) -> type:
            return VariablesOnlyBackend

    return ScriptTorchConfig(backend="gloo" if cpu else "nccl")


def wait_for_the_cluster(address: str, timeout_s: float) -> None:
    """A cluster's GCS address (HOST:PORT) must answer within --start-timeout-s: Ray's own connection attempts
    retry until killed, printing only 'Failed to connect to GCS' (and name the host by its IP, not as given)."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():  # 'auto', a Ray Client address: Ray's own business
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=min(5.0, timeout_s)).close()
            return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise UserError(
                    f"nothing answers at {address} (the Ray cluster's head, --address or RAY_ADDRESS) within "
                    f"--start-timeout-s {timeout_s:g} ({error.strerror or type(error).__name__}): start it there "
                    f"(ray start --head --port {port}) or give its address"
                ) from None
        time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))  # a retry a second, none past the deadline


def run(job: RayJob) -> int:
    """Check in the driver, run on Ray, report: 0 when the training completed, 2 for a user error, 1 otherwise."""
    import psutil

    started = psutil.Process().create_time()  # the command's start, for --time-budget in the workers
    output_dir = check_in_driver(job)
    if isinstance(output_dir, int):
        return output_dir
    new_cluster = job.address is None and not os.environ.get("RAY_ADDRESS")
    if not new_cluster:  # before Ray's import: an address where nothing answers is one line at once
        wait_for_the_cluster(job.address or os.environ["RAY_ADDRESS"], job.start_timeout_s)
    import ray
    from ray.train.v2.api.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.torch.torch_trainer import TorchTrainer

    _final_failures_policy()
    os.environ["RAY_CHDIR_TO_TRIAL_DIR"] = "0"  # relative paths of the command stay the driver's
    # read by Ray Train's controller, which runs on the cluster: the job's environment reaches it
    runtime_env = {"env_vars": {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(job.start_timeout_s)}}
    if new_cluster:
        ray.init(include_dashboard=False, runtime_env=runtime_env)
    else:
        ray.init(address=job.address, runtime_env=runtime_env)
    workers: Any = job.workers if job.min_workers is None else (job.min_workers, job.workers)  # Ray 2.60: either
    spec = asdict(job) | {"command": job.command(), "output_dir": str(output_dir), "started": started}
    spec["environment"] = job.environment()
    trainer = TorchTrainer(
        train_worker,
        train_loop_config=spec,
        torch_config=_backend_config(cpu=job.gpus_per_worker == 0),
        scaling_config=ScalingConfig(
            num_workers=workers,
            use_gpu=job.gpus_per_worker > 0,
            resources_per_worker=job.resources(),
            elastic_resize_monitor_interval_s=job.resize_check_s,
        ),
        run_config=RunConfig(
            name=output_dir.name,
            storage_path=str(output_dir.parent),
            # a start that finds no room (a node gone for good) is retried as often as a failure, not forever
            failure_config=FailureConfig(max_failures=job.max_failures, controller_failure_limit=job.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=None),
            callbacks=[_save_before_resize()],
        ),
    )
    started = time.monotonic()
    try:
        result = trainer.fit()
    except Exception as error:
        line = _user_error_of(error)
        if line is not None:
            print(line if line.startswith("error:") else f"error: {line}", file=sys.stderr, flush=True)
            return USER_ERROR_EXIT_CODE
        print(_failure_line(job, output_dir, error), file=sys.stderr, flush=True)
        return 1
    checkpoint = result.checkpoint.path if result.checkpoint else "none (no --checkpointing-steps)"
    print(f"ray: training completed in {time.monotonic() - started:.0f} s; newest checkpoint {checkpoint}", flush=True)
    return 0


def _failure_line(job: RayJob, output_dir: Path, error: BaseException) -> str:
    """What failed, and what is kept: the newest checkpoint, which the same command resumes from."""
    from ddp_accel.checkpoint import complete_checkpoints

    checkpoints = complete_checkpoints(output_dir / "checkpoints")
    kept = (
        f"{checkpoints[-1]} is kept: the same command resumes from it"
        if checkpoints
        else "no checkpoint was saved (--checkpointing-steps)"
    )
    failure = getattr(error, "controller_failure", None)
    if failure is not None and type(failure).__name__ == "WorkerGroupStartupTimeoutError":
        return (
            f"error: Ray found no room for {job.min_workers or job.workers} workers x {job.resources()} within "
            f"--start-timeout-s {job.start_timeout_s:g}, {job.max_failures + 1} times (a node gone for good, or a "
            f"cluster too small); the steps since the newest checkpoint are lost; {kept}"
        )
    return (
        f"error: the run failed on Ray after {job.max_failures} restarts ({_first_line(error)}); the steps since the "
        f"newest checkpoint are lost; {kept}"
    )


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="training workers (processes), the group's size")
    parser.add_argument("--min-workers", type=int, default=None, help="an elastic group: at least this many")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument(
        "--gpus-per-worker", type=float, default=0.0, help="0: train on CPUs (gloo); 1: one GPU each (NCCL)"
    )
    parser.add_argument("--address", default=None, help="the Ray cluster (default: RAY_ADDRESS, else a local Ray)")
    parser.add_argument(
        "--max-failures", type=int, default=3, help="group restarts after a failure (a user error: none)"
    )
    parser.add_argument(
        "--start-timeout-s",
        type=float,
        default=120.0,
        help="a group start that finds no room for its workers this long fails (and counts as a failure)",
    )
    parser.add_argument(
        "--resize-check-s",
        type=float,
        default=60.0,
        help="with --min-workers: how often Ray looks for room for more workers; a group that can grow saves at an "
        "agreed step and starts again, larger, from it",
    )
    parser.add_argument(
        "--config-file",
        default=None,
        help="an accelerate config whose mixed precision and strategy the workers take (accelerate_configs/fsdp.yaml: "
        "FSDP2); its process counts are --workers'",
    )
    parser.add_argument("script", help="the training script, e.g. scripts/imagenet.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its options, as for accelerate launch")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="ddp-accel ray", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_job(RayJob(**vars(parser.parse_args(argv))))


def run_job(job: RayJob) -> int:
    """`run`, with a user error as its one line (exit 2)."""
    try:
        job.check()
        return run(job)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())

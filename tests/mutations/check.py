"""Mutation check: does the suite catch these bugs? Each patch in tests/mutations/*.patch puts one bug into the code;
this applies each alone, runs the whole suite with -x (tier by tier: inprocess, multiprocess, system, so that the
cheapest test that catches it runs first), records the first test that failed, and takes the patch back out. A
collection error or a timeout does not count as caught. Not part of CI (one suite run per mutation).

    .venv/bin/python tests/mutations/check.py                      # every mutation, table to stdout
    .venv/bin/python tests/mutations/check.py --only rotation_deletes_newest
    .venv/bin/python tests/mutations/check.py --make               # write the patches again from MUTATIONS below

`--tree DIR --patches DIR --no-tiers` run another checkout (e.g. an older commit with its own patches) the same way.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# name -> (file, the code, the bug): what --make turns into NAME.patch (applied to this checkout's code)
MUTATIONS: dict[str, tuple[str, str, str]] = {
    "resume_skips_one_batch_too_few": (
        "ddp_accel/state.py",
        "skip, leftover = self.batches_in_epoch, 0",
        "skip, leftover = max(0, self.batches_in_epoch - 1), 0",
    ),
    "eval_keeps_padding_duplicates": (
        "ddp_accel/evaluation.py",
        "accelerator.gather_for_metrics(eval_fn(model, batch))",
        "accelerator.gather(eval_fn(model, batch))",
    ),
    "set_epoch_not_called": (
        "ddp_accel/training.py",
        "    set_loader_epoch(loader, epoch)\n",
        "",
    ),
    "nb_weights_count_held_out": (
        "scripts/imdb.py",
        "model.fit_nb_weights(loader(text.train, False, training=True), alpha=args.nb_alpha)",
        "model.fit_nb_weights([*loader(text.train, False, training=True), *loader(text.val, False)], "
        "alpha=args.nb_alpha)",
    ),
    "rotation_deletes_newest": (
        "ddp_accel/checkpoint.py",
        "complete_checkpoints(final.parent)[:-limit]",
        "complete_checkpoints(final.parent)[limit:]",
    ),
    "preemption_flag_ignored_on_rank_1": (
        "ddp_accel/agreement.py",
        "verdict = self.submit(step, signum or 0, count_nonfinite)",
        "verdict = self.submit(step, 0 if self.accelerator.process_index == 1 else signum or 0, count_nonfinite)",
    ),
    "step_agreement_all_reduce_skipped": (
        "ddp_accel/agreement.py",
        "                dist.all_reduce(self._host, op=dist.ReduceOp.MAX)\n",
        "",
    ),
    "renamed_before_training_state_is_written": (
        "ddp_accel/checkpoint.py",
        "    (partial / TRAINING_STATE).write_text(training_state)"
        "\n    if final.exists():\n        shutil.rmtree(final)\n    partial.rename(final)\n",
        "    if final.exists():\n        shutil.rmtree(final)\n    partial.rename(final)\n"
        "    (final / TRAINING_STATE).write_text(training_state)"
        "\n",
    ),
    # four in code this change moved or wrote
    "train_state_forgets_the_global_batch": (
        "ddp_accel/state.py",
        "        known = {f.name for f in fields(self)}",
        '        known = {f.name for f in fields(self)} - {"global_batch"}',
    ),
    "commit_keeps_the_preempted_marker": (
        "ddp_accel/run_folder.py",
        "        (self.path / PREEMPTED_MARKER).unlink(missing_ok=True)\n",
        "",
    ),
    "workers_not_shielded_from_preemption": (
        "ddp_accel/loaders.py",
        "        signal.signal(signum, signal.SIG_IGN)\n",
        "        pass\n",
    ),
    "workers_forked_from_the_training_process": (
        "ddp_accel/loaders.py",
        '    return "fork" if interactive else "forkserver"',
        '    return "fork"',
    ),
    "trackers_log_raw_steps": (
        "ddp_accel/callbacks.py",
        'self.log.log({**values, "optimizer_step": run.state.step}, run.state.samples_trained)',
        'self.log.log({**values, "optimizer_step": run.state.step}, run.state.step)',
    ),
    "ema_average_not_resumed": (
        "ddp_accel/ema.py",
        'self.updates, self.average = state["updates"], state["average"]',
        "pass",
    ),
    "user_error_burns_the_restarts": (
        "ddp_accel/endings.py",
        "    stop_restarts()  # a user error fails the same way at every restart of the launcher\n",
        "",
    ),
    "early_stopping_counter_not_saved": (
        "ddp_accel/state.py",
        'return {**asdict(self), "samples_in_epoch": self.samples_in_epoch}',
        'return {**{k: v for k, v in asdict(self).items() if k != "evaluations_without_improvement"}, '
        '"samples_in_epoch": self.samples_in_epoch}',
    ),
    "resume_compares_raw_step_numbers": (
        "ddp_accel/state.py",
        "        self.step = rebase.step\n",
        "",
    ),
    "identity_options_not_compared": (
        "ddp_accel/identity.py",
        '        if key in saved.get("options", {}) and saved["options"][key] != value',
        '        if key in saved.get("options", {}) and saved["options"][key] != value and False',
    ),
    "mixing_draws_from_the_global_generator": (
        "ddp_accel/vision/mixing.py",
        "        torch.default_generator.manual_seed(\n",
        "        torch.Generator().manual_seed(\n",
    ),
    "ray_user_error_retried": (
        "ddp_accel/ray_launch.py",
        "            if _user_error_of(training_failed_error) is not None:",
        "            if False:",
    ),
    # issue 43's silently wrong pair: a stop saved the step without its EMA update; a recount left the schedule behind
    "ema_updated_after_the_stop_agreement": (
        "ddp_accel/training.py",
        '    run.callbacks.call("on_step_end", run.context)\n'
        "    stop_on(run.agreement.step_done(state.step, run.signals.received, wait=eval_due or checkpoint_due))\n",
        "    stop_on(run.agreement.step_done(state.step, run.signals.received, wait=eval_due or checkpoint_due))\n"
        '    run.callbacks.call("on_step_end", run.context)\n',
    ),
    "schedule_left_at_the_saved_step": (
        "ddp_accel/schedules.py",
        "    if update is not None:  # torch >= 2.6",
        "    return True\n    if update is not None:  # torch >= 2.6",
    ),
    "ema_warmup_not_recounted": (
        "ddp_accel/ema.py",
        "        self.updates = rebase.steps_now(self.updates)",
        "        pass",
    ),
    "best_step_not_recounted": (
        "ddp_accel/state.py",
        "            self.best_step = rebase.steps_now(self.best_step)",
        "            pass",
    ),
    # the core's new mechanisms: states by name, the early --best-metric check
    "callback_states_by_position": (
        "ddp_accel/callback_state.py",
        "            if key in states:\n                callback.load_state_dict(states[key])",
        "            if key in states:\n                callback.load_state_dict(list(states.values())[0])",
    ),
    "best_metric_checked_only_at_the_first_evaluation": (
        "ddp_accel/config.py",
        "    if best_metric and evaluated and reported and best_metric not in reported:",
        "    if False:",
    ),
    "ray_workers_checked_for_even_placement": (
        "ddp_accel/launch_environments.py",
        "    @property\n    def even_placement(self) -> bool:\n        return False",
        "    @property\n    def even_placement(self) -> bool:\n        return True",
    ),
    "a_preemption_reported_as_completed": (
        "ddp_accel/endings.py",
        'outcome = Outcome("preempted", code, preempted.message',
        'outcome = Outcome("completed", code, preempted.message',
    ),
    "launch_address_not_checked": (
        "ddp_accel/launch.py",
        '    check_address(setup["address"], setup["port"])\n',
        "",
    ),
    "identity_labels_ignored": (
        "ddp_accel/identity.py",
        "    if labels and key in labels:\n        return labels[key]\n",
        "",
    ),
    "fold_takes_a_val_fraction_silently": (
        "scripts/imdb.py",
        "    if args.fold and args.val_fraction is not None:",
        "    if False:",
    ),
    "ray_address_not_waited_for": (
        "ddp_accel/ray_launch.py",
        "    if not new_cluster:  # before Ray's import",
        "    if False:  # before Ray's import",
    ),
    "ray_train_imported_before_the_address_is_tried": (
        "ddp_accel/ray_launch.py",
        '    new_cluster = job.address is None and not os.environ.get("RAY_ADDRESS")\n    if not new_cluster:',
        "    import ray.train.v2.torch.torch_trainer  # noqa: F401\n\n"
        '    new_cluster = job.address is None and not os.environ.get("RAY_ADDRESS")\n    if not new_cluster:',
    ),
    "ray_imported_for_the_installed_check": (
        "ddp_accel/ray_launch.py",
        'if importlib.util.find_spec("ray") is None:',
        'if __import__("ray") is None:',
    ),
    "collector_not_paused_for_the_imports": (
        "ddp_accel/startup.py",
        "    if gc.isenabled():\n        gc.disable()\n        _collector_paused = True\n",
        "",
    ),
    "collector_left_off_after_the_imports": (
        "ddp_accel/startup.py",
        "        gc.freeze()\n        gc.enable()\n",
        "        gc.freeze()\n",
    ),
    "imports_not_frozen_out_of_the_collectors_sight": (
        "ddp_accel/startup.py",
        "        gc.freeze()\n        gc.enable()\n",
        "        gc.enable()\n",
    ),
    "run_main_leaves_the_collector_paused": (
        "ddp_accel/endings.py",
        "    imports_done()  # the collector paused for the imports runs again, what they made frozen",
        "    pass  # the collector paused for the imports runs again, what they made frozen",
    ),
    "a_failed_peer_s_error_file_goes_unseen": (
        "ddp_accel/launch_environments.py",
        '            return any(path != Path(own) for path in Path(own).parent.parent.glob("*/error.json"))',
        "            return False",
    ),
    "the_start_up_guard_marks_a_failed_peer_s_end_as_a_preemption": (
        "ddp_accel/startup.py",
        "    if _ending_for_a_peer():\n        end_forkserver()\n        os._exit(128 + signum)\n",
        "",
    ),
    "a_failed_peer_s_end_after_the_imports_leaves_a_marker": (
        "ddp_accel/stopping.py",
        "        if self.received and launch_environments.current().peer_failed():\n"
        "            raise EndedForAPeer(self.received)\n",
        "",
    ),
    "evaluation_takes_options_of_training": (
        "scripts/imagenet.py",
        "    if args.evaluate:\n        check_evaluation_options(parser, args)\n",
        "",
    ),
    "budget_guard_never_stops": (
        "ddp_accel/budget.py",
        "        state.out_of_time = True\n",
        "        return\n",
    ),
    "imports_not_guarded": (
        "ddp_accel/startup.py",
        "        signal.signal(signum, lambda received, frame: stop_before_training(received, output_dir, "
        '"imports"))\n',
        "        pass\n",
    ),
    # issue 43 item 12: one per mechanism class
    # 1. a decision each rank makes that the ranks must agree on
    "auto_batch_size_agrees_on_the_largest_fit": (
        "ddp_accel/batch_size.py",
        "dist.all_reduce(flag, op=dist.ReduceOp.MIN)",
        "dist.all_reduce(flag, op=dist.ReduceOp.MAX)",
    ),
    "time_budget_planned_on_the_fastest_rank": (
        "ddp_accel/budget.py",
        "dist.all_reduce(figures, op=dist.ReduceOp.MAX)",
        "dist.all_reduce(figures, op=dist.ReduceOp.MIN)",
    ),
    "budget_guard_decides_alone_on_each_rank": (
        "ddp_accel/budget.py",
        "        if distributed():\n            dist.all_reduce(late, op=dist.ReduceOp.MAX)\n",
        "",
    ),
    # 2. randomness that must differ per micro-batch
    "mixing_draws_alike_for_each_micro_batch": (
        "ddp_accel/vision/mixing.py",
        "        self.micro_batch += 1\n",
        "",
    ),
    # 3. the watchdog's heartbeat in one phase
    "watchdog_deaf_during_evaluation": (
        "ddp_accel/training.py",
        '        self.watchdog.beat(f"an evaluation batch at step {self.state.step}")\n',
        "",
    ),
    # 4. a doctor check tested through its helper, not through the command
    "doctor_command_drops_the_data_check": (
        "ddp_accel/doctor.py",
        "    problems = compare(reports, output_dir, data, min_free_gb)\n",
        "    problems = compare(reports, output_dir, None, min_free_gb)\n",
    ),
    "doctor_ignores_the_asked_free_disk_bar": (
        "ddp_accel/doctor.py",
        "            if report.free_gb is not None and report.free_gb < min_free_gb:\n",
        "            if report.free_gb is not None and report.free_gb < LOW_DISK_GB:\n",
    ),
    # 5. a process that must die with its training process after a SIGKILL
    "forkserver_outlives_its_training_process": (
        "ddp_accel/worker_server.py",
        "    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)\n",
        "    pass\n",
    ),
    # 6. an identity option checked at one entry point but not another
    "evaluation_ignores_the_augmentation": (
        "scripts/imagenet.py",
        'EVALUATION_OPTIONS = ("arch", "image_size", "augment", "mean", "std")',
        'EVALUATION_OPTIONS = ("arch", "image_size", "mean", "std")',
    ),
    "predict_ignores_the_data_options": (
        "scripts/imdb.py",
        "if key in IDENTITY_OPTIONS + MODEL_OPTIONS}",
        "if key in MODEL_OPTIONS}",
    ),
    # and mechanisms of checkpoint.py, callback_state.py, startup.py and launch_environments.py no test guarded
    "a_stop_saves_again_what_was_just_saved": (
        "ddp_accel/checkpoint.py",
        "        if self.holds(state, identity):\n            return step_folder(self.root, state.step)\n"
        "        return self.save_now(state, identity, in_background=False)",
        "        return self.save_now(state, identity, in_background=False)",
    ),
    "callback_states_of_one_key_collide": (
        "ddp_accel/callback_state.py",
        "            while unique in self.by_key:",
        "            while False:",
    ),
    "start_up_guard_overrides_nohup": (
        "ddp_accel/startup.py",
        "        if signum == signal.SIGHUP and signal.getsignal(signum) == signal.SIG_IGN:\n            continue\n",
        "",
    ),
    "env_launch_of_one_process_wants_an_address": (
        "ddp_accel/launch_environments.py",
        "        if world_size > 1 and missing:",
        "        if missing:",
    ),
    "env_launch_waits_in_silence": (
        "ddp_accel/runtime.py",
        "    with while_the_group_forms(timeout_s, output_dir):  # an env:// rendezvous: silent, deaf to signals\n",
        "    with contextlib.nullcontext():\n",
    ),
    "signals_wait_for_the_rendezvous": (
        "ddp_accel/group_wait.py",
        "            _stop(signum, self.output_dir)\n",
        "            pass\n",
    ),
    "worker_outlives_a_dead_forkserver": (
        "ddp_accel/loaders.py",
        "        if server.isdigit() and os.getppid() != int(server):\n            os._exit(0)\n",
        "",
    ),
    "changed_options_taken_without_a_word": (
        "ddp_accel/run_start.py",
        "    if changed:\n        accelerator.print(",
        "    if False:\n        accelerator.print(",
    ),
    "start_up_guard_in_a_scripts_thread": (
        "ddp_accel/startup.py",
        "    if threading.current_thread() is not threading.main_thread():\n        return\n",
        "",
    ),
    "helpers_outlive_the_command": (
        "ddp_accel/loaders.py",
        "    kill_leftover_workers(timeout_s)\n    end_forkserver()\n",
        "    kill_leftover_workers(timeout_s)\n    return\n",
    ),
    "workers_forkserver_started_at_the_first_batch": (
        "ddp_accel/startup.py",
        '    main_path = getattr(sys.modules.get("__main__"), "__file__", None)\n',
        "    return False\n",
    ),
    "allocator_left_to_its_defaults": (
        "ddp_accel/training.py",
        "        allocator.keep_freed_memory(accelerator.device.type)  # CPU steps",
        "        pass  # CPU steps",
    ),
    "stop_signals_not_held_while_a_notebook_forks": (
        "ddp_accel/notebook.py",
        "    hold_stop_signals_during_forks()\n\n    @functools.wraps(function)",
        "\n    @functools.wraps(function)",
    ),
    "allocator_set_for_a_gpu_run_too": (
        "ddp_accel/allocator.py",
        'if _kept or device_type != "cpu" or not applies():',
        "if _kept or not applies():",
    ),
    "allocator_still_maps_each_large_tensor": (
        "ddp_accel/allocator.py",
        "bool(libc.mallopt(M_MMAP_MAX, 0)) and ",
        "",
    ),
    "watchdog_exit_leaves_the_forkserver": (
        "ddp_accel/run_setup.py",
        "phase=lambda: signals.phase, exit=exit_now)",
        "phase=lambda: signals.phase)",
    ),
    "run_folder_built_again_in_fit": (
        "ddp_accel/training.py",
        "signals or StopSignals(), self.folder, callbacks",
        "signals or StopSignals(), RunFolder(self.config.output_dir), callbacks",
    ),
    "a_ray_worker_ends_the_processes_helpers": (
        "ddp_accel/endings.py",
        "    if launch_environments.current().outlives_the_script:",
        "    if False:",
    ),
    "watchdog_polls_at_the_first_bound": (
        "ddp_accel/watchdog.py",
        "min(5.0, max(0.05, smallest / 10))",
        "min(5.0, max(0.05, self.bound_s() / 10))",
    ),
    "fsdp_config_runs_as_ddp_on_cpu": (
        "ddp_accel/sharding.py",
        'if not fsdp_asked() or accelerator.device.type != "cpu"',
        'if True or accelerator.device.type != "cpu"',
    ),
    "fsdp_type_only_in_the_accelerator_state": (
        "ddp_accel/sharding.py",
        '    PartialState._shared_state["distributed_type"] = DistributedType.FSDP\n',
        "",
    ),
    "one_process_fsdp_without_a_group": (
        "ddp_accel/sharding.py",
        "    if accelerator.num_processes == 1 and not dist.is_initialized():",
        "    if False:",
    ),
    "batchnorm_in_bf16_under_fsdp": (
        "ddp_accel/sharding.py",
        "        keep_batchnorm_in_fp32(model)\n",
        "        pass\n",
    ),
    "checkpoint_strategy_not_checked": (
        "ddp_accel/checkpoint_format.py",
        "    check_strategy(accelerator, path)\n",
        "",
    ),
    "fsdp_buffers_left_to_each_rank": (
        "ddp_accel/sharding.py",
        "    if accelerator.num_processes > 1:\n        broadcast_buffers_before_forward(model)\n",
        "",
    ),
    "fsdp_checkpoint_keeps_any_ranks_buffers": (
        "ddp_accel/checkpoint.py",
        "        before_save(accelerator, contents.objects.models)  # under FSDP: the buffers every rank will load\n",
        "",
    ),
    "fsdp_evaluation_prepares_the_model_alone": (
        "ddp_accel/evaluation.py",
        "    if accelerator.distributed_type != DistributedType.FSDP:\n        return accelerator.prepare(model)\n",
        "    return accelerator.prepare(model)\n",
    ),
    "powersgd_state_not_saved": (
        "ddp_accel/comm_hooks.py",
        "    if keepers:\n        saved = ",
        "    if False:\n        saved = ",
    ),
    "powersgd_buckets_laid_out_by_ready_order": (
        "ddp_accel/comm_hooks.py",
        "            model.reducer._push_all_rebuilt_params()\n",
        "            pass\n",
    ),
    "comm_hook_taken_on_one_process": (
        "ddp_accel/comm_hooks.py",
        "    if processes == 1:\n",
        "    if False:\n",
    ),
    "powersgd_in_several_buckets_over_gloo": (
        "ddp_accel/comm_hooks.py",
        "        bucket_cap_mb=ONE_BUCKET_MB if one_bucket else 25,",
        "        bucket_cap_mb=25,",
    ),
    "async_staging_keeps_references": (
        "ddp_accel/async_save.py",
        "        copied = self.buffers.copy(tensor)",
        "        copied = tensor",
    ),
    "async_checkpoint_written_at_once": (
        "ddp_accel/checkpoint.py",
        "        background = in_background and self.writer is not None",
        "        background = False",
    ),
    # a final model on every review (--val-fraction 0), and what would watch its missing evaluation
    "val_fraction_0_still_holds_out": (
        "ddp_accel/text/pipeline.py",
        "    if fold is None and options.val_fraction == 0:  # a final model: every review trains\n",
        "    if fold is None and options.val_fraction < 0:  # a final model: every review trains\n",
    ),
    "best_metric_without_an_evaluation_accepted": (
        "ddp_accel/config.py",
        "    if config.best_metric and not evaluated:"
        "  # (a script's own default metric waits for its evaluation silently)\n",
        "    if config.best_metric and not evaluated and False:\n",
    ),
    # --decode-on device: the PIL path's boxes, its validation crop, a damaged JPEG named
    "device_decode_boxes_from_the_global_generator": (
        "ddp_accel/vision/device_decode.py",
        "                    with augmentation_seed(self.seed, self.epoch, index):\n",
        "                    with torch.no_grad():\n",
    ),
    "device_decode_validation_crop_from_the_top": (
        "ddp_accel/vision/device_decode.py",
        "            top = int(round((size[0] - self.image_size) / 2.0))\n",
        "            top = 0\n",
    ),
    "device_decode_damaged_jpeg_unnamed": (
        "ddp_accel/vision/device_decode.py",
        '        raise UserError(f"cannot decode image {path} (a damaged JPEG); delete or replace it") from None\n',
        "        raise\n",
    ),
    "forkserver_preloads_nothing_the_script_imported": (
        "ddp_accel/startup.py",
        "    start_forkserver(WORKER_SERVER_MODULES + (modules_imported_by(Path(main_path)) if main_path else []))",
        "    start_forkserver(WORKER_SERVER_MODULES)",
    ),
    "curves_drawn_without_the_scores": (
        "ddp_accel/plots.py",
        "    for key in scores:\n",
        "    for key in scores[:0]:\n",
    ),
    "forkserver_left_after_a_systemexit": (
        "ddp_accel/startup.py",
        "    atexit.register(end_forkserver)  # a main that leaves by SystemExit",
        "    pass  # a main that leaves by SystemExit",
    ),
    "curves_drawn_whatever_the_variable": (
        "ddp_accel/run_end.py",
        "curves = bool(final.history.records) and curves_wanted()",
        "curves = bool(final.history.records)",
    ),
    "garbage_collected_after_the_size_that_fit": (
        "ddp_accel/batch_size.py",
        "clear_device_cache(garbage_collection=not fits)",
        "clear_device_cache(garbage_collection=True)",
    ),
    "no_garbage_collected_after_running_out_of_memory": (
        "ddp_accel/batch_size.py",
        "clear_device_cache(garbage_collection=not fits)",
        "clear_device_cache(garbage_collection=False)",
    ),
    "async_model_staged_through_its_ddp_wrapper": (
        "ddp_accel/run_setup.py",
        "        [task.model],\n",
        "        [prepared.model],\n",
    ),
    "sharded_optimizer_left_as_accelerate_loaded_it": (
        "ddp_accel/checkpoint_format.py",
        "            load_sharded_optimizers(contents.objects, path)\n",
        "            pass\n",
    ),
    "a_skipping_loader_left_at_its_own_epoch": (
        "ddp_accel/training.py",
        "        skipped.set_epoch(epoch)\n",
        "        pass\n",
    ),
    "encoded_cache_shared_across_datasets_versions": (
        "ddp_accel/text/pipeline.py",
        "options.seed, PIPELINE_VERSION, datasets.__version__",
        "options.seed, PIPELINE_VERSION",
    ),
    "untested_versions_run_without_a_word": (
        "ddp_accel/runtime.py",
        "    if (untested := untested_line()) and accelerator.is_main_process:",
        "    if (untested := untested_line()) and False:",
    ),
    "fsdp_on_cpu_under_a_torch_whose_gloo_sums": (
        "ddp_accel/sharding.py",
        "    if (major_minor(version) or (0, 0)) >= FSDP_ON_CPU_TORCH:",
        "    if True:",
    ),
    "unreadable_random_states_resumed": (
        "ddp_accel/checkpoint_format.py",
        '    if failed.item():\n        raise UserError(\n            f"checkpoint {path}: this Accelerate cannot read',
        '    if False:\n        raise UserError(\n            f"checkpoint {path}: this Accelerate cannot read',
    ),
    "a_rank_left_to_torchs_client_for_rank_0": (
        "ddp_accel/group_wait.py",
        "        if store is not None:  # rank 0's store first",
        "        if False:  # rank 0's store first",
    ),
    "the_script_s_handlers_act_while_the_group_forms": (
        "ddp_accel/group_wait.py",
        "                previous[signum] = signal.signal(signum, lambda received, frame: None)",
        "                previous[signum] = signal.getsignal(signum)",
    ),
    "a_signal_as_the_group_formed_lost": (
        "ddp_accel/group_wait.py",
        "                self._act_on_signals_received()\n                for signum, handler in previous.items():",
        "                for signum, handler in previous.items():",
    ),
    "the_group_wait_unbounded": (
        "ddp_accel/group_wait.py",
        "        if time.monotonic() >= bound:\n",
        "        if False:\n",
    ),
    "each_training_state_read_again_and_again": (
        "ddp_accel/checkpoint.py",
        "        if path not in self._states:\n",
        "        if True:\n",
    ),
    "the_checkpoints_listed_again_by_each_reader": (
        "ddp_accel/checkpoint.py",
        "        if self._complete is None:\n            self._complete",
        "        if True:\n            self._complete",
    ),
    "evaluation_of_latest_names_no_step": (
        "ddp_accel/evaluation.py",
        '    step = state.get("step")\n',
        "    step = None\n",
    ),
    "doctor_writes_its_marker_unguarded": (
        "ddp_accel/doctor.py",
        "            report.cannot_write = write_marker(marker, host)",
        "            marker.parent.mkdir(parents=True, exist_ok=True)\n            marker.write_text(host)",
    ),
    "stale_powersgd_feedback_kept_when_compression_stops": (
        "ddp_accel/comm_hooks.py",
        "            feedback = False\n        pieces",
        "        pieces",
    ),
    "powersgd_state_left_unused_without_a_word": (
        "ddp_accel/comm_hooks.py",
        "            if first.is_file()\n",
        "            if False\n",
    ),
    "powersgd_banner_compresses_whatever_its_start": (
        "ddp_accel/comm_hooks.py",
        "        if total_steps is not None and powersgd_start_step >= total_steps:",
        "        if False:",
    ),
    "a_resumed_run_unguarded_by_its_budget": (
        "ddp_accel/run_setup.py",
        "[BudgetGuard(self.budget, self.started)]",
        "([] if self.budget_kept else [BudgetGuard(self.budget, self.started)])",
    ),
    "a_sharded_save_s_failure_escapes_the_one_line": (
        "ddp_accel/files.py",
        '    return isinstance(error, Exception) or type(error).__name__ == "CheckpointException"',
        "    return isinstance(error, Exception)",
    ),
    "a_wrapped_full_disk_unrecognised": (
        "ddp_accel/files.py",
        "            if os.strerror(code) in str(found):\n",
        "            if False:\n",
    ),
    "fsdp_config_keys_unchecked": (
        "ddp_accel/config_file.py",
        "        if key not in known:\n",
        "        if False:\n",
    ),
    "fsdp_plugin_left_to_the_accelerator": (
        "ddp_accel/runtime.py",
        "    check_fsdp_config(cpu)\n",
        "",
    ),
    "fsdp1_keys_never_said_to_change_nothing": (
        "ddp_accel/accelerate_config.py",
        "        if changed and same_plugin(probe_plugin(without), plugin):",
        "        if False:",
    ),
    "a_resume_remembers_the_options_of_the_first_command": (
        "ddp_accel/run_start.py",
        "    state.training_options = now\n",
        "",
    ),
    "the_wait_reported_at_its_first_interval_again_and_again": (
        "ddp_accel/group_wait.py",
        "        report_at = time.monotonic() + REPORT_S\n",
        "        report_at = time.monotonic() + FIRST_REPORT_S\n",
    ),
    "the_wait_deaf_to_slurm_s_time_limit_warning": (
        "ddp_accel/group_wait.py",
        "    if signum in SIGNALS:\n",
        "    if signum == signal.SIGTERM:\n",
    ),
    "an_evaluation_alone_skips_the_runs_precision_policy": (
        "ddp_accel/evaluation.py",
        "    before_prepare(accelerator, model)\n    prepared, _ = accelerator.prepare(model, torch.optim.SGD(",
        "    prepared, _ = accelerator.prepare(model, torch.optim.SGD(",
    ),
    "done_said_before_the_last_write_completes": (
        "ddp_accel/training.py",
        "        run.checkpoints.finish_writes()  # --async-checkpoint: the last one is complete before the final "
        "work\n",
        "",
    ),
    "a_lost_peer_s_survivor_saves_nothing": (
        "ddp_accel/training.py",
        "    if lost_peers(error):\n        root, contents",
        "    if False:\n        root, contents",
    ),
    "auto_interval_chosen_by_each_rank_alone": (
        "ddp_accel/interval.py",
        "            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)\n",
        "",
    ),
    "auto_interval_counts_the_failures_a_survivor_covers": (
        "ddp_accel/interval.py",
        "needing_a_checkpoint_s = mtbf_s / UNCOVERED_SHARE if self.covered else mtbf_s",
        "needing_a_checkpoint_s = mtbf_s",
    ),
    "auto_interval_times_each_question_as_a_step": (
        "ddp_accel/interval.py",
        "        if step != self._last_step:  # asked more than once a step",
        "        if True:  # asked more than once a step",
    ),
    "a_survivor_saves_buffers_only_process_0_held": (
        "ddp_accel/rescue.py",
        "    if isinstance(replica, Replica) and rank != 0 and ranks_own_buffers(contents):\n",
        "    if False:\n",
    ),
    "lomo_searched_for_at_every_step": (
        "ddp_accel/runtime.py",
        "    check_no_inherited_process_group()\n    mark_lomo_absent()\n",
        "    check_no_inherited_process_group()\n",
    ),
    "a_survivor_saves_the_buffers_the_next_step_changed": (
        "ddp_accel/checkpoint_format.py",
        "            weights.update({name: value for name, value in kept.items() if name in weights})\n",
        "",
    ),
    "a_survivor_keeps_its_own_norm_statistics": (
        "ddp_accel/agreement.py",
        "self.submitted_buffers = (step, {**kept, **self._shared_buffers(self._host[len(flags) :])})",
        "self.submitted_buffers = (step, kept)",
    ),
    "orphaned_workers_train_on": (
        "ddp_accel/endings.py",
        "        launcher_watch = end_with_the_launcher()\n",
        "        launcher_watch = None\n",
    ),
    "a_survivor_writes_streams_the_ranks_did_not_share": (
        "ddp_accel/rescue.py",
        "        return agreed[1] if agreed[2] else None\n",
        "        return agreed[1]\n",
    ),
    "a_survivor_saves_inside_an_accumulation": (
        "ddp_accel/rescue.py",
        "    if isinstance(replica, Replica) and state.batches_in_epoch % accumulation:",
        "    if False:",
    ),
    "async_staging_shares_addresses_across_objects": (
        "ddp_accel/async_save.py",
        "        self._storages = {}\n        self.writes.append(",
        "        self.writes.append(",
    ),
    "misplaced_optimizer_state_of_an_earlier_version_resumed": (
        "ddp_accel/checkpoint_format.py",
        'if saved.get("checkpoint_format", 1) < 2:',
        'if saved.get("checkpoint_format", 1) < 1:',
    ),
    "a_one_process_accelerate_launchs_grace_unknown": (
        "ddp_accel/stopping.py",
        "            return ACCELERATE_ONE_PROCESS_GRACE_S, RAISE_ACCELERATE_GRACE\n",
        "            pass\n",
    ),
    "the_progress_bar_blind_to_a_terminal_behind_a_pipe": (
        "ddp_accel/callbacks.py",
        "self.interactive = sys.stderr.isatty() or sys.stdout.isatty()",
        "self.interactive = sys.stderr.isatty()",
    ),
    "ram_efficient_loading_refused_where_accelerate_mended_it": (
        "ddp_accel/sharding.py",
        "or (0, 0)) < LOADING_KEEPS_BUFFERS:",
        "or (0, 0)) < (99, 0):",
    ),
    "the_progress_bar_redrawn_in_place_in_a_log_file": (
        "ddp_accel/callbacks.py",
        "file=None if self.interactive else LinePerRedraw(sys.stderr),",
        "file=None,",
    ),
    "the_slurm_stop_watchdog_ends_a_later_run_s_step": (
        "slurm/train.sbatch",
        'if [ "$(job_run)" = "RUNNING ${SLURM_RESTART_COUNT:-0}" ]; then',
        "if true; then",
    ),
    "the_slurm_stop_watchdog_never_ends_a_step": (
        "slurm/train.sbatch",
        'if [ "$(job_run)" = "RUNNING ${SLURM_RESTART_COUNT:-0}" ]; then',
        'if [ "$(job_run)" = "RUNNING ${SLURM_RESTART_COUNT:-0}x" ]; then',
    ),
    "the_streams_digest_leaves_out_torch_s_generator": (
        "ddp_accel/random_streams.py",
        'feed(blake, {"accelerate": self.accelerate, "registered": self.registered})',
        'feed(blake, {"accelerate": {k: v for k, v in self.accelerate.items() if k != "torch_manual_seed"}, '
        '"registered": self.registered})',
    ),
    "the_streams_digest_blind_to_a_generator_s_position": (
        "ddp_accel/random_streams.py",
        "        for item in value:\n            feed(blake, item)",
        "        for item in value[:2]:\n            feed(blake, item)",
    ),
    "a_callback_s_generators_never_compared": (
        "ddp_accel/training.py",
        "generators=self.callbacks.random_generators()",
        "generators={}",
    ),
    "a_rank_s_async_marker_left_before_its_files": (
        "ddp_accel/async_save.py",
        "    staged.write_all()\n    leave_marker(folder, rank)\n",
        "    leave_marker(folder, rank)\n    staged.write_all()\n",
    ),
    "a_launched_script_reads_no_config_file": (
        "ddp_accel/runtime.py",
        "    check_launched_config(precision=mixed_precision)  # the file accelerate launch was given, as check-config"
        " reads it\n",
        "",
    ),
    "an_error_naming_a_setting_stays_a_traceback": (
        "ddp_accel/config_file.py",
        "            if setting.named_by(message):",
        "            if False and setting.named_by(message):",
    ),
    "prepare_errors_not_told_by_their_setting": (
        "ddp_accel/runtime.py",
        "        with settings_named(lambda: setting_hints(models)):",
        "        with settings_named(lambda: setting_hints(models), ()):",
    ),
    "not_on_this_machine_called_invalid": (
        "ddp_accel/config_file.py",
        '        raise NotOnThisMachine(f"{path}: mixed_precision fp16 needs a GPU',
        '        raise UserError(f"{path}: mixed_precision fp16 needs a GPU',
    ),
    "a_peer_says_the_run_s_user_error_too": (
        "ddp_accel/endings.py",
        "or not _ended_while_process_0_reports(signals):",
        "or True:",
    ),
    "a_floor_s_dependencies_never_compared": (
        ".ci/floors.py",
        "if theirs is not None and ours is not None and major(ours) != major(theirs):",
        "if False:",
    ),
    "a_component_left_out_of_every_save": (
        "ddp_accel/checkpoint_format.py",
        "        component.save(folder, rank, accelerator.num_processes, sink_save(sink))",
        "        pass",
    ),
    "a_rank_s_random_states_written_from_the_live_streams_by_a_survivor": (
        "ddp_accel/checkpoint_format.py",
        "    streams = replica.streams if replica is not None else RandomStreams.now()",
        "    streams = RandomStreams.now()",
    ),
    "a_component_s_section_holds_the_defaults": (
        "ddp_accel/config.py",
        "return cls(**{name.name: getattr(config, name.name) for name in fields(cls)})",
        "return cls(**{name.name: getattr(type(config), name.name) for name in fields(cls)})",
    ),
    "the_loop_steps_without_clipping": (
        "ddp_accel/training.py",
        "            if accelerator.sync_gradients and max_grad_norm:\n",
        "            if False:\n",
    ),
    "a_start_up_phase_out_of_its_order": (
        "ddp_accel/startup.py",
        "    reached = sorted((at, moment) for moment, at in _moments.items() if at <= first_batch_at)",
        "    reached = [(at, moment) for moment, at in _moments.items() if at <= first_batch_at]",
    ),
    "the_cpu_runs_nchw_by_default": (
        "scripts/imagenet.py",
        '        return accelerator.device.type == "cpu" and accelerator.distributed_type in CPU_DATA_PARALLEL',
        "        return False",
    ),
    "the_shard_order_drawn_without_the_epoch": (
        "ddp_accel/streaming.py",
        "        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.counts))",
        "        return np.random.default_rng([self.seed]).permutation(len(self.counts))",
    ),
    "a_window_shuffled_from_the_global_generator": (
        "ddp_accel/streaming.py",
        "                window = np.random.default_rng([self.seed, self.epoch, block]).permutation(window)",
        "                window = np.random.permutation(window)",
    ),
    "a_changed_shard_read_without_a_word": (
        "ddp_accel/streaming.py",
        "            if (folder / shard.name).stat().st_size != shard.size:",
        "            if False:",
    ),
    "a_sample_without_its_label_unnamed": (
        "ddp_accel/vision/shards.py",
        '        if "cls" not in files:',
        "        if False:",
    ),
    "a_blank_jsonl_line_taken_for_a_sample": (
        "ddp_accel/streaming.py",
        "        content = ends > starts\n",
        "        content = ends >= starts\n",
    ),
    "a_changed_text_shard_read_without_a_word": (
        "ddp_accel/streaming.py",
        "            if index.fingerprint() != self.manifest.shards[shard].fingerprint:",
        "            if False:",
    ),
    "streamed_reviews_never_truncated": (
        "ddp_accel/text/streamed.py",
        "basic_english(text)[: self.max_length]",
        "basic_english(text)",
    ),
    "validation_shards_not_drawn_from_the_seed": (
        "ddp_accel/text/streamed.py",
        "order = [names[i] for i in np.random.default_rng(seed).permutation(len(names))]",
        "order = list(names)",
    ),
    "the_streamed_training_loader_never_shuffles": (
        "ddp_accel/text/pipeline.py",
        '"sampler": encoded.sampler(shuffle, seed, together)}',
        '"sampler": encoded.sampler(False, seed, together)}',
    ),
    "a_run_on_other_text_shards_resumes": (
        "ddp_accel/text/pipeline.py",
        '"train data": shards_identity(shards.identity()),',
        '"train data": shards_identity({}),',
    ),
    "a_refused_resume_names_no_shard": (
        "ddp_accel/identity.py",
        "    if not (_is_shards(saved) and _is_shards(current)):",
        "    if True:",
    ),
    "sync_batchnorm_variance_by_one_pass": (
        "ddp_accel/sync_bn.py",
        "    variance = (squares.sum(0) + (counts * (means - global_mean) ** 2).sum(0)) / count",
        "    variance = ((counts * means**2 + squares).sum(0) / count - global_mean**2).clamp_min(0)",
    ),
    "a_window_s_shards_indexed_again_and_again": (
        "ddp_accel/streaming.py",
        "        self.keep = shards_spanned(manifest.counts, window) + 1",
        "        self.keep = 2",
    ),
    "a_pax_or_gnu_long_name_ignored": (
        "ddp_accel/streaming.py",
        'name, size = extended.get(b"path", name), int(extended.get(b"size", size))',
        "name, size = name, size",
    ),
    "a_tar_header_s_checksum_unchecked": (
        "ddp_accel/streaming.py",
        '                raise tarfile.HeaderError(f"bad checksum at byte {offset}")',
        "                pass",
    ),
    "the_writer_keeps_the_class_by_class_order": (
        "ddp_accel/vision/shards.py",
        "            images = [images[i] for i in np.random.default_rng(seed).permutation(len(images))]\n",
        "            pass\n",
    ),
    "a_sharded_loader_s_dataset_left_at_epoch_0": (
        "ddp_accel/training.py",
        '    if hasattr(getattr(loader, "dataset", None), "set_epoch"):\n        loader.dataset.set_epoch(epoch)\n',
        "",
    ),
    "the_first_batch_s_moment_taken_at_its_step_s_end": (
        "ddp_accel/meters.py",
        "            self.first_batch_at = self.first_step_at - (step_time - data_wait)",
        "            self.first_batch_at = self.first_step_at",
    ),
    "an_exact_piece_seeded_by_its_place_on_its_process": (
        "ddp_accel/exact_reduction.py",
        "random_draws(piece_seed(self.seed, step, first + offset))",
        "random_draws(piece_seed(self.seed, step, offset))",
    ),
    "exact_a_process_s_pieces_summed_first": (
        "ddp_accel/exact_reduction.py",
        "            for row in self.rows[batch * per_batch : (batch + 1) * per_batch]:\n"
        "                total += row  # one addition at a time: no reduction kernel's own grouping\n",
        "            total += torch.stack(self.rows[batch * per_batch : (batch + 1) * per_batch]).sum(0)\n",
    ),
    "exact_pieces_all_reduced_as_they_go": (
        "ddp_accel/exact_reduction.py",
        "            with accelerator.no_sync(self.model), random_draws(",
        "            with random_draws(",
    ),
    "exact_pieces_mixed_by_their_place_on_their_process": (
        "ddp_accel/vision/mixing.py",
        "% 2**63 if piece is None else piece",
        "% 2**63",
    ),
    "the_vocabulary_pass_error_raised_through_the_barrier": (
        "ddp_accel/text/pipeline.py",
        "                problem = str(error)\n",
        "                raise\n",
    ),
    "weights_safetensors_cannot_write_found_at_the_end": (
        "ddp_accel/run_folder.py",
        '            save({"weights": torch.zeros(1, dtype=dtype)})\n',
        "            pass\n",
    ),
    "a_bad_sample_replaced_by_the_first_sample": (
        "ddp_accel/bad_samples.py",
        "chain(range(index, size), range(index))",
        "chain([index], range(size))",
    ),
    "bad_samples_past_the_limit_skipped": (
        "ddp_accel/bad_samples.py",
        "        if count > self.limit:",
        "        if False:",
    ),
    "a_bad_sample_said_and_listed_each_time_it_is_met": (
        "ddp_accel/bad_samples.py",
        "        if index in known:\n            return",
        "        if False:\n            return",
    ),
    "the_option_taken_by_a_script_that_never_reads_through_it": (
        "ddp_accel/run_setup.py",
        "    if config.skip_bad_samples and not isinstance",
        "    if False and not isinstance",
    ),
    "the_vocabulary_pass_stops_at_a_bad_review_under_the_option": (
        "ddp_accel/text/streamed.py",
        "            if bad > skip:",
        "            if bad > 0:",
    ),
    "length_buckets_never_sorted": (
        "ddp_accel/streaming.py",
        "            pool = pool[np.lexsort((pool, self.lengths[pool]))]\n",
        "",
    ),
    "length_buckets_shuffled_alike_every_epoch": (
        "ddp_accel/streaming.py",
        "np.random.default_rng([seed, epoch, number])",
        "np.random.default_rng([seed, number])",
    ),
    "a_bucket_padded_to_each_process_s_longest": (
        "ddp_accel/text/streamed.py",
        "np.full(max(width, len(ids)), self.vocab.pad_id",
        "np.full(len(ids), self.vocab.pad_id",
    ),
    "a_global_micro_batch_of_one_process_s_batch": (
        "ddp_accel/text/pipeline.py",
        "together = batch_size * PartialState().num_processes",
        "together = batch_size",
    ),
    "review_lengths_not_capped_at_max_length": (
        "ddp_accel/text/streamed.py",
        "lengths[index] = min(len(tokens), max_length or len(tokens))",
        "lengths[index] = len(tokens)",
    ),
    "in_process_recovery_exits_instead_of_regrouping": (
        "ddp_accel/training.py",
        "        if in_process:  # the launcher forms a new group: this process goes on in it",
        "        if False:",
    ),
    "the_launcher_never_calls_its_replacements_in": (
        "ddp_accel/recovery.py",
        "if self.joining and len(ready) == len(self.joining) and self.running and not self.received:",
        "if False:",
    ),
    "a_replacement_reads_the_folder_before_its_peers_save": (
        "ddp_accel/runtime.py",
        """    if os.environ.get(recovery.JOINS):  # a replacement, called in once its peers saved the step it joins at:
        recovery.wait_to_be_called(config.timeout_s)  # the folder is read after that save
    folder = RunFolder(config.output_dir)""",
        """    folder = RunFolder(config.output_dir)
    folder.listing.complete()  # read before the call, as a wait at the group's forming would""",
    ),
    "imagenet_s_norm_group_keeps_batch_norm": (
        "ddp_accel/vision/models.py",
        "            if isinstance(child, nn.BatchNorm2d):",
        "            if isinstance(child, nn.GroupNorm):",
    ),
    "imagenet_s_dummy_set_follows_the_per_process_batch": (
        "scripts/imagenet.py",
        "            SyntheticImages(args.dummy_images, args.image_size, args.dummy_classes, args.uint8),",
        "            SyntheticImages(100 * args.batch_size, args.image_size, args.dummy_classes, args.uint8),",
    ),
    "a_forming_group_waits_for_a_member_lost_meanwhile": (
        "ddp_accel/recovery.py",
        '        self.store.set(f"{KEY}/abandoned_{self.generation}", "1")',
        "        pass",
    ),
    "min_processes_survivors_replaced_anyway": (
        "ddp_accel/recovery.py",
        "        replaced = len(survivors) < self.min_processes",
        "        replaced = True",
    ),
    "a_stopped_process_holds_its_peers_until_the_watchdog": (
        "ddp_accel/recovery.py",
        '        if process_state(process.pid) != "T":',
        "        if True:",
    ),
    "a_survivor_leaves_its_peers_waiting_on_its_connections": (
        "ddp_accel/recovery.py",
        """        if dist.get_backend() == "gloo":
            close_the_connections()""",
        """        if False:
            close_the_connections()""",
    ),
    "an_engine_config_recovered_in_process": (
        "ddp_accel/launch.py",
        '        if setup["engine"]:',
        "        if False:",
    ),
    "a_killed_loader_worker_ends_the_recovering_job": (
        "ddp_accel/training.py",
        "    if in_process and a_loader_worker_lost(error):",
        "    if False:",
    ),
    "a_loss_at_a_group_s_start_ends_the_job": (
        "ddp_accel/endings.py",
        "            if not (recovery.under_in_process_recovery() and lost_peers(error)):",
        "            if True:",
    ),
    "a_loss_after_the_run_ended_taken_for_a_failure": (
        "ddp_accel/recovery.py",
        '        if not reports and self.store.check([f"{KEY}/completed_{self.generation}"]):',
        "        if False:",
    ),
    "the_end_s_barrier_fails_with_a_traceback": (
        "ddp_accel/endings.py",
        "            except Exception as error:\n                if not lost_peers(error):",
        "            except Exception as error:\n                if True:",
    ),
    "a_group_given_up_while_connecting_ends_the_job": (
        "ddp_accel/runtime.py",
        "        if recovery.given_up():",
        "        if False:",
    ),
    "a_repeating_collective_error_regrouped_forever": (
        "ddp_accel/recovery.py",
        "    if none_lost and not any(reports.values()):",
        "    if False:",
    ),
    "a_peer_s_collateral_exit_seen_before_the_death": (
        "ddp_accel/recovery.py",
        "            for slot in sorted(ended, key=lambda slot: self.running[slot].returncode >= 0):",
        "            for slot in ended:",
    ),
    "a_parallelism_config_recovered_in_process": (
        "ddp_accel/launch.py",
        '        if env.get(PARALLELISM, os.environ.get(PARALLELISM, "")).lower() == "true":',
        "        if False:",
    ),
    "nccl_p2p_left_on_where_accelerate_launch_turns_it_off": (
        "ddp_accel/accelerate_config.py",
        "    if not check_cuda_p2p_ib_support():",
        "    if False:",
    ),
    "a_held_step_read_back_from_its_files": (
        "ddp_accel/checkpoint_format.py",
        "    if held is None:\n        return load_files(",
        "    if True:\n        return load_files(",
    ),
    "survivors_wait_for_the_files_of_a_step_they_hold": (
        "ddp_accel/recovery.py",
        "        held = held_by_every_survivor(reports, step)  # (no one reads",
        "        held = None  # (no one reads",
    ),
    "a_rescue_in_flight_not_waited_for": (
        "ddp_accel/checkpoint.py",
        "            wait_for_rescues(self.root)\n",
        "",
    ),
    "replacements_read_the_files_of_the_step_handed_back": (
        "ddp_accel/recovery.py",
        "        held = held_by_every_survivor(reports, step)  # (each survivor",
        "        held = None  # (each survivor",
    ),
    "a_replacement_started_at_once_not_told_the_step_held": (
        "ddp_accel/recovery.py",
        "            **({HELD_STEP: str(self.held)} if self.held is not None and not joins else {}),\n",
        "",
    ),
    "a_replacement_keeps_nothing_it_was_given": (
        "ddp_accel/checkpoint_format.py",
        "    if own is None and given is not None:",
        "    if False:",
    ),
    "a_hand_back_saves_the_step_at_once": (
        "ddp_accel/training.py",
        "    if hand_back_agreed(run):",
        "    if False:",
    ),
    "a_giver_s_bytes_waited_on_without_the_launcher_s_word": (
        "ddp_accel/peer_copy.py",
        "            wait_watching_the_launcher(dist.broadcast(",
        "            (lambda work: work.wait())(dist.broadcast(",
    ),
    "a_tensor_held_twice_given_twice": (
        "ddp_accel/peer_copy.py",
        "        if id(obj) not in seen:",
        "        if True:",
    ),
    "an_optimizer_trains_on_the_copy_being_written": (
        "ddp_accel/checkpoint_format.py",
        "        optimizer.load_state_dict(peer_copy.cloned(state) if held.written_meanwhile else state)",
        "        optimizer.load_state_dict(state)",
    ),
    "a_background_write_s_copy_not_marked": (
        "ddp_accel/rescue.py",
        "        held.written_meanwhile = True",
        "        pass",
    ),
    "a_lost_peer_s_wait_left_to_gloo": (
        "ddp_accel/exact_reduction.py",
        "            if given_up():",
        "            if False:",
    ),
    "the_launcher_reads_no_default_config_file": (
        "ddp_accel/launch.py",
        "    path = file_accelerate_launch_reads(args.config_file, bool(args.cpu))",
        "    path = args.config_file",
    ),
    "a_recovering_launcher_s_processes_outlive_it": (
        "ddp_accel/elastic.py",
        "    if launcher is not None and launcher == str(os.getppid()):",
        "    if False:",
    ),
    "in_process_launch_drops_the_config_s_settings": (
        "ddp_accel/launch.py",
        "        env = process_variables(accelerate_args)",
        "        env = {}",
    ),
    "generations_share_one_store_prefix": (
        "ddp_accel/recovery.py",
        '    return f"ddp_accel/generation_{os.environ[GENERATION]}"',
        '    return "ddp_accel/generation"',
    ),
    "a_cut_off_peer_left_to_the_watchdog": (
        "ddp_accel/recovery.py",
        '            if self.running and not self.received and self.store.add(f"{KEY}/reported_{self.generation}", 0):',
        "            if False:",
    ),
    "a_survivor_moves_to_its_new_rank_s_gpu": (
        "ddp_accel/recovery.py",
        "        self.devices = slot_devices(processes + spares)",
        "        self.devices = None",
    ),
    "datasets_installed_with_the_core": (
        "pyproject.toml",
        """    "accelerate>=1.10",
    "safetensors>=0.4.3",""",
        """    "accelerate>=1.10",
    "datasets>=5.1",
    "safetensors>=0.4.3",""",
    ),
    "imdb_without_datasets_ends_in_a_traceback": (
        "scripts/imdb.py",
        """    require(["datasets"], install=TEXT_EXTRA)
""",
        "",
    ),
    "a_process_s_own_error_taken_for_a_cut_off_peer": (
        "ddp_accel/recovery.py",
        "        if lost is None and self.error_code:",
        "        if False:",
    ),
    "an_earlier_loss_s_error_ends_a_later_cut_off": (
        "ddp_accel/recovery.py",
        "        lost_at, self.error_code = time.time(), 0",
        "        lost_at = time.time()",
    ),
    "survivors_keep_their_old_per_process_batch": (
        "ddp_accel/recovery.py",
        "            self.next_generation(survivors, share, how, held, lost_at=lost_at)",
        "            self.next_generation(survivors, None, how, held, lost_at=lost_at)",
    ),
    "a_spare_never_takes_a_place": (
        "ddp_accel/recovery.py",
        "            if process.poll() is None and start in self.ready:",
        "            if False:",
    ),
    "a_ready_spare_waits_for_a_hand_back": (
        "ddp_accel/recovery.py",
        "        if share is not None and not (replaced and self.spares.ready_for(len(lost))):",
        "        if share is not None:",
    ),
    "a_spare_in_a_lost_slot_takes_the_lost_process_s_gpu": (
        "ddp_accel/recovery.py",
        "                    devices[int(slot)], devices[int(own)] = devices[int(own)], devices[int(slot)]",
        "                    pass",
    ),
    "a_spare_called_without_its_slot": (
        "ddp_accel/recovery.py",
        '    os.environ[SLOT] = call["slot"]\n',
        "",
    ),
}


def make_patches() -> None:
    for name, (path, code, bug) in MUTATIONS.items():
        source = (ROOT / path).read_text()
        assert source.count(code) == 1, f"{name}: the code to change is not exactly once in {path}"
        (ROOT / path).write_text(source.replace(code, bug))
        try:
            patch = subprocess.run(["git", "diff", "--", path], cwd=ROOT, capture_output=True, text=True, check=True)
        finally:
            (ROOT / path).write_text(source)
        (HERE / f"{name}.patch").write_text(patch.stdout)
        print(f"wrote {name}.patch")


def first_failure(output: str) -> str | None:
    found = re.search(r"^FAILED (\S+)", output, re.M)
    return found.group(1) if found else None


def run_suite(tree: Path, tiers: bool, timeout_s: int) -> tuple[str, float]:
    """The first failing test, or 'not caught' / 'collection error' / 'timeout'."""
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    for marker in ("inprocess", "multiprocess", "system") if tiers else (None,):
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
        command += ["-m", marker] if marker else []
        left = timeout_s - (time.monotonic() - started)
        try:
            result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            return "timeout", time.monotonic() - started
        output = result.stdout + result.stderr
        if result.returncode in (2, 3, 4) or "ERROR collecting" in output or " error" in output.splitlines()[-1:][0]:
            return "collection error", time.monotonic() - started
        if result.returncode == 1:
            return first_failure(output) or "failed (no test named)", time.monotonic() - started
    return "not caught", time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make", action="store_true", help="write the patches from MUTATIONS")
    parser.add_argument("--only", nargs="*", help="these mutations only")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout to test (default: this one)")
    parser.add_argument("--patches", type=Path, default=HERE, help="the folder of NAME.patch files")
    parser.add_argument("--no-tiers", action="store_true", help="one plain `pytest -x` (a suite without tier markers)")
    parser.add_argument("--timeout-s", type=int, default=3600, help="per mutation")
    args = parser.parse_args()
    if args.make:
        make_patches()
        return
    patches = sorted(args.patches.resolve().glob("*.patch"))  # git apply runs in --tree
    if args.only:
        patches = [patch for patch in patches if patch.stem in args.only]
    print("| mutation | caught by | seconds |\n|---|---|---|", flush=True)
    for patch in patches:
        subprocess.run(["git", "apply", str(patch)], cwd=args.tree, check=True)
        try:
            caught, seconds = run_suite(args.tree, not args.no_tiers, args.timeout_s)
        finally:
            subprocess.run(["git", "apply", "-R", str(patch)], cwd=args.tree, check=True)
        print(f"| {patch.stem} | {caught} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()

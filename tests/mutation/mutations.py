"""Named semantic mutations of the engine, each with the few CPU tests that must catch it.

A mutation is one exact snippet of one file and its replacement. ``run_mutations.py`` applies each to a copy of
the package and runs its guarding tests against that copy: every mutation must make them fail. A snippet that
no longer occurs exactly once is an error (the mutation went stale with an edit of the engine), never a pass:
update the snippet together with the code it guards.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MUTATIONS", "Mutation"]


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    """File to mutate, relative to the repository root."""
    old: str
    """Must occur exactly once in that file."""
    new: str
    tests: tuple[str, ...]
    """pytest node ids (relative to the repository root) that must fail under the mutation."""


BIND = "tests/runtime/test_binding_parity.py"
SKIP = "tests/runtime/test_skip_after_speculation.py"
DET = "tests/runtime/test_determinism.py"
MOVE = "tests/runtime/test_tail_move.py"
GROW = "tests/runtime/test_tail_growth.py"
TRIAL = "tests/runtime/test_thread_trial_run.py"
_MOVE_COPY = "for dst, src in zip(pmv, (d.master, d.exp_avg, d.exp_avg_sq), strict=True):"
_GROW_COPY = "for dst, src in zip((d.master, d.exp_avg, d.exp_avg_sq), state, strict=True):"

_STEP_CALL = ("            param, grad, exp_avg, exp_avg_sq, int(step), hyper.lr, hyper.beta1, hyper.beta2, hyper.eps,\n"
              "            hyper.weight_decay, float(grad_scale), param_bf16_out, src_p,")
_HOST_STEP_ARGS = ("                    p[sl], b.grad[sl], m[sl], v[sl], step=r.step, hyper=hypers[r.group], "
                   "grad_scale=scale,\n                    param_bf16_out=")
_UNDO_ARGS = ("                        p[sl], b.grad[sl], m[sl], v[sl], step=r.step, hyper=hypers[r.group], "
              "grad_scale=scale,\n                        param_bf16_out=None,")
_SPEC_STORES = ("store_moments=not ctx.bf16_only,\n                       store_master=not ctx.bf16_only)")
_REPLACE = '__import__("dataclasses").replace'
"""``dataclasses.replace`` inside an inserted expression: the mutated modules need not import it."""
_SKIP_UNDO = ("        if verdict.kind is StepVerdict.SKIP:\n            if speculated:\n"
              "                self._undo(b, ctx)\n")

MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "lr_x1.15_from_step_4", "hf_superoffload/ops.py", _STEP_CALL,
        _STEP_CALL.replace("hyper.lr,", "hyper.lr * (1.15 if step >= 4 else 1.0),"),
        (f"{BIND}::test_commit_parity[inverse]",),
    ),
    Mutation(
        "bias_correction_step_minus_1_host", "hf_superoffload/ops.py", _STEP_CALL,
        _STEP_CALL.replace("int(step), hyper.lr,", "max(int(step) - 1, 1), hyper.lr,"),
        (f"{BIND}::test_commit_parity[inverse]",),
    ),
    Mutation(
        "bias_correction_step_minus_1_tail", "cpu_ext/reference.py",
        "    bc1 = hyper.bias_correction1(step)\n    bc2_sqrt = math.sqrt(hyper.bias_correction2(step))\n"
        "    p.mul_(1.0 - hyper.lr * hyper.weight_decay)",
        "    bc1 = hyper.bias_correction1(max(step - 1, 1))\n"
        "    bc2_sqrt = math.sqrt(hyper.bias_correction2(max(step - 1, 1)))\n"
        "    p.mul_(1.0 - hyper.lr * hyper.weight_decay)",
        (f"{BIND}::test_commit_parity[inverse]",),
    ),
    Mutation(
        "weight_decay_on_the_no_decay_group", "hf_superoffload/runtime/host_pass.py", _HOST_STEP_ARGS,
        _HOST_STEP_ARGS.replace(
            "hyper=hypers[r.group],",
            f"hyper={_REPLACE}(hypers[r.group], weight_decay=max(h.weight_decay for h in hypers)),"),
        (f"{BIND}::test_commit_parity[inverse]",),
    ),
    Mutation(
        "clip_coefficient_ignored_on_redo", "hf_superoffload/runtime/host_pass.py",
        "self._cpu_step(b, ctx, verdict.hypers, verdict.grad_scale, store_moments",
        "self._cpu_step(b, ctx, verdict.hypers, 1.0 / self._div if speculated else verdict.grad_scale, store_moments",
        (f"{BIND}::test_redo_parity[double_buffer]",),
    ),
    Mutation(
        "no_undo_on_skip_double_buffer", "hf_superoffload/runtime/host_pass.py", _SKIP_UNDO,
        _SKIP_UNDO.replace("self._undo(b, ctx)", "pass"),
        (f"{SKIP}::test_skip_after_speculation_restores_the_state[flow-double_buffer]",),
    ),
    Mutation(
        "no_undo_on_skip_inverse", "hf_superoffload/runtime/host_pass.py", _SKIP_UNDO,
        _SKIP_UNDO.replace("self._undo(b, ctx)", "pass"),
        (f"{SKIP}::test_skip_after_speculation_restores_the_state[stationary-inverse_undo]",),
    ),
    Mutation(
        "inverse_undo_with_group_0_betas", "hf_superoffload/runtime/host_pass.py", _UNDO_ARGS,
        _UNDO_ARGS.replace(
            "hyper=hypers[r.group],",
            f"hyper={_REPLACE}(hypers[r.group], beta1=hypers[0].beta1, beta2=hypers[0].beta2),"),
        (f"{SKIP}::test_skip_after_speculation_restores_the_state[stationary-inverse_undo]",),
    ),
    Mutation(
        "data_parallel_gradient_divisor_dropped", "hf_superoffload/runtime/engine.py",
        "        self._div = comm.grad_divisor if comm else 1.0\n",
        "        self._div = 1.0\n",
        ("tests/distributed/test_data_parallel.py::test_two_ranks_match_the_reference_on_the_global_batch[0-inverse]",),
    ),
    Mutation(
        "no_sync_micro_batch_dropped", "hf_superoffload/runtime/flush.py",
        "        if not sync and (self._accum is None or isinstance(b, DeviceBucket)):\n            return",
        "        if not sync and (self._accum is None or isinstance(b, DeviceBucket)):\n"
        "            self.layout.params[i].grad = None\n            return",
        (f"{BIND}::test_accumulation_parity[device]",),
    ),
    Mutation(
        "gpu_tail_uses_the_default_eps", "hf_superoffload/runtime/device_tail.py",
        "hyper=verdict.hypers[r.group], grad_scale=verdict.grad_scale,",
        f"hyper={_REPLACE}(verdict.hypers[r.group], eps=1e-8), grad_scale=verdict.grad_scale,",
        (f"{BIND}::test_commit_parity[inverse]",),
    ),
    Mutation(
        "speculative_weights_uploaded_after_skip", "hf_superoffload/runtime/host_pass.py", _SKIP_UNDO,
        _SKIP_UNDO.replace("                self._undo(b, ctx)\n",
                           "                if b.staging is not None:\n"
                           "                    from ..triton_kernels import scatter_flat_\n"
                           "                    scatter_flat_(b.staging, b.params)\n"
                           "                self._undo(b, ctx)\n"),
        (f"{SKIP}::test_skip_after_speculation_restores_the_state[stationary-double_buffer]",),
    ),
    Mutation(
        "step_count_advanced_on_a_skipped_step", "hf_superoffload/runtime/engine.py",
        "        if verdict.kind is not StepVerdict.SKIP:\n            self.layout.cur = ctx.dst",
        "        if True:\n            self.layout.cur = ctx.dst if verdict.kind is not StepVerdict.SKIP else self.layout.cur",
        (f"{SKIP}::test_skip_after_speculation_restores_the_state[stationary-double_buffer]",),
    ),
    Mutation(
        "step_counter_off_by_one_after_load_state_dict", "hf_superoffload/state.py",
        '        engine.param_steps = [int(s) for s in sd["param_steps"].tolist()]',
        '        engine.param_steps = [int(s) + 1 for s in sd["param_steps"].tolist()]',
        ("tests/runtime/test_skip_and_state.py::test_state_dict_round_trip_resumes_bit_identically[True-False]",),
    ),
    Mutation(
        "bf16_rounding_by_truncation", "triton_kernels/reference.py",
        "        p.copy_(src[offset_el : offset_el + n].view(p.shape))",
        "        piece = src[offset_el : offset_el + n]\n"
        "        if p.dtype == torch.bfloat16 and piece.dtype == torch.float32:\n"
        "            piece = (piece.contiguous().view(torch.int32) & -65536).view(torch.float32)\n"
        "        p.copy_(piece.view(p.shape))",
        (f"{BIND}::test_commit_parity[inverse]",),
    ),
    Mutation(
        "host_accumulation_in_bf16_where_fp32_was_planned", "hf_superoffload/runtime/accumulation.py",
        'HostBuffer(host_numel, torch.float32, pin=False, name="fp32 gradient accumulator")',
        'HostBuffer(host_numel, torch.bfloat16, pin=False, name="fp32 gradient accumulator")',
        (f"{BIND}::test_accumulation_parity[host_fp32]",),
    ),
    Mutation(
        "lr_scheduler_advances_on_a_skipped_step", "hf_superoffload/integrations/_common.py",
        "        return bool(self.optimizer.step_was_skipped) or self._is_overflow",
        "        return self._is_overflow",
        ("tests/integration/test_trainer_errors.py::"
         "test_non_finite_step_is_skipped_and_the_lr_schedule_does_not_advance",),
    ),
    Mutation(
        "preemption_stops_only_the_signalled_rank", "hf_superoffload/integrations/_preemption.py",
        "        if self._group is None:\n            self.stopping = self.requested",
        "        if True:\n            self.stopping = self.requested",
        ("tests/distributed/test_trainer_preemption.py::"
         "test_sigterm_to_one_rank_stops_both_ranks_at_the_same_step_with_a_complete_checkpoint_of_it",),
    ),
    Mutation(  # the same break, caught through the hand-written Accelerate loop of examples/
        "accelerate_preemption_stops_only_the_signalled_rank", "hf_superoffload/integrations/_preemption.py",
        "        if self._group is None:\n            self.stopping = self.requested",
        "        if True:\n            self.stopping = self.requested",
        ("tests/distributed/test_accelerate_preemption.py::"
         "test_sigterm_to_one_of_two_ranks_stops_both_after_the_same_step_with_its_checkpoint",),
    ),
    # beyond the list: the other ways a speculative step can be kept or a state copy go stale
    Mutation(
        "speculation_committed_despite_changed_hyper_parameters", "hf_superoffload/runtime/validation.py",
        "    if scale != 1.0 or (spec_hypers is not None and hypers != spec_hypers):",
        "    if scale != 1.0:",
        (f"{BIND}::test_lr_change_after_backward_redoes",),
    ),
    Mutation(
        "double_buffer_drops_the_state_of_parameters_without_gradient", "hf_superoffload/runtime/host_pass.py",
        "        if ctx.dst != ctx.src:  # parameters without a gradient keep their state in the new copy too",
        "        if False:  # parameters without a gradient keep their state in the new copy too",
        (f"{BIND}::test_parameters_without_gradient_parity",),
    ),
    Mutation(
        "checkpoint_with_swapped_blocks_accepted", "hf_superoffload/state.py",
        "_crc = zlib.crc32  # (data, running value)",
        "_crc = lambda data, value=0: (value + sum(data)) & 0xFFFFFFFF  # order-insensitive",
        ("tests/reliability/test_checkpoint_order.py::"
         "test_two_swapped_blocks_in_the_file_are_detected_naming_file_arena_and_parameters",),
    ),
    Mutation(
        "inverse_rollback_path_follows_the_timing", "hf_superoffload/runtime/host_pass.py",
        "one_path=in_place and not deferred,", "one_path=False,",
        (f"{DET}::test_inverse_rollback_redo_does_not_depend_on_which_buckets_were_speculated",
         f"{DET}::test_inverse_rollback_skip_does_not_depend_on_which_buckets_were_speculated"),
    ),
    Mutation(
        "gradient_statistics_summed_by_torch_threads", "triton_kernels/reference.py",
        "        row += sumsq_nonfinite(out)\n",
        "        f = out.to(torch.float32)\n        row[0] += torch.sum(f * f)\n"
        "        row[1] += (~torch.isfinite(f)).sum().to(torch.float32)\n",
        (f"{DET}::test_same_bits_whatever_torch_threads",),
    ),
    Mutation(
        "wasted_buckets_miss_those_reached_after_the_verdict", "hf_superoffload/runtime/host_pass.py",
        "        if not (ctx.one_path and unreached):\n", "        if True:\n",
        (f"{SKIP}::test_wasted_buckets_count_each_undone_bucket_once[inverse_undo-after_the_verdict]",),
    ),
    Mutation(
        "gpu_cast_uploads_the_pre_step_copy", "hf_superoffload/runtime/upload.py",
        "source = b.staging if b.staging is not None else b.pmv[copy][0]",
        "source = b.staging if b.staging is not None else b.pmv[(copy + 1) % self.layout.copies][0]",
        (f"{BIND}::test_gpu_cast_parity",),
    ),
    Mutation(  # [Note: deferred speculation]: the speculative pass writes the master, so a skip cannot restore it
        "deferred_speculation_writes_the_master", "hf_superoffload/runtime/host_pass.py", _SPEC_STORES,
        _SPEC_STORES.replace("store_master=not ctx.bf16_only)", "store_master=True)"),
        (f"{SKIP}::test_skip_after_speculation_restores_the_state[stationary-inverse]",),
    ),
    Mutation(  # [Note: deferred speculation]: a committed speculative step never stores p, m, v
        "deferred_speculation_commit_dropped", "hf_superoffload/runtime/host_pass.py",
        "            self._owe(b, ctx, verdict, master=True)\n", "            pass\n",
        (f"{BIND}::test_commit_parity[inverse]",),
    ),
    Mutation(  # [Note: deferred speculation]: one landing buffer, so the next step's D2H overwrites a pending commit's
        "pending_commit_reads_the_next_steps_gradient", "hf_superoffload/runtime/bucket.py",
        "            self.landing = self.landings[1] if busy is self.landings[0] else self.landings[0]\n",
        "            self.landing = self.landings[0]\n",
        ("tests/runtime/test_deferred_moments.py::test_speculative_commits_left_pending_read_the_gradient_of_their_step",),
    ),
    Mutation(  # [Note: moving the tail to the host]: the moved buckets' second moments stay behind
        "tail_move_drops_exp_avg_sq", "hf_superoffload/runtime/tail_move.py", _MOVE_COPY,
        _MOVE_COPY.replace("d.exp_avg_sq)", "d.exp_avg.mul(0))"),
        (f"{MOVE}::test_training_after_a_move_equals_starting_with_the_smaller_tail[inverse-speculative]",),
    ),
    Mutation(  # the state of the last device buckets (the wrong end of the tail) goes to the moved ones
        "tail_move_copies_the_wrong_end", "hf_superoffload/runtime/tail_move.py",
        "        _copy_to_host(leaving[b.index], b)\n",
        "        _copy_to_host(layout.device_buckets[len(layout.device_buckets) - len(leaving) + moved.index(b.index)], b)\n",
        (f"{MOVE}::test_training_after_a_move_equals_starting_with_the_smaller_tail[double_buffer-verdict-first]",),
    ),
    Mutation(  # [Note: moving the tail to the device]: the moved buckets' second moments are never copied in
        "tail_growth_drops_exp_avg_sq", "hf_superoffload/runtime/tail_move.py", _GROW_COPY,
        _GROW_COPY.replace("d.exp_avg_sq)", "d.exp_avg_sq.clone())"),
        (f"{GROW}::test_training_after_growth_equals_starting_with_the_larger_tail[inverse]",),
    ),
    Mutation(  # the double buffer's other (uncommitted) state copy goes to the device
        "tail_growth_reads_the_other_state_copy", "hf_superoffload/runtime/tail_move.py",
        "_copy_to_device(h.pmv[layout.cur], d)",
        "_copy_to_device(h.pmv[1 - layout.cur], d)",  # the other copy whichever is current
        (f"{GROW}::test_training_after_growth_equals_starting_with_the_larger_tail[double_buffer]",),
    ),
    Mutation(  # the buckets already on the device keep their old offsets in the grown arenas
        "tail_growth_keeps_the_old_offsets", "hf_superoffload/runtime/layout.py",
        "        for (b, _), src in zip(staying, sources, strict=True):\n"
        "            grown[b.spec.offset : b.spec.offset + b.spec.shard].copy_(src)",
        "        for (b, old), src in zip(staying, sources, strict=True):\n"
        "            grown[old.offset : old.offset + old.shard].copy_(src)",
        (f"{GROW}::test_training_after_growth_equals_starting_with_the_larger_tail[plain]",
         f"{GROW}::test_the_old_tail_waits_on_the_host_one_arena_at_a_time"),
    ),
    Mutation(  # the device-to-device copy reads the old arena at the buckets' new offsets
        "tail_growth_reads_the_old_arena_at_the_new_offsets", "hf_superoffload/runtime/layout.py",
        "sources = [old_arena[old.offset : old.offset + old.shard] for _, old in staying]",
        "sources = [old_arena[b.spec.offset : b.spec.offset + b.spec.shard] for b, _ in staying]",
        (f"{GROW}::test_training_after_growth_equals_starting_with_the_larger_tail[plain]",),
    ),
    Mutation(  # [Note: restaging the device arenas]: the moved buckets' views keep every old arena alive
        "tail_move_keeps_the_old_arenas_alive", "hf_superoffload/runtime/tail_move.py",
        "    d.drop_state()\n", "",
        (f"{MOVE}::test_the_staying_tail_moves_device_to_device_one_arena_at_a_time",),
    ),
    Mutation(  # [Note: restaging the device arenas]: a view left in the mover's frame keeps one old arena alive
        "tail_move_leaves_a_view_in_its_frame", "hf_superoffload/runtime/tail_move.py",
        "        _copy_to_host(leaving[b.index], b)\n",
        "        src = leaving[b.index].exp_avg_sq\n        _copy_to_host(leaving[b.index], b)\n",
        (f"{MOVE}::test_the_staying_tail_waits_on_the_host_one_arena_at_a_time",),
    ),
    Mutation(  # every staged arena of a move waits on the host until the move ends (12 B per staying parameter)
        "tail_move_stages_every_arena_at_once", "hf_superoffload/runtime/layout.py",
        "            sources = list(held.split([old.shard for _, old in staying]))\n",
        "            sources = list(held.split([old.shard for _, old in staying]))\n"
        "            self.__dict__.setdefault('_staged', []).append(held)\n",
        (f"{GROW}::test_the_old_tail_waits_on_the_host_one_arena_at_a_time",
         f"{MOVE}::test_the_staying_tail_waits_on_the_host_one_arena_at_a_time"),
    ),
    Mutation(  # [Note: the host arenas keep their size]: a move to the device reallocates them at the smaller share
        "tail_growth_reallocates_the_host_arenas", "hf_superoffload/runtime/layout.py",
        "            elif name not in self.arenas or not self.arenas[name].grow(plan.host_numel):\n",
        "            elif name not in self.arenas or self.arenas[name].tensor.numel() != plan.host_numel:\n",
        (f"{GROW}::test_training_after_growth_equals_starting_with_the_larger_tail[inverse]",),
    ),
    Mutation(  # [Note: reserved room in the host arenas]: no room, so a move to the host regrows every arena
        "tail_move_regrows_the_host_arenas", "hf_superoffload/planning/plan.py",
        "        return self.device_numel if self.tail_movable else 0",
        "        return 0",
        (f"{MOVE}::test_training_after_a_move_equals_starting_with_the_smaller_tail[inverse-speculative]",),
    ),
    Mutation(  # a grown pinned buffer registered again over pages it still has registered
        "pinned_growth_keeps_the_old_registration", "hf_superoffload/runtime/host_memory.py",
        "            self._unpin()\n            self._unpin, self.pinned = None, False\n",
        "            self.pinned = False\n",
        ("tests/runtime/test_host_memory.py::test_a_pinned_buffer_grows_under_one_registration_of_the_whole_range",),
    ),
    Mutation(  # [Note: moving the tail to the host] under host accumulation: the accumulator keeps the old host share
        "tail_move_keeps_the_accumulation_buffers", "hf_superoffload/runtime/engine.py",
        "        self._release_accumulation()\n        moved = move_to_host(self.layout, plan)\n"
        "        self._relayout_accumulation(plan)\n",
        "        moved = move_to_host(self.layout, plan)\n",
        (f"{MOVE}::test_a_move_under_host_accumulation_equals_starting_with_the_smaller_tail[fp32-inverse]",),
    ),
    Mutation(  # a longer micro-batch after others summed on the host moves the tail under the partial sums
        "tail_moves_mid_accumulation", "hf_superoffload/runtime/engine.py",
        "        return (self.comm is None and self._flow is None and not self.step_in_progress\n"
        "                and (self._accum is None or self._accum.empty))\n",
        "        return self.comm is None and self._flow is None\n",
        (f"{MOVE}::test_a_longer_micro_batch_mid_step_is_refused_and_the_next_step_moves",),
    ),
    Mutation(  # [Note: the thread trial]: a faster step alone keeps the trial count, the pass not asked
        "thread_trial_trusts_the_step_alone", "hf_superoffload/planning/thread_trial.py",
        "faster = step_gain >= MARGIN and tried_pass < base_pass",
        "faster = step_gain >= MARGIN",
        ("tests/unit/test_thread_trial.py::test_otherwise_the_planned_count_comes_back",),
    ),
    Mutation(  # [Note: the thread trial]: the verdict is recorded but the trial count keeps running
        "thread_trial_never_restores_the_planned_count", "hf_superoffload/optimizer.py",
        "        if threads is not None and threads != self._built.plan.cpu_threads:\n",
        "        if threads is not None and trial.chosen is None:\n",
        (f"{TRIAL}::test_the_faster_thread_count_stays[slower]",),
    ),
    Mutation(  # [Note: idle inside a wait]: the calibration counts the training thread's waits as GPU idle time
        "calibration_counts_the_threads_waits_as_idle", "hf_superoffload/optimizer.py",
        "candidates = [MeasuredStep(stats.iteration_s, stats.gpu_idle_s,",
        "candidates = [MeasuredStep(stats.iteration_s, stats.wait_s,",
        ("tests/runtime/test_rate_calibration_run.py::test_the_first_steps_restate_the_rates_and_say_so[1]",),
    ),
    Mutation(  # [Note: calibrating the rates]: the last step is measured, however slow
        "calibration_measures_the_last_step_however_slow", "hf_superoffload/optimizer.py",
        "        number, stats, micro = min(steps, key=lambda r: r[1].iteration_s - r[1].gpu_idle_s)\n",
        "        number, stats, micro = steps[-1]\n",
        ("tests/runtime/test_rate_calibration_run.py::test_of_the_last_two_steps_the_faster_is_measured",),
    ),
    Mutation(  # [Note: the thread trial] under data parallel: each rank judges its own samples
        "thread_trial_ranks_judge_alone", "hf_superoffload/optimizer.py",
        "            sample = _agreed_sample(self._comm, sample, trial)\n",
        "            pass\n",
        ("tests/distributed/test_data_parallel_thread_trial.py::test_the_ranks_trial_together_and_agree[mixed-3]",),
    ),
    Mutation(  # [Note: adaptive moment deferral]: pending work gives back masters only
        "split_never_gives_back_moments", "hf_superoffload/runtime/master_deferral.py",
        "        while excess > 0 and moments > min(MOMENTS_KEPT, n):\n",
        "        while excess > 0 and masters > 0:\n",
        ("tests/runtime/test_adaptive_master.py::"
         "test_work_pending_at_the_verdicts_gives_back_the_moments_and_slack_brings_them_back",
         "tests/unit/test_master_deferral.py::test_below_no_master_pending_work_gives_back_the_last_buckets_moments"),
    ),
    Mutation(  # [Note: adaptive moment deferral]: every verdict-known pass defers its moments whatever the split
        "pass_ignores_the_moment_split", "hf_superoffload/runtime/commit.py",
        "        return rank < split.moments, rank < split.masters\n",
        "        return True, rank < split.masters\n",
        ("tests/runtime/test_adaptive_master.py::"
         "test_work_pending_at_the_verdicts_gives_back_the_moments_and_slack_brings_them_back",),
    ),
    Mutation(  # [Note: adaptive moment deferral]: every bucket's moments may be given back, none measures slack
        "split_gives_back_every_moment", "hf_superoffload/runtime/master_deferral.py",
        "        while excess > 0 and moments > min(MOMENTS_KEPT, n):\n",
        "        while excess > 0 and moments > 0:\n",
        ("tests/runtime/test_adaptive_master.py::"
         "test_work_pending_at_the_verdicts_gives_back_the_moments_and_slack_brings_them_back",),
    ),
    Mutation(  # a user-set field that needs deferred stores ends the plan search instead of constraining it
        "deferred_stores_setting_not_a_constraint", "hf_superoffload/planning/planner.py",
        '    asked = "defer_moments=True" if config.overrides.defer_moments is True else _needs_deferred_stores(config)\n',
        '    asked = "defer_moments=True" if config.overrides.defer_moments is True else None\n',
        ("tests/unit/test_plan_cli.py::test_a_setting_that_needs_deferred_stores_constrains_the_search",),
    ),
    Mutation(  # a checkpoint saves each host arena's whole buffer: page padding and the tail move's room
        "checkpoint_saves_the_arena_buffer", "hf_superoffload/state.py",
        '        "host": {k: exact_storage(v) for k, v in flat["host"].items()},\n',
        '        "host": dict(flat["host"]),\n',
        ("tests/runtime/test_skip_and_state.py::test_saved_arenas_carry_their_own_bytes_only",),
    ),
    Mutation(  # the device arenas go into the state dict as one host copy each (the whole device state in RAM)
        "device_state_saved_as_a_host_copy", "hf_superoffload/state.py",
        '        "device": {k: [exact_storage(v[at : at + _PIECE_ELEMS]) for at in range(0, v.numel(), _PIECE_ELEMS)]\n',
        '        "device": {k: [v.detach().to("cpu", copy=True)] for at in range(1)\n',
        ("tests/runtime/test_skip_and_state.py::test_saved_arenas_carry_their_own_bytes_only",),
    ),
    Mutation(  # a checksum window that straddles two pieces restarts its CRC in the second
        "checksum_window_restarts_at_a_piece", "hf_superoffload/state.py",
        "                carry = (_crc(data[:at], carry[0]), carry[1] + at)\n",
        "                carry = (_crc(data[:at]), carry[1] + at)\n",
        ("tests/runtime/test_skip_and_state.py::test_state_dict_round_trip_resumes_bit_identically[True-True]",),
    ),
    Mutation(  # a resume copies the first piece of an arena wherever a parameter's slice begins
        "resume_reads_the_wrong_piece", "hf_superoffload/state.py",
        "            dst[at + lo - start : at + hi - start].copy_(t[lo:hi])\n",
        "            dst[at + lo - start : at + hi - start].copy_(_pieces(x)[0][lo:hi])\n",
        ("tests/runtime/test_skip_and_state.py::test_state_dict_round_trip_resumes_bit_identically[True-True]",),
    ),
    Mutation(  # a resume reads the whole state into RAM beside the live arenas
        "resume_reads_the_state_into_ram", "hf_superoffload/integrations/_common.py",
        'return torch.load(path, map_location="cpu", weights_only=True, mmap=True)',
        'return torch.load(path, map_location="cpu", weights_only=True)',
        ("tests/reliability/test_resume_memory.py::test_the_optimizer_file_is_mapped_not_read_into_anonymous_memory",),
    ),
    Mutation(  # the log window averages only some of the step's counters
        "telemetry_window_drops_the_counts", "hf_superoffload/integrations/_common.py",
        'if f.type in ("float", "int", float, int) and f.name not in ("grad_norm", "clip_coef"))',
        'if f.type in ("float", float) and f.name not in ("grad_norm", "clip_coef"))',
        ("tests/runtime/test_pass_telemetry.py::test_a_window_of_one_step_logs_that_step",),
    ),
    Mutation(  # the Trainer's model saves write save_pretrained's 50 GB shards (the whole model copied to the host)
        "model_saves_unbounded", "hf_superoffload/integrations/transformers.py",
        '            kwargs.setdefault("max_shard_size", MODEL_SHARD_SIZE)\n',
        '            pass\n',
        ("tests/integration/test_trainer_resume.py::test_model_saves_are_written_in_bounded_shards",),
    ),
    Mutation(  # hf-superoffload train saves the trained model in save_pretrained's 50 GB shards
        "train_output_unbounded", "hf_superoffload/demo/train_job.py",
        "model.save_pretrained(path, max_shard_size=MODEL_SHARD_SIZE)",
        "model.save_pretrained(path)",
        ("tests/unit/test_cli_train_outputs.py::test_a_model_folder_is_fine_tuned_and_saved",),
    ),
    Mutation(  # export finds only save_pretrained's model files, not save_state's shards
        "export_misses_save_state_shards", "hf_superoffload/export.py",
        'for stem in ("superoffload_model", "model"):',
        'for stem in ("model",):',
        ("tests/integration/test_export.py::test_a_save_state_folder_exports_with_its_frozen_weights",),
    ),
    Mutation(  # save_state lets accelerate write the model too (one file: the whole model copied to the host)
        "save_state_writes_the_whole_model", "hf_superoffload/integrations/accelerate.py",
        "        del weights[i]  # accelerate writes the other models (and none of this one)\n",
        "        pass\n",
        ("tests/integration/test_accelerate.py::test_save_state_load_state_round_trip",),
    ),
    Mutation(  # load_state reads the optimizer file into RAM
        "load_state_reads_into_ram", "hf_superoffload/integrations/accelerate.py",
        'load_kwargs={"mmap": True, **(load_kwargs or {})}',
        "load_kwargs=load_kwargs",
        ("tests/integration/test_accelerate.py::test_save_state_load_state_round_trip",),
    ),
    Mutation(  # load_state's model hook loads nothing (the shards are ignored)
        "load_state_ignores_the_model_shards", "hf_superoffload/integrations/accelerate.py",
        "        if i is None or not any(os.path.isfile(os.path.join(input_dir, n)) for n in names):\n",
        "        if True:\n",
        ("tests/integration/test_accelerate.py::test_load_state_restores_the_model_from_its_shards",),
    ),
    Mutation(  # weight flow's state dict holds a host copy of every released weight while the model is saved
        "flow_state_dict_copies_the_weights", "hf_superoffload/runtime/weight_flow.py",
        "            sd[prefix + name] = exact_storage(u.sources[i]).view(p.shape)\n",
        "            sd[prefix + name] = u.sources[i].view(p.shape).clone()\n",
        ("tests/runtime/test_weight_flow.py::test_eval_state_dict_and_close",),
    ),
    Mutation(  # load_state_dict under weight flow drops a released parameter's entry instead of loading it
        "flow_load_skips_the_staging", "hf_superoffload/runtime/weight_flow.py",
        "                u.sources[i].view(p.shape).copy_(value)\n",
        "                pass\n",
        ("tests/runtime/test_weight_flow.py::test_load_state_dict_writes_the_streamed_weights_home",),
    ),
    Mutation(  # the entries loaded into the staging are reported missing (a strict load fails)
        "flow_load_reports_loaded_keys_missing", "hf_superoffload/runtime/weight_flow.py",
        "        if taken:  # loaded into staging: not missing\n",
        "        if False:\n",
        ("tests/runtime/test_weight_flow.py::test_load_state_dict_writes_the_streamed_weights_home",),
    ),
    Mutation(  # a materialized unit is loaded into its parameters only: the next fetch brings the old weights back
        "flow_load_leaves_a_materialized_staging", "hf_superoffload/runtime/weight_flow.py",
        "            if u is None or not isinstance(value, torch.Tensor) or value.shape != p.shape:\n",
        "            if u is None or u.state is UnitState.MATERIALIZED or not isinstance(value, torch.Tensor) "
        "or value.shape != p.shape:\n",
        ("tests/runtime/test_weight_flow.py::test_load_state_dict_writes_the_streamed_weights_home",),
    ),
    Mutation(  # reading a released streamed parameter reads freed memory instead of raising with the fix
        "flow_reads_released_weights", "hf_superoffload/runtime/weight_flow.py",
        "        if u is None or u.state is UnitState.MATERIALIZED:\n",
        "        if True:\n",
        ("tests/runtime/test_weight_flow.py::test_reading_a_released_parameter_raises_with_the_fix_and_metadata_reads_as_usual",),
    ),
    Mutation(  # a state dict of a flow model is refused (its detach of a released parameter counts as a read)
        "flow_state_dict_counts_as_a_read", "hf_superoffload/runtime/weight_flow.py",
        "        if self._saving and func is torch.Tensor.detach:\n",
        "        if False:\n",
        ("tests/runtime/test_weight_flow.py::test_reading_a_released_parameter_raises_with_the_fix_and_metadata_reads_as_usual",),
    ),
    Mutation(  # the state dict's allowance to detach outlives the state dict
        "flow_detach_allowance_leaks", "hf_superoffload/runtime/weight_flow.py",
        "        self._saving = max(0, self._saving - 1)\n",
        "        pass\n",
        ("tests/runtime/test_weight_flow.py::test_reading_a_released_parameter_raises_with_the_fix_and_metadata_reads_as_usual",),
    ),
    Mutation(  # a state loaded before the first batch builds the engine there, planning without the batch's shape
        "load_before_the_first_batch_closes_the_plan", "hf_superoffload/optimizer.py",
        "        if self._built is None and self._batch_hook is not None and not sd.get(\"sharding\"):\n",
        "        if False:\n",
        ("tests/runtime/test_workload_from_batch.py::test_a_state_loaded_before_the_first_batch_waits_for_the_plan",),
    ),
    Mutation(  # the state kept for the first batch is never copied in
        "pending_state_dropped", "hf_superoffload/optimizer.py",
        "            load_engine_state(engine, pending, validate=False)\n",
        "            pass\n",
        ("tests/runtime/test_workload_from_batch.py::test_a_state_loaded_before_the_first_batch_waits_for_the_plan",),
    ),
    Mutation(  # a state kept for the first batch leaves the weights as they were until that batch
        "pending_state_leaves_the_weights", "hf_superoffload/optimizer.py",
        "            weights_from_masters(self._ordered, sd)  # evaluation before the first batch sees the loaded weights\n",
        "            pass\n",
        ("tests/runtime/test_workload_from_batch.py::test_a_state_loaded_before_the_first_batch_waits_for_the_plan",),
    ),
    Mutation(  # a state kept for the first batch is not checked when it is loaded
        "pending_state_unchecked", "hf_superoffload/optimizer.py",
        "            validate_whole_state(self._ordered, names_in(self._model, self._ordered), sd)\n",
        "            pass\n",
        ("tests/runtime/test_workload_from_batch.py::test_a_state_loaded_before_the_first_batch_waits_for_the_plan",),
    ),
    Mutation(  # a data-parallel resume reads its own shard, building the engine (and the plan) before the first batch
        "dp_resume_plans_before_the_first_batch", "hf_superoffload/integrations/_common.py",
        "    if len(shards) == world and opt.comm is not None and opt.planned:\n",
        "    if len(shards) == world and opt.engine.comm is not None:\n",
        ("tests/distributed/test_data_parallel_workload.py::"
         "test_a_resume_before_the_first_batch_plans_with_it_and_equals_the_uninterrupted_run",),
    ),
    Mutation(  # a data-parallel resume loads its own shard into a plan that lays the buckets out otherwise
        "dp_resume_own_shard_into_another_layout", "hf_superoffload/integrations/_common.py",
        "        if is_own_shard(opt.engine, own.get(\"superoffload\", {})):\n",
        "        if True:\n",
        ("tests/distributed/test_data_parallel.py::"
         "test_sharded_checkpoint_resumes_bit_exactly_and_merges_for_any_world_size",),
    ),
    Mutation(  # a data-parallel resume merges every shard even where its own loads arena for arena
        "dp_resume_merges_its_own_layout", "hf_superoffload/integrations/_common.py",
        "        if is_own_shard(opt.engine, own.get(\"superoffload\", {})):\n",
        "        if False:\n",
        ("tests/distributed/test_data_parallel.py::"
         "test_sharded_checkpoint_resumes_bit_exactly_and_merges_for_any_world_size",),
    ),
    Mutation(  # merging the shards copies the state (a resume would hold it in RAM beside the live arenas)
        "merged_shards_are_copies", "hf_superoffload/state.py",
        "                    merged[side][kind].extend(_views(by_rank[r][side][kind], off, off + take))\n",
        "                    merged[side][kind].append(_read(by_rank[r][side][kind], off, off + take).clone())\n",
        ("tests/integration/test_export.py::test_a_data_parallel_checkpoint_is_merged_from_its_rank_shards",),
    ),
    Mutation(  # a damaged data-parallel shard is merged and given fresh checksums
        "consolidation_trusts_the_shards", "hf_superoffload/state.py",
        "                    _check_integrity(side, kind, sd[side][kind], saved.get(f\"{side}/{kind}\"), sd, names)\n",
        "                    pass\n",
        ("tests/integration/test_export.py::test_a_data_parallel_checkpoint_is_merged_from_its_rank_shards",),
    ),
    Mutation(  # the Trainer's model saves use safetensors' own writer (a whole file copied to the host first)
        "trainer_saves_not_streamed", "hf_superoffload/integrations/transformers.py",
        "    with streamed_model_files():\n        if not isinstance(model, PreTrainedModel)",
        "    if True:\n        if not isinstance(model, PreTrainedModel)",
        ("tests/integration/test_trainer_resume.py::test_model_saves_are_written_in_bounded_shards",),
    ),
    Mutation(  # the streamed writer writes the first piece of a tensor again and again
        "streamed_writer_repeats_the_first_piece", "hf_superoffload/integrations/_streamed_save.py",
        "                f.write(memoryview(flat[at : at + CHUNK_BYTES].cpu().numpy()))\n",
        "                f.write(memoryview(flat[: min(CHUNK_BYTES, flat.numel() - at)].cpu().numpy()))\n",
        ("tests/unit/test_streamed_save.py::test_what_it_writes_reads_back_bit_for_bit[7]",),
    ),
)

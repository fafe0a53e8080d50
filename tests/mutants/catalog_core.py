"""The mutants over the step's masks, status, rollback, loads, capturable scalars, skip counting
and the captured step (issue 52; the six that survived the suite before it are marked
"survivor"); tests/mutants/__init__.py says what a mutant is."""

from __future__ import annotations

from tests.mutants import Mutant

SKIP_TESTS = "tests/test_skip_nonfinite.py"
MASK_TESTS = "tests/test_masked_updates.py"
SWEEP_SKIPS = "tests/test_fault_sweep.py::test_a_non_finite_grad_on_some_ranks_skips_the_step_on_every_rank[P2]"
NOTHING_CHANGES = "a masked step (a bad grad, ranks that disagree) changes no parameter and no state on any rank"

CORE = [
    # ---- masks and selects: dmuon/numerics/masked_updates.py
    Mutant(
        name="select-takes-the-new-value-where-masked",
        guarantee=NOTHING_CHANGES,
        path="dmuon/numerics/masked_updates.py",
        old="torch.where(ok, value, target, out=target)",
        new="torch.where(ok, target, value, out=target)",
        tests=(MASK_TESTS,),
    ),
    Mutant(
        name="select-bits-keep-the-old-value-too",
        guarantee=NOTHING_CHANGES + " (the list form of a select, on CUDA)",
        path="dmuon/numerics/masked_updates.py",
        old="torch._foreach_mul_(bits, 1 - m)",
        new="torch._foreach_mul_(bits, m)",
        tests=(MASK_TESTS,),
    ),
    Mutant(
        name="mask-zeroes-the-kept-results",
        guarantee="a masked matrix's result travels back as +0.0 and an unmasked one unchanged",
        path="dmuon/numerics/masked_updates.py",
        old="torch.where(ok, target, zero, out=target)",
        new="torch.where(ok, zero, target, out=target)",
        tests=(MASK_TESTS,),
    ),
    Mutant(
        name="by-mask-merges-every-mask",
        guarantee="a parameter without a grad anywhere is skipped while the others step (its own mask)",
        path="dmuon/numerics/masked_updates.py",
        old="groups.setdefault(id(ok), (ok, []))[1].append(i)",
        new="groups.setdefault(0, (ok, []))[1].append(i)",
        tests=(MASK_TESTS,),
    ),
    # ---- the status vector and its blocks: dmuon/exchange/status_masks.py, grad_status.py
    Mutant(
        name="subset-disagreement-dropped",  # survivor 4
        guarantee="ranks that disagree on a grad within a strict subset of a DMuon's ranks stop the step on "
                  "every rank",
        path="dmuon/exchange/status_masks.py",
        old="((has > 0) & (has_not > 0)) | (uneven_elsewhere > 0) | ((partial > 0) & (partial < has))",
        new="((has > 0) & (has_not > 0)) | ((partial > 0) & (partial < has))",
        tests=("tests/test_fault_sweep.py::test_a_grad_missing_on_one_rank_of_a_row_mesh_stops_the_step_on_every_rank",),
    ),
    Mutant(
        name="partial-on-some-ranks-is-no-disagreement",
        guarantee="a replicated parameter's grad Partial on some ranks only stops the step and raises on every rank",
        path="dmuon/exchange/status_masks.py",
        old="((has > 0) & (has_not > 0)) | (uneven_elsewhere > 0) | ((partial > 0) & (partial < has))",
        new="((has > 0) & (has_not > 0)) | (uneven_elsewhere > 0)",
        tests=("tests/test_bad_input_regressions.py", "-k", "partial_on_some_ranks_only"),
    ),
    Mutant(
        name="non-finite-count-ignored-by-the-mask",
        guarantee="skip_nonfinite: a NaN or inf grad on any rank skips the step on every rank",
        path="dmuon/exchange/status_masks.py",
        old="step_ok = (status[BLOCKS * n] == 0) & (status[BLOCKS * n + 1] == 0) & ~_disagreement(status, n)",
        new="step_ok = (status[BLOCKS * n] == 0) & ~_disagreement(status, n)",
        tests=(SWEEP_SKIPS,),
    ),
    Mutant(
        name="pending-error-does-not-mask-the-step",
        guarantee="the step in which every rank raises the last step's agreed error changes nothing",
        path="dmuon/exchange/status_masks.py",
        old="        if self._masked_here:  # this rank's problem, or an error pending from the last step",
        new="        if False:  # this rank's problem, or an error pending from the last step",
        tests=("tests/test_distributed_robustness.py", "-k", "nothing_changed or as_before_the_invalid_grad"),
    ),
    Mutant(
        name="skipped-steps-count-ranks",  # survivor 3
        guarantee="skipped_steps counts steps: a NaN on every rank is one skipped step",
        path="dmuon/exchange/grad_status.py",
        old="return sums[BLOCKS * n], bool(sums[BLOCKS * n + 1]), uneven, mixed",
        new="return sums[BLOCKS * n], sums[BLOCKS * n + 1], uneven, mixed",
        tests=(SWEEP_SKIPS,),
    ),
    Mutant(
        name="first-replayed-error-overwritten",
        guarantee="a captured step's check() raises the error of the first replay that found one",
        path="dmuon/exchange/status_masks.py",
        old="error & (self.counts[1] == 0)",
        new="error",
        tests=("tests/test_replay_tally.py",),
    ),
    Mutant(
        name="replayed-error-counted-as-a-skip",
        guarantee="a step with an error is no skipped step (it raises), replayed or not",
        path="dmuon/exchange/status_masks.py",
        old="skipped = (status[BLOCKS * n + 1] > 0) & ~error",
        new="skipped = status[BLOCKS * n + 1] > 0",
        tests=("tests/test_replay_tally.py",),
    ),
    Mutant(
        name="check-counts-the-same-replays-twice",
        guarantee="check() counts each replay once, however often it is called",
        path="dmuon/exchange/status_masks.py",
        old="        self.counts.zero_()\n",
        new="",
        tests=("tests/test_replay_tally.py", "tests/test_cuda_graphs.py", "-k", "check or tally or read"),
    ),
    # ---- rollback: dmuon/state/rollback.py, dmuon/step/phases.py
    Mutant(
        name="masked-step-counters-not-taken-back",
        guarantee=NOTHING_CHANGES + " (the AdamW step counters torch keeps on the host)",
        path="dmuon/state/rollback.py",
        old="            counter.sub_(1)",
        new="            counter.sub_(0)",
        tests=(SKIP_TESTS,),
    ),
    Mutant(
        name="masked-step-state-kept",
        guarantee=NOTHING_CHANGES + " (the state a masked step made for a first grad)",
        path="dmuon/state/rollback.py",
        old="                entry.pop(key, None)",
        new="                entry.get(key, None)",
        tests=(SWEEP_SKIPS,),
    ),
    Mutant(
        name="settle-forgets-the-undo",
        guarantee="a checkpoint written after a skipped step holds the state of a run that never took it",
        path="dmuon/state/optimizer_hooks.py",
        old="    if phases.grad_status.settle():\n        phases.rollback.undo()",
        new="    if phases.grad_status.settle():\n        pass",
        tests=(SKIP_TESTS,),
    ),
    # ---- state loading and dtypes: dmuon/state/loading.py, dmuon/options/device_hyperparameters.py
    Mutant(
        name="saved-momentum-dtype-not-kept",
        guarantee="a resume is bitwise the uninterrupted run (Muon's state keeps its saved dtype)",
        path="dmuon/state/loading.py",
        old="if isinstance(value, torch.Tensor) and value.dtype != optimizer.state[param][key].dtype:",
        new="if False:",
        tests=("tests/test_state_loading.py",),
    ),
    Mutant(
        name="loaded-state-not-copied-into-captured-tensors",
        guarantee="load_state_dict on a captured optimizer reaches the graph",
        path="dmuon/state/loading.py",
        old="                old.copy_(new)\n",
        new="",
        tests=("tests/test_cuda_graphs.py", "-k", "load_state_dict"),
    ),
    Mutant(
        name="loaded-lr-not-copied-into-the-groups-tensor",
        guarantee="a capturable group keeps its lr tensor through a load, holding the loaded value",
        path="dmuon/options/device_hyperparameters.py",
        old="                    before.copy_(loaded.detach().reshape(()))",
        new="                    pass",
        tests=("tests/test_capturable.py", "-k", "load or checkpoint"),
    ),
    # ---- capturable scalars and their dtypes: dmuon/numerics/device_scalars.py, update_rules.py
    Mutant(
        name="keep-made-in-fp32-then-widened",  # survivor 2
        guarantee="capturable=True steps with the bits of capturable=False (the products are the host's numbers)",
        path="dmuon/numerics/device_scalars.py",
        old="lambda: 1 - lr * weight_decay)",
        new="lambda: (1 - lr.float() * weight_decay.float()).double())",
        tests=("tests/test_device_scalars.py", "-k", "products"),
    ),
    Mutant(
        name="alpha-read-in-fp32-by-narrow-cpu-targets",
        guarantee="capturable=True steps with the bits of capturable=False (add_'s alpha read as add_ reads it)",
        path="dmuon/numerics/update_rules.py",
        old='    if device_type == "cpu" and dtype in (torch.bfloat16, torch.float16):',
        new="    if False:",
        tests=("tests/test_capturable.py", "-k", "alpha or scaled_add"),
    ),
    Mutant(
        name="capturable-masked-decay-unmasked",  # survivor 1
        guarantee="skip_nonfinite under capturable: a skipped step decays no parameter",
        path="dmuon/numerics/update_rules.py",
        old="    if ok is not None:\n        return scalars.masked(keep, opmath, ok), False",
        new="    if ok is not None and not capturable:\n        return scalars.masked(keep, opmath, ok), False",
        tests=(SKIP_TESTS, "-k", "capturable"),
    ),
    Mutant(
        name="capturable-step-reads-weight-decay-on-the-host",
        guarantee="a capturable step reads no hyperparameter on the host (a comparison's bool included)",
        path="dmuon/numerics/update_rules.py",
        old="    keep = keep_factor(lr, weight_decay, scalars, capturable)",
        new=("    if capturable and bool(weight_decay == 0):  # skip the decay at 0, as the float step does\n"
             "        weight_decay = torch.zeros_like(weight_decay)\n"
             "    keep = keep_factor(lr, weight_decay, scalars, capturable)"),
        tests=("tests/test_capturable.py", "-k", "reads_no_hyperparameter"),
    ),
    Mutant(
        name="fp64-parameters-decay-in-fp32",
        guarantee="DMuon's update equals torch.optim.Muon's bit for bit (an fp64 parameter's decay in fp64)",
        path="dmuon/numerics/update_rules.py",
        old="    opmath = torch.float64 if dtype in (torch.float64, torch.complex128) else torch.float32",
        new="    opmath = torch.float32",
        tests=("tests/test_device_scalars.py", "-k", "fp64"),
    ),
    Mutant(
        name="a-cast-reused-for-another-dtype",
        guarantee="capturable=True steps with the bits of capturable=False for parameters of every dtype",
        path="dmuon/numerics/device_scalars.py",
        old='("cast", id(value), dtype)',
        new='("cast", id(value))',
        tests=("tests/test_capturable.py", "tests/test_device_scalars.py"),
    ),
    # ---- skip counting: dmuon/numerics/finite.py
    Mutant(
        name="finite-judged-by-a-sum-of-squares",
        guarantee="skip_nonfinite skips a step for a NaN or inf only, never for a large finite grad",
        path="dmuon/numerics/finite.py",
        old='ord=float("inf")',
        new="ord=2",
        tests=(SKIP_TESTS, "-k", "huge"),
    ),
    # ---- foreach=False: dmuon/numerics/adamw_rules.py
    Mutant(
        name="capturable-adamw-decay-takes-list-ops-without-foreach",  # survivor 5
        guarantee="foreach=False runs no list op (capturable included)",
        path="dmuon/numerics/adamw_rules.py",
        old="decay_(plain, keep, foreach is not False, scalars,",
        new="decay_(plain, keep, True, scalars,",
        tests=("tests/test_capturable.py", "-k", "foreach_false"),
    ),
    # ---- TorchTitan's field checks: torchtitan_ext/titan02/validation.py
    Mutant(
        name="capture-step-left-out-of-the-flag-checks",  # survivor 6
        guarantee='a bad TOML value is refused at parse time naming the field (capture_step = "false")',
        path="torchtitan_ext/titan02/validation.py",
        old='"early_step_in_backward",\n               "capture_step")',
        new='"early_step_in_backward")',
        tests=("tests/test_torchtitan_field_checks.py", "-k", "capture_step"),
    ),
    # ---- QK-clip's order: dmuon/step/phases.py
    Mutant(
        name="qk-clip-before-the-update",
        guarantee="QK-clip scales the weights after the step's update lands (Kimi K2's order)",
        path="dmuon/step/phases.py",
        old=("        phases.scratch_stats.reset_peak()\n"
             "        phases.fast_path.step(grads, status, self.muon_groups, state, steps, phases.comm_stats, "
             "phases.scratch_stats)\n"
             "        steps.muon_off_the_fast_path(self.param_groups, phases.paths(self.param_groups, self.name_of), "
             "grads, status,\n"
             "                                     state)\n"
             "        step_ok = None if status.mask is StepMask.STANDS else status.step_ok\n"
             "        if clip := phases.attention_clip.step(checked.thresholds, step_ok):\n"
             "            telemetry.qk_clip(clip.largest, clip.clipped_heads)\n"),
        new=("        step_ok = None if status.mask is StepMask.STANDS else status.step_ok\n"
             "        if clip := phases.attention_clip.step(checked.thresholds, step_ok):\n"
             "            telemetry.qk_clip(clip.largest, clip.clipped_heads)\n"
             "        phases.scratch_stats.reset_peak()\n"
             "        phases.fast_path.step(grads, status, self.muon_groups, state, steps, phases.comm_stats, "
             "phases.scratch_stats)\n"
             "        steps.muon_off_the_fast_path(self.param_groups, phases.paths(self.param_groups, self.name_of), "
             "grads, status,\n"
             "                                     state)\n"),
        tests=("tests/test_qk_clip.py", "-k", "after_the_update"),
    ),
    # ---- the captured step: dmuon/capture/replay_guard.py, dmuon/capture/cuda_graphs.py
    Mutant(
        name="replay-guard-compares-identity-only",
        guarantee="a replay never reads a grad or state tensor other than the captured one (new storage included)",
        path="dmuon/capture/replay_guard.py",
        old="if tensor_now is not tensor or where_now != where or _storage(tensor_now) != storage:",
        new="if tensor_now is not tensor or where_now != where:",
        tests=("tests/test_cuda_graphs.py", "-k", "replay_after_a_change"),
    ),
    Mutant(
        name="number-lr-between-replays-not-copied-in",
        guarantee="a number written to lr between replays reaches the graph",
        path="dmuon/capture/replay_guard.py",
        old="                    tensor.fill_(float(value))",
        new="                    pass",
        tests=("tests/test_cuda_graphs.py", "-k", "number_written"),
    ),
    Mutant(
        name="number-lr-left-on-the-host-for-the-capture",
        guarantee="a number written to lr before the capture never fails it",
        path="dmuon/capture/cuda_graphs.py",
        old="        place_on_device(self.optimizer.param_groups)\n",
        new="",
        tests=("tests/test_cuda_graphs.py", "-k", "number_written"),
    ),
    Mutant(
        name="raising-warm-up-leaves-the-side-stream-unjoined",
        guarantee="a warm-up step that raises leaves no kernel racing the caller's stream",
        path="dmuon/capture/cuda_graphs.py",
        old="            torch.cuda.current_stream().wait_stream(side)\n        self.eager_steps += 1",
        new="            pass\n        torch.cuda.current_stream().wait_stream(side)\n        self.eager_steps += 1",
        tests=("tests/test_cuda_graphs.py", "-k", "side_stream"),
    ),
    # ---- the TOML front end's parse-time checks and recipes (issue 61): torchtitan_ext/
    Mutant(
        name="interval-ignores-its-open-upper-end",  # survived the suite before issue 61
        guarantee="a number outside its field's interval is refused at parse time by that field's check, "
                  "naming the field as the TOML writes it (a beta of 1.0 included)",
        path="torchtitan_ext/field_checks.py",
        old="below = value < self.high if self.high_open else value <= self.high",
        new="below = value <= self.high",
        tests=("tests/test_torchtitan_field_bounds.py",),
    ),
    Mutant(
        name="8b-recipe-float8-line-names-an-unregistered-converter",
        guarantee="the 8B recipe's float8 line, uncommented, starts a job on TorchTitan 0.2.x",
        path="train_configs/llama3_8b_dmuon.toml",
        old='# converters = ["quantize.linear.float8"]',
        new='# converters = ["float8"]',
        tests=("tests/test_torchtitan_switches.py", "-m", "unit"),
    ),
    Mutant(
        name="max-logit-hook-keyed-by-attention-name",
        guarantee="a model of any depth compiled per block with QK-clip compiles the block once (TorchTitan's "
                  "fullgraph=True fails at the 9th recompile)",
        path="torchtitan_ext/titan02/max_logits.py",
        old="tracker.observe_into(slot, q, k, head_offset=tp_rank * local_heads, scale=kwargs.get(\"scale\"), **mask)",
        new="tracker.observe(str(id(slot)), q, k, n_heads=slot.numel(), head_offset=tp_rank * local_heads, "
            "scale=kwargs.get(\"scale\"), **mask)",
        tests=("tests/test_torchtitan_switches.py", "-m", "unit"),
    ),
]

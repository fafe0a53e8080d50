"""The mutants over the replicated-grad sum, QK-clip, the owner plan and exchange, state
loading and the resume contract, TorchTitan's field checks, the implementation flags,
Newton-Schulz and the update rules, and the grad and option checks (issue 52);
tests/mutants/__init__.py says what a mutant is."""

from __future__ import annotations

from tests.mutants import Mutant

WIDE = [
    # ------------------------------------------------ the replicated-grad sum (dmuon/exchange/replicated_grads.py)
    Mutant(
        name="replicated-sum-sends-every-rank",
        guarantee="A replicated grad of a parameter replicated on every mesh dim is sent by the dim's first rank "
                  "only (-0.0 from the others), so its sum is its own bits, as DTensor's own sum gives them.",
        path="dmuon/exchange/replicated_grads.py",
        old="if not isinstance(kind, Partial) and coordinate[dim] != 0:",
        new="if kind is None and coordinate[dim] != 0:",
        tests=("tests/test_bad_input_regressions.py::"
               "test_a_replicated_parameters_partial_grad_steps_bitwise_like_dtensors_own_sum[2]",),
    ),
    Mutant(
        name="replicated-sum-reduces-the-callers-grad-in-place",
        guarantee="Summing a replicated parameter's Partial grad leaves the caller's grad as it was (the sum is "
                  "made in a copy), so the step has DTensor's own sum's bits.",
        path="dmuon/exchange/replicated_grads.py",
        old="value = local_of(grad).clone()  # the caller's grad stays as it was",
        new="value = local_of(grad)",
        tests=("tests/test_bad_input_regressions.py::"
               "test_a_replicated_parameters_partial_grad_steps_bitwise_like_dtensors_own_sum[2]",),
    ),
    # ------------------------------------------------ QK-clip (dmuon/attention)
    Mutant(
        name="qk-clip-mha-factor-not-split-by-sqrt",
        guarantee="Multi-head attention: sqrt(gamma_h) on the head's rows of W_q and of W_k, so a clipped "
                  "head's logit lands on the threshold (docs/optimizer.md, QK-clip).",
        path="dmuon/attention/qk_clip.py",
        old="q_head = k_head = gamma.sqrt()",
        new="q_head = k_head = gamma",
        tests=("tests/test_qk_clip.py::test_multi_head_attention_splits_the_factor_between_q_and_k",
               "tests/test_qk_clip.py::test_with_a_zero_step_every_clipped_head_lands_on_the_threshold"),
    ),
    Mutant(
        name="qk-clip-scales-rows-of-the-wrong-heads",
        guarantee="Each head's factor scales that head's block of head_dim rows of W_q / W_k, and heads at or "
                  "under the threshold keep their bits.",
        path="dmuon/attention/qk_clip.py",
        old="q_rows = q_head.repeat_interleave(heads.head_dim)",
        new="q_rows = q_head.repeat(heads.head_dim)",
        tests=("tests/test_qk_clip.py::test_multi_head_attention_splits_the_factor_between_q_and_k",
               "tests/test_qk_clip.py::test_grouped_query_attention_scales_queries_only",
               "tests/test_qk_clip.py::test_heads_under_the_threshold_step_bit_for_bit_as_without_clip"),
    ),
    Mutant(
        name="max-logits-count-evaluation-forwards",
        guarantee="QK-clip measures the training step's logits: forwards under no_grad (evaluation) are not "
                  "counted (docs/optimizer.md, QK-clip, Measuring).",
        path="dmuon/attention/max_logits.py",
        old="return self.enabled and torch.is_grad_enabled()",
        new="return self.enabled",
        tests=("tests/test_qk_clip.py::test_evaluation_forwards_are_not_counted",),
    ),
    # ------------------------------------------------ the owner plan and exchange (dmuon/plan, dmuon/exchange)
    Mutant(
        name="owners-balance-matrix-count-not-flops",
        guarantee="Each matrix's owner is chosen over all ranks so every rank carries the same Newton-Schulz "
                  "cost: longest-processing-time by flops over the whole step.",
        path="dmuon/plan/owners.py",
        old="loads[rank] += costs[index]",
        new="loads[rank] += 1",
        tests=("tests/test_plan.py::test_assign_owners_is_longest_processing_time_first",
               "tests/test_plan.py::test_assign_owners_balances_loads_within_one_largest_cost",
               "tests/test_plan.py::test_assign_owners_starts_from_the_loads_ranks_already_carry"),
    ),
    Mutant(
        name="gather-receive-read-by-unit-not-by-source",
        guarantee="The owner rebuilds exactly the bf16 matrix a single process would hold: the gather's receive "
                  "buffer is cut by source rank, then batch order, as all_to_all_single lays it out.",
        path="dmuon/plan/pack_layout.py",
        old="recv = [(i, s) for s in range(plan.world_size) for i in in_batch_order if units[i].is_source(s)]",
        new="recv = [(i, s) for i in in_batch_order for s in range(plan.world_size) if units[i].is_source(s)]",
        tests=("tests/test_comm_packing.py::test_gather_gives_each_owner_exactly_its_whole_matrices",
               "tests/test_comm_packing.py::test_scatter_gives_each_holder_exactly_its_block_of_the_results"),
    ),
    Mutant(
        name="column-block-placed-at-column-zero",
        guarantee="Column-sharded weights (TP's Shard(1)) travel as blocks placed at their offset in the whole "
                  "matrix, so the owner sees a single process's matrix and each holder gets its block back.",
        path="dmuon/exchange/packing.py",
        old="return matrix[row : row + rows, col : col + cols]",
        new="return matrix[row : row + rows, :cols]",
        tests=("tests/test_comm_packing.py::test_gather_gives_each_owner_exactly_its_whole_matrices",
               "tests/test_comm_packing.py::test_scatter_gives_each_holder_exactly_its_block_of_the_results"),
    ),
    Mutant(
        name="gather-sends-blocks-in-fp32",
        guarantee="Blocks travel to the owner in bf16 (4 N (P-1) / P^2 bytes per rank), the bf16 matrix a "
                  "single process would orthogonalize.",
        path="dmuon/exchange/packing.py",
        old="send = out if out is not None else track(meter, torch.empty(total, dtype=WIRE_DTYPE, device=device))",
        new="send = out if out is not None else track(meter, torch.empty(total, dtype=torch.float32, device=device))",
        tests=("tests/test_comm_packing.py::test_rank_with_no_rows_and_no_owned_matrix_sends_and_receives_nothing",
               "tests/test_comm_packing.py::test_gather_gives_each_owner_exactly_its_whole_matrices"),
    ),
    Mutant(
        name="gather-splits-count-every-replica-as-a-source",
        guarantee="Under HSDP only the owner's replica sends its blocks (exactly one copy of every element "
                  "reaches the owner); every replica receives the result.",
        path="dmuon/plan/owner_plan.py",
        old="if mine(unit) and unit.in_owner_replica(rank):",
        new="if mine(unit):",
        tests=("tests/test_comm_packing.py", "tests/test_plan_answers.py", "-k", "2x2 or split or apart"),
    ),
    # ------------------------------------------------ state_dict, copies, the resume contract
    Mutant(
        name="copy-keeps-torchs-differentiable-default",
        guarantee="A deep copy or pickle of a DMuon keeps torch's state and DMuon's configuration, its defaults "
                  "still the keys a group may set, and steps bitwise like the original (as torch optimizers do).",
        path="dmuon/state/pickling.py",
        old="        self.defaults.pop(\"differentiable\", None)\n",
        new="",
        tests=("tests/test_torch_optim_contract.py::"
               "test_copied_optimizer_steps_bitwise_like_the_original_as_torch_optimizers_do",),
    ),
    Mutant(
        name="pickle-leaves-out-the-flags-the-table-derives",
        guarantee="What a copy or pickle keeps is derived from the option table: every whole-optimizer option and "
                  "torch's flags that have a path (foreach, fused, capturable), so a copy steps as the original.",
        path="dmuon/options/table.py",
        old="    o.scope is Scope.OPTIMIZER or (o.scope is Scope.FLAG and o.check is not _no_path)))",
        new="    o.scope is Scope.OPTIMIZER))",
        tests=("tests/test_torch_optim_contract.py::"
               "test_copied_optimizer_steps_bitwise_like_the_original_as_torch_optimizers_do",),
    ),
    Mutant(
        name="resume-accepts-normuon-toggled",
        guarantee="Options that decide the state's layout (use_muon, normuon, split_rows) are refused on resume "
                  "before anything loads, naming the key.",
        path="dmuon/options/table.py",
        old="Option(\"normuon\", False, Scope.MUON, c.check_bool, OnResume.REFUSED,",
        new="Option(\"normuon\", False, Scope.MUON, c.check_bool, OnResume.APPLIED,",
        tests=("tests/test_resume_contract.py::"
               "test_turning_normuon_on_or_off_is_refused_naming_the_key_before_anything_loads",
               "tests/test_resume_contract.py::test_a_copy_keeps_the_contract"),
    ),
    Mutant(
        name="resume-scales-scheduled-lr-by-old-over-new",
        guarantee="Under an LR scheduler a changed initial lr scales the saved lr by new / old, so the schedule "
                  "keeps its place.",
        path="dmuon/state/resume_contract.py",
        old="group[LR] = saved[LR] * (new / old) if old else mine[LR]",
        new="group[LR] = saved[LR] * (old / new) if old else mine[LR]",
        tests=("tests/test_resume_contract.py::"
               "test_under_a_scheduler_a_changed_initial_lr_scales_the_saved_lr_and_keeps_the_schedule",),
    ),
    # ------------------------------------------------ TorchTitan's field checks and resume checks (torchtitan_ext)
    Mutant(
        name="field-number-check-lets-infinity-through",
        guarantee="Each [optimizer] number field is a finite number in its range, refused at parse time naming "
                  "the field as the TOML spells it (adamw_lr = inf).",
        path="torchtitan_ext/field_checks.py",
        old="if not (is_number(value) and math.isfinite(value) and value in interval):",
        new="if not (is_number(value) and value in interval):",
        tests=("tests/test_torchtitan_field_checks.py::"
               "test_a_bad_toml_value_is_refused_at_parse_time_naming_the_field_as_written",),
    ),
    Mutant(
        name="field-flag-check-takes-numbers",
        guarantee="An on/off [optimizer] field takes a TOML boolean only: a string or a number such as 1 is "
                  "refused at parse time, not read by its truthiness.",
        path="torchtitan_ext/field_checks.py",
        old="if not isinstance(value, bool):",
        new="if isinstance(value, str):",
        tests=("tests/test_torchtitan_field_checks.py::"
               "test_a_bad_toml_value_is_refused_at_parse_time_naming_the_field_as_written",),
    ),
    Mutant(
        name="routing-check-misses-muon-to-adamw-moves",
        guarantee="Resuming after adamw_param_regex moved parameters between Muon and AdamW is refused before "
                  "DCP loads, naming the parameters that moved (docs/torchtitan.md, changing options on resume).",
        path="torchtitan_ext/titan02/routing_check.py",
        old="if name in saved and saved[name] != muon}",
        new="if name in saved and muon and not saved[name]}",
        tests=("tests/test_torchtitan_container.py::"
               "test_resuming_after_changing_adamw_param_regex_names_the_moved_parameters",),
    ),
    # ------------------------------------------------ foreach, fused and the per-tensor forms
    Mutant(
        name="adamw-group-foreach-loses-to-the-optimizers",
        guarantee="A group's foreach wins over the optimizer's, as torch reads group['foreach']: foreach=False "
                  "steps that group's AdamW part one tensor at a time.",
        path="dmuon/step/adamw_part.py",
        old="foreach = group.get(\"foreach\", foreach)",
        new="foreach = foreach if foreach is not None else group.get(\"foreach\")",
        tests=("tests/test_implementation_flags.py::"
               "test_a_groups_foreach_false_steps_its_adamw_part_one_tensor_at_a_time",),
    ),
    Mutant(
        name="adamw-part-drops-fused",
        guarantee="fused=True steps the AdamW part with torch's fused AdamW kernel (the torch AdamW path its "
                  "flags name, with torch AdamW's bits).",
        path="dmuon/numerics/adamw_rules.py",
        old="fused=fused, has_complex",
        new="fused=None, has_complex",
        tests=("tests/test_implementation_flags.py::test_the_adamw_part_runs_the_torch_adamw_path_its_flags_name",),
    ),
    Mutant(
        name="per-tensor-apply-skips-the-last-tensor",
        guarantee="The for-loop form of Muon's apply (foreach=False) gives every tensor the bits the list form "
                  "gives it.",
        path="dmuon/numerics/update_rules.py",
        old="                for param, ortho in zip(ps, us):\n                    param.add_(ortho, alpha=alpha)",
        new="                for param, ortho in zip(ps[:-1], us):\n                    param.add_(ortho, alpha=alpha)",
        tests=("tests/test_update_lists.py::test_the_update_as_list_ops_is_bitwise_the_per_tensor_rule",
               "tests/test_update_lists.py::test_dmuon_with_foreach_steps_the_bits_of_dmuon_without"),
    ),
    Mutant(
        name="foreach-false-lookahead-takes-a-list-op",
        guarantee="foreach=False runs every update rule per tensor: no torch._foreach_* rule on the Muon "
                  "parameters' path.",
        path="dmuon/numerics/update_rules.py",
        old="    if not (foreach and nesterov):",
        new="    if not nesterov:",
        tests=("tests/test_bad_input_regressions.py::test_foreach_false_runs_every_update_rule_per_tensor",),
    ),
    # ------------------------------------------------ Newton-Schulz and the update rules (dmuon/numerics)
    Mutant(
        name="ns-polynomial-coefficients-swapped",
        guarantee="The 2-D standard Newton-Schulz is torch.optim.Muon's quintic iteration, bit for bit "
                  "(X <- a X + (b S + c S S) X).",
        path="dmuon/numerics/standard_iteration.py",
        old="beta=b, alpha=c)",
        new="beta=c, alpha=b)",
        tests=("tests/test_newton_schulz.py::test_2d_result_is_bitwise_torch_optim_muon_newton_schulz",
               "tests/test_newton_schulz.py::test_singular_values_of_result_lie_near_one"),
    ),
    Mutant(
        name="ns-tall-matrix-not-transposed",
        guarantee="A tall matrix is orthogonalized in its wide orientation, as the transpose of its wide form "
                  "(torch.optim.Muon's bits).",
        path="dmuon/numerics/newton_schulz.py",
        old="tall = update.size(0) > update.size(1)",
        new="tall = False",
        tests=("tests/test_newton_schulz.py::test_tall_input_is_orthogonalized_as_the_transpose_of_its_wide_form",
               "tests/test_newton_schulz.py::test_2d_result_is_bitwise_torch_optim_muon_newton_schulz"),
    ),
    Mutant(
        name="shape-scale-original-uses-cols-over-rows",
        guarantee="adjust_lr='original' scales the update by sqrt(max(1, A / B)) for an A x B matrix "
                  "(torch.optim.Muon's default).",
        path="dmuon/numerics/update_rules.py",
        old="return math.sqrt(max(1, rows / cols))",
        new="return math.sqrt(max(1, cols / rows))",
        tests=("tests/test_update_rules.py::test_shape_scale",
               "tests/test_update_rules.py::test_every_advertised_adjust_lr_choice_gives_its_documented_scale"),
    ),
    Mutant(
        name="nesterov-lookahead-operands-swapped",
        guarantee="With Nesterov Muon orthogonalizes lerp(G, buf, momentum), torch.optim.Muon's look-ahead.",
        path="dmuon/numerics/update_rules.py",
        old="[grad.lerp(buf, momentum) if nesterov else buf for",
        new="[buf.lerp(grad, momentum) if nesterov else buf for",
        tests=("tests/test_update_rules.py::test_muon_momentum_with_nesterov_matches_hand_formula",
               "tests/test_update_lists.py::test_lookahead_of_a_list_is_bitwise_the_per_tensor_rule"),
    ),
    # ------------------------------------------------ the grad checks and options validation
    Mutant(
        name="grad-check-compares-ndim-not-shape",
        guarantee="A grad whose shape differs from its parameter's is a problem: the step raises ValueError "
                  "naming the parameter and both shapes, and changes nothing.",
        path="dmuon/step/grad_checks.py",
        old="    if grad.shape != param.shape:\n",
        new="    if grad.ndim != param.ndim:\n",
        tests=("tests/test_validation.py::test_grad_shape_mismatch_in_muon_is_rejected_at_step",),
    ),
    Mutant(
        name="ns-steps-upper-bound-inclusive",
        guarantee="ns_steps must be an int in [1, 100) (torch.optim.Muon refuses 100 or more): ValueError at "
                  "construction naming the option.",
        path="dmuon/options/checks.py",
        old="not 1 <= value < MAX_NS_STEPS",
        new="not 1 <= value <= MAX_NS_STEPS",
        tests=("tests/test_validation.py::test_bad_optimizer_option_is_rejected_naming_it",),
    ),
    # ------------------------------------------------ low-precision momentum (dmuon/numerics/momentum_storage.py)
    Mutant(
        name="int8-momentum-without-its-scale",
        guarantee="An int8 momentum block is rounded in units of its scale (absmax / 127), so what the next step "
                  "reads is within half a step of the EMA (issue 51).",
        path="dmuon/numerics/momentum_storage.py",
        old="divisor = torch.where(scales > 0, scales, int8_max)",
        new="divisor = torch.ones_like(scales)",
        tests=("tests/test_momentum_storage.py::test_dequantized_values_are_within_half_a_step_of_the_input",),
    ),
    Mutant(
        name="int8-momentum-blocks-cross-rows",
        guarantee="int8 momentum blocks lie inside rows, so a rank's rows (any Shard(0) split, empty ones included) "
                  "quantize to the bits of the whole matrix (issue 51).",
        path="dmuon/numerics/momentum_storage.py",
        old="    return x.reshape(x.shape[0], row_length(x.shape)) if x.ndim > 3 else x",
        new="    return x.reshape(1, -1)",
        tests=("tests/test_momentum_storage.py::test_a_ranks_rows_quantize_to_the_bits_of_the_whole_matrix",),
    ),
    Mutant(
        name="masked-momentum-store-rounds-again",
        guarantee="A masked or skipped step keeps int8 momentum's values and scales bit for bit: they are "
                  "selected, not quantized again (issue 51).",
        path="dmuon/numerics/momentum_storage.py",
        old="    if oks is None:\n        for dtype in {t.dtype for t in targets}:",
        new="    if True:\n        for dtype in {t.dtype for t in targets}:",
        tests=("tests/test_momentum_storage.py::test_a_masked_store_keeps_the_values_and_scales_bit_for_bit",),
    ),
    Mutant(
        name="int8-momentum-kept-off-the-blocks",
        guarantee="Where a layout cuts rows off int8's 128-element blocks (TP's Shard(1) at an odd width), the "
                  "parameter's momentum is kept in bf16, so the run stays bitwise a single process's (issue 51).",
        path="dmuon/state/kept_state.py",
        old="    if isinstance(param, DTensor) and not int8_blocks_whole(layout_of(param), param.shape):",
        new="    if False and isinstance(param, DTensor) and not int8_blocks_whole(layout_of(param), param.shape):",
        tests=("tests/test_momentum_dtype_ranks.py::"
               "test_int8_momentum_is_kept_in_bf16_exactly_where_a_layout_cuts_rows_off_the_blocks",),
    ),
    Mutant(
        name="momentum-not-converted-on-resume",
        guarantee="A checkpoint saved with another momentum_dtype is converted on load: the run goes on in the "
                  "form its optimizer asks for, from the momentum the checkpoint held (issue 51).",
        path="dmuon/state/kept_state.py",
        old="            if held == wanted:",
        new="            if True:",
        tests=("tests/test_momentum_dtype.py::test_an_int8_checkpoint_resumed_without_it_reads_the_momentum_it_held",),
    ),
    Mutant(
        name="unpacked-converted-momentum-skips-its-ema",
        guarantee="A low-precision momentum's blocks that a rank holds but never packs (HSDP's replica outside the "
                  "owner's, Newton-Schulz split across replicas) still take their EMA each step (issue 59, item 2).",
        path="dmuon/step/fast_path.py",
        old="        self.converted.unpacked(run.unpacked_units(), self.grad_blocks)\n",
        new="",
        tests=("tests/test_momentum_dtype_ranks.py::"
               "test_a_replica_that_never_sends_a_block_still_updates_its_momentum",),
    ),
    Mutant(
        name="momentum-read-whole-off-the-fast-path",
        guarantee="Off the fast path a low-precision momentum is read, updated and stored a chunk at a time, "
                  "so its parameter-dtype copies never hold more than one chunk (issue 59, item 2).",
        path="dmuon/state/kept_state.py",
        old="    if all(read_as_itself(kept_momentum(state, keys), like)",
        new="    if True or all(read_as_itself(kept_momentum(state, keys), like)",
        tests=("tests/test_momentum_working_copies.py::"
               "test_plain_tensors_momenta_are_read_a_chunk_at_a_time_and_none_is_kept",),
    ),
    Mutant(
        name="int8-scale-by-reciprocal-product",
        guarantee="Every int8 scale is the true quotient max|x| / 127, correctly rounded in fp32, on every device "
                  "(not x * (1 / 127), CUDA's form for a divisor given as a Python number), so a GPU's scales "
                  "have the CPU's bits (issue 59, item 1).",
        path="dmuon/numerics/momentum_storage.py",
        old="torch.div(maxima, int8_max, out=scales)",
        new="torch.mul(maxima, torch.tensor(1.0) / INT8_MAX, out=scales)",
        tests=("tests/test_momentum_storage.py::"
               "test_int8_scales_are_the_true_quotient_where_a_reciprocal_product_is_an_ulp_off",),
    ),
    Mutant(
        name="int8-zero-scale-block-not-rounded-to-zero",
        guarantee="An int8 block whose scale is 0 (zeros, or subnormals whose max / 127 underflows) stores "
                  "zeros, as the formula's 0 where the scale is 0 says (issue 59, item 5).",
        path="dmuon/numerics/momentum_storage.py",
        old="divisor = torch.where(scales > 0, scales, int8_max)",
        new="divisor = scales",
        tests=("tests/test_momentum_storage.py::test_a_block_whose_scale_underflows_to_zero_reads_back_zeros",),
    ),
    Mutant(
        name="int8-quotient-not-clamped",
        guarantee="int8 values stay in [-127, 127] where a subnormal scale lets max|x| / scale pass 127 "
                  "(issue 59, item 5: the clamp is one of the four passes, not a no-op).",
        path="dmuon/numerics/momentum_storage.py",
        old="    sums.clamp_(_ROUNDING_MAGIC - INT8_MAX, _ROUNDING_MAGIC + INT8_MAX)\n",
        new="",
        tests=("tests/test_momentum_storage.py::test_int8_values_and_scales_have_the_plain_formulas_bits",),
    ),
    # ------------------------------------------------ every shape, order and layout (issue 60)
    Mutant(
        name="empty-first-shard-opens-no-chunk",
        guarantee="An empty local shard first in a list (a matrix with fewer rows than ranks) steps like any "
                  "other with foreach=True (issue 60, item 2).",
        path="dmuon/numerics/update_rules.py",
        old="        if not chunks or (chunks[-1] and size + numel > limit):",
        new="        if size + numel > limit or not chunks and numel:",
        tests=("tests/test_update_lists.py::test_a_masked_momentum_list_with_empty_tensors_first_in_each_dtype_steps",),
    ),
    Mutant(
        name="fast-path-keeps-its-last-working-copies",
        guarantee="Nothing of a low-precision momentum's read outlives its pack chunk: at rest only the store "
                  "is left (issue 60, item 1).",
        path="dmuon/step/converted_momenta.py",
        old="            for k, momentum in zip(todo, work):\n                momenta[k] = momentum",
        new="            self.last_working = work\n            for k, momentum in zip(todo, work):\n"
            "                momenta[k] = momentum",
        tests=("tests/test_momentum_working_copies.py::"
               "test_the_fast_path_reads_a_pack_chunk_at_a_time_and_keeps_no_working_copy",),
    ),
    Mutant(
        name="four-d-momentum-blocked-along-its-last-dim",
        guarantee="A 4-D weight's int8 momentum is blocked along the rows of its [O, rest] matrix: 1.031 bytes "
                  "an element, not a scale per kernel row (issue 60, item 5).",
        path="dmuon/numerics/momentum_storage.py",
        old="    if len(shape) > 3:\n        return math.prod(shape[1:])",
        new="    if len(shape) > 99:\n        return math.prod(shape[1:])",
        tests=("tests/test_momentum_storage.py::test_a_4d_weight_is_blocked_along_the_rows_of_its_o_by_rest_matrix",),
    ),
    Mutant(
        name="int8-fallback-misses-a-stack-cut-on-its-last-dim",
        guarantee="A 3-D stack whose layout cuts its rows off the blocks keeps bf16 momentum, as a matrix does "
                  "(issue 60: a survivor of the tests before it).",
        path="dmuon/plan/momentum_blocks.py",
        old="    return bool(dims & {ndim - 1, -1})",
        new="    return bool(dims & {1, -1})",
        tests=("tests/test_momentum_blocks.py",),
    ),
    Mutant(
        name="four-d-cut-inside-a-row-kept-in-int8",
        guarantee="A 4-D weight cut inside its [O, rest] rows keeps bf16 momentum (issue 60, item 5).",
        path="dmuon/plan/momentum_blocks.py",
        old="        return any(d != 0 for d in dims)",
        new="        return bool(dims & {ndim - 1, -1})",
        tests=("tests/test_momentum_blocks.py",),
    ),
    Mutant(
        name="resume-conversion-aims-at-the-groups-dtype",
        guarantee="A load converts each momentum to the form its layout keeps (the bf16 fallback where a layout "
                  "cuts rows off the blocks), not to the group's momentum_dtype (issue 60: a survivor).",
        path="dmuon/state/kept_state.py",
        old="        return [(MOMENTUM, storage_of(param, group[\"momentum_dtype\"]))]",
        new="        return [(MOMENTUM, group[\"momentum_dtype\"])]",
        tests=("tests/test_momentum_dtype_ranks.py::"
               "test_a_plain_resume_on_the_same_layout_keeps_the_fallbacks_bf16_momentum",),
    ),
    Mutant(
        name="masked-read-misaligns-its-masks",
        guarantee="A masked read keeps each mask with its momentum when some parameters have no state yet "
                  "(issue 60: a survivor).",
        path="dmuon/state/kept_state.py",
        old="None if oks is None else [oks[i] for i in kept], keys.root)",
        new="None if oks is None else list(oks)[: len(kept)], keys.root)",
        tests=("tests/test_momentum_dtype.py::"
               "test_a_masked_read_keeps_each_mask_with_its_momentum_when_some_have_no_state_yet",),
    ),
    Mutant(
        name="momentum-dtype-from-the-checkpoint-on-resume",
        guarantee="On resume the optimizer's momentum_dtype applies, not the checkpoint's, and the momentum is "
                  "converted to it (issue 60: a survivor).",
        path="dmuon/options/table.py",
        old="o.key for o in OPTIONS if o.on_resume in (OnResume.APPLIED, OnResume.CONVERTED)))",
        new="o.key for o in OPTIONS if o.on_resume in (OnResume.APPLIED,)))",
        tests=("tests/test_momentum_dtype.py::test_a_float32_checkpoint_resumed_with_int8_rounds_its_momentum_once",),
    ),
    Mutant(
        name="edited-momentum-dtype-not-checked",
        guarantee="A group's momentum_dtype edited between steps is checked at the next step: refused by name, "
                  "or applied with the momentum converted (issue 60, item 6).",
        path="dmuon/step/phases.py",
        old="        self.momentum_dtypes.check(param_groups, state, name_of)\n",
        new="",
        tests=("tests/test_momentum_dtype.py", "-k", "edited"),
    ),
    Mutant(
        name="bf16-apply-rounds-by-position",
        guarantee="A bf16 parameter's row shards get the whole matrix's update bits: no element's rounding "
                  "depends on where it sits in the local tensor (issue 60, item 3: CPU add_'s scalar loop).",
        path="dmuon/numerics/update_rules.py",
        old="        if not (capturable or (ps[0].device.type == \"cpu\"",
        new="        if not (capturable or (False",
        tests=("tests/test_update_lists.py", "-k", "row_shards_is_the_whole_matrix"),
    ),
    Mutant(
        name="mixed-dtype-apply-through-a-list-op",
        guarantee="A bf16 result applied to an fp32 weight goes per tensor, as torch's list op would fall back "
                  "to: no list op off the multi-tensor route (issue 59, item 3).",
        path="dmuon/numerics/update_rules.py",
        old="        per_tensor = not foreach or (ps[0].device.type != \"cpu\" and us[0].dtype != ps[0].dtype)",
        new="        per_tensor = not foreach",
        tests=("tests/test_device_scalars.py", "-k", "fp32_weights_calls_no_list_op"),
    ),
    # ------------------------------------------------ the captured step (issue 59, item 7's survivors)
    Mutant(
        name="replay-tally-adds-non-finite-ranks",
        guarantee="A replayed step with non-finite grads on several ranks counts one skipped step, as an eager "
                  "step does (the status sums the ranks).",
        path="dmuon/exchange/status_masks.py",
        old="        skipped = (status[BLOCKS * n + 1] > 0) & ~error",
        new="        skipped = status[BLOCKS * n + 1] * ~error",
        tests=("tests/test_replay_tally.py::test_a_replay_with_non_finite_grads_on_two_ranks_is_one_skipped_step",),
    ),
    Mutant(
        name="capturable-adamw-keep-from-fp32-copies",
        guarantee="The capturable AdamW part's decay factor 1 - lr * wd is made from the fp64 lr and weight "
                  "decay, so it has the float step's bits for any value.",
        path="dmuon/numerics/adamw_rules.py",
        old="    keep = keep_factor(lr, weight_decay, scalars, capturable=True)",
        new="    keep = keep_factor(lr.float().double(), weight_decay.float().double(), scalars, capturable=True)",
        tests=("tests/test_capturable.py::test_the_capturable_adamw_decay_is_made_from_the_fp64_lr_and_weight_decay",),
    ),
    # ------------------------------------------------ issue 62: the option table, one Muon path, one wait
    Mutant(
        name="option-table-momentum-checked-as-non-negative",
        guarantee="Each option is checked by its row of the option table: momentum must be in [0, 1), "
                  "refused at construction naming it.",
        path="dmuon/options/table.py",
        old="    Option(\"momentum\", 0.95, Scope.MUON, _UNIT,",
        new="    Option(\"momentum\", 0.95, Scope.MUON, _NON_NEGATIVE,",
        tests=("tests/test_validation.py::test_bad_optimizer_option_is_rejected_naming_it",
               "tests/test_option_table.py"),
    ),
    Mutant(
        name="masked-local-step-applies-unzeroed-results",
        guarantee="Off the owner exchange, a masked parameter's result is zeroed before the masked apply, so a "
                  "NaN result changes nothing where the mask does not hold (one Muon step, masks or none).",
        path="dmuon/step/group_steps.py",
        old="            if ok is not None:\n                mask_([ortho], ok, foreach)\n",
        new="",
        tests=("tests/test_skip_nonfinite.py",),
    ),
    Mutant(
        name="mask-read-before-the-wait-waits-on-its-own",
        guarantee="The step's masks exist only after its one named wait; a read before it raises instead of "
                  "waiting on its own.",
        path="dmuon/exchange/status_masks.py",
        old="        if self._step_ok is None:\n            raise RuntimeError(NOT_WAITED)\n",
        new="        if self._step_ok is None:\n            self.wait()\n",
        tests=("tests/test_status_masks.py",),
    ),
]

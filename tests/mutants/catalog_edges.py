"""The mutants of issue 67's finds: the option and memory sweeps' defects and the six planted
bugs that survived the suite before it; tests/mutants/__init__.py says what a mutant is."""

from __future__ import annotations

from tests.mutants import Mutant

EDGES = [
    # ------------------------------------------------ the replay guard (dmuon/capture/replay_guard.py)
    Mutant(
        name="replay-guard-ignores-whole-optimizer-options",
        guarantee="A whole-optimizer option (skip_nonfinite, foreach, ns_dtype, ...: the option table's) changed "
                  "after the capture is refused before the next replay, naming it, instead of replaying the "
                  "captured value (a NaN grad applied though skip_nonfinite is on).",
        path="dmuon/capture/replay_guard.py",
        old="changed = [name for name, value in _whole_options(self._optimizer).items() if value != self._whole[name]]",
        new="changed = []",
        tests=("tests/test_cuda_graphs.py", "-k",
               "whole_optimizer_option_changed or skip_nonfinite_turned_on"),
    ),
    Mutant(
        name="replay-guard-copies-only-float-numbers-in",
        guarantee="A number written to lr or weight_decay between replays, an int included (weight_decay = 0), is "
                  "copied into the tensor the graph reads, not refused as a replaced tensor.",
        path="dmuon/capture/replay_guard.py",
        old="if isinstance(value, Real) and not isinstance(value, bool) and tensor is not None:",
        new="if isinstance(value, float) and tensor is not None:",
        tests=("tests/test_cuda_graphs.py::"
               "test_an_int_written_to_weight_decay_between_replays_is_copied_into_the_tensor_the_graph_reads",),
    ),
    # ------------------------------------------------ TorchTitan 0.3's config checks (torchtitan_ext/titan03)
    Mutant(
        name="titan03-config-skips-the-no-path-flags",
        guarantee="TorchTitan 0.3's config check refuses what DMuon(...) refuses, when the config is made and "
                  "naming the field: maximize=True and differentiable='yes' in a DMuon group's optimizer_kwargs "
                  "(issue 67, defect 5).",
        path="torchtitan_ext/titan03/options.py",
        old="    check_no_path_flags({key: options[key] for key in NO_PATH_KEYS if key in options}, where)\n",
        new="",
        tests=("tests/test_option_sweep.py::test_a_sample_of_every_option_through_every_front_end_and_resume_holds",),
    ),
    # ------------------------------------------------ the planted bugs
    Mutant(
        name="skipped-steps-of-model-parts-added",
        guarantee="One rank's figures over its model parts (pipeline stages, one DMuon each) count a training step "
                  "that every part skipped once: the largest of the parts' skipped steps, not their sum.",
        path="dmuon/step/telemetry.py",
        old=".with_skipped(max((p.skipped_steps for p in parts), default=0))",
        new=".with_skipped(sum(p.skipped_steps for p in parts))",
        tests=("tests/test_torchtitan_container.py::"
               "test_a_step_both_model_parts_skipped_counts_once_in_the_containers_figures",),
    ),
    Mutant(
        name="masked-momentum-store-takes-masks-by-position-among-the-kept",
        guarantee="A masked step stores each bf16 / int8 momentum under its own parameter's mask, taken by the "
                  "parameter's place in the list the chunk updates, also where a parameter before it has no state "
                  "yet: bitwise as single process.",
        path="dmuon/state/kept_state.py",
        old="None if oks is None else [oks[i] for i in kept], keys.root)",
        new="None if oks is None else [oks[k] for k in range(len(kept))], keys.root)",
        tests=("tests/test_momentum_dtype.py::"
               "test_a_masked_step_stores_each_momentum_beside_a_parameter_without_state_as_a_single_process",
               "tests/test_momentum_dtype.py::"
               "test_a_masked_read_keeps_each_mask_with_its_momentum_when_some_have_no_state_yet"),
    ),
    Mutant(
        name="resume-conversion-made-in-the-groups-dtype",
        guarantee="A load converts a momentum into the form its layout keeps: a matrix whose layout cuts rows off "
                  "the int8 blocks is made in bf16, not in its group's int8.",
        path="dmuon/state/kept_state.py",
        old="entry.update(new_momentum(param, target, keys))",
        new="entry.update(new_momentum(param, group[\"momentum_dtype\"] if group[\"use_muon\"] else target, keys))",
        tests=("tests/test_momentum_dtype_ranks.py::"
               "test_a_plain_resume_from_float_momentum_makes_the_fallbacks_bf16_not_the_groups_int8",),
    ),
    Mutant(
        name="local-path-steps-a-parameter-without-a-grad-under-the-steps-mask",
        guarantee="On the local path (a mesh of one rank, a Replicate DTensor) a DTensor without a grad steps under "
                  "its own \"no grad here\" mask: neither decayed nor stepped, its bits kept.",
        path="dmuon/step/group_steps.py",
        old="[status[p] for p in shared]",
        new="[status.step_ok for p in shared]",
        tests=("tests/test_one_rank.py::"
               "test_a_dtensor_without_a_grad_on_the_local_path_keeps_its_bits_under_weight_decay",),
    ),
    Mutant(
        name="max-logit-slot-not-reset-when-taken",
        guarantee="The step takes each attention's slot (TorchTitan's hooks fold into it) and refills it with -inf: "
                  "a step's max logits are its own, also when they fall below the last step's.",
        path="dmuon/attention/max_logits.py",
        old="            from_slot = slot.clone()\n            slot.fill_(-math.inf)\n",
        new="            from_slot = slot.clone()\n",
        tests=("tests/test_torchtitan_qk_clip.py::"
               "test_a_steps_max_logits_are_its_own_when_they_fall_below_the_last_steps",),
    ),
    Mutant(
        name="captured-skipped-steps-of-model-parts-added",
        guarantee="With captured steps, a step every model part skipped counts once in TorchTitan's step line "
                  "(the most any part skipped), as the step's figures count it.",
        path="torchtitan_ext/captured_steps.py",
        old="        return max((o.skipped_steps for o in self.optimizers if isinstance(o, DMuon)), default=0)",
        new="        return sum(o.skipped_steps for o in self.optimizers if isinstance(o, DMuon))",
        tests=("tests/test_torchtitan_step_metrics.py::test_a_captured_step_both_model_parts_skipped_counts_once",),
    ),
    # ------------------------------------------------ the option sweep's finds (tests/option_sweep.py)
    Mutant(
        name="resume-keeps-a-saved-groups-own-flags",
        guarantee="A resume drops a saved group's foreach / fused (and any key of the table) that the optimizer's "
                  "group leaves unset: the group steps with the flags configured, not the checkpoint's.",
        path="dmuon/state/resume_contract.py",
        old="        if key not in mine and key in saved:\n            del group[key]",
        new="        if False:\n            del group[key]",
        tests=("tests/test_resume_contract.py::test_a_saved_groups_own_flag_the_optimizer_leaves_unset_is_dropped_and_logged",
               "tests/test_option_sweep.py::test_a_sample_of_every_option_through_every_front_end_and_resume_holds"),
    ),
    Mutant(
        name="resume-fills-in-a-missing-option",
        guarantee="A saved group without one of its kind's options is refused naming it, not filled in (a missing "
                  "normuon once turned NorMuon off).",
        path="dmuon/state/resume_contract.py",
        old="        if missing:",
        new="        if False:",
        tests=("tests/test_torch_optim_contract.py::test_a_state_dict_whose_group_lacks_an_option_is_refused_naming_it",
               *("tests/test_option_sweep.py::test_a_sample_of_every_option_through_every_front_end_and_resume_holds",)),
    ),
    Mutant(
        name="resume-takes-a-saved-1-for-true",
        guarantee="A saved bool option is the optimizer's only when it is the same bool: a saved 1 for True is "
                  "replaced by the configured value and logged, not kept.",
        path="dmuon/state/resume_contract.py",
        old="        return a is b",
        new="        return a == b",
        tests=("tests/test_option_sweep.py::test_a_sample_of_every_option_through_every_front_end_and_resume_holds",),
    ),
    Mutant(
        name="split-groups-eps-reaches-adamw",
        guarantee="A group without use_muon gives its eps to Newton-Schulz only, as DMuon(eps=...) does; the AdamW "
                  "part's is adamw_eps.",
        path="dmuon/options/param_groups.py",
        old="    if split:\n        options = ",
        new="    if False:\n        options = ",
        tests=("tests/test_validation.py::test_a_split_groups_eps_is_newton_schulzs_as_the_keyword_is",
               "tests/test_option_sweep.py::test_a_sample_of_every_option_through_every_front_end_and_resume_holds"),
    ),
    Mutant(
        name="owner-exchange-ignores-the-groups-foreach",
        guarantee="On the owner exchange, the ops spanning several groups (masks, widening, the momentum store) "
                  "take the groups' foreach, not the optimizer's.",
        path="dmuon/step/group_steps.py",
        old="        return all(self.lists_for(device, group) for group in {id(g): g for g in groups}.values())",
        new="        return resolve_foreach(self.foreach, device)",
        tests=("tests/test_option_sweep.py::test_a_sample_of_every_option_through_every_front_end_and_resume_holds",),
    ),
    # ------------------------------------------------ the option and memory sweeps' defects
    Mutant(
        name="int8-momentum-kept-on-rows-narrower-than-five",
        guarantee="int8 momentum of a parameter whose rows are narrower than 5 elements (a scale per row costs "
                  "1 + 4 / w bytes an element) is kept in bf16, at 2 bytes an element (issue 67, defect 1).",
        path="dmuon/state/kept_state.py",
        old="if row_length(param.shape) < INT8_MIN_ROW:",
        new="if False:",
        tests=("tests/test_memory_sweep.py", "-k", "test_the_memory_sample_holds_every_case_to_its_memory"),
    ),
    Mutant(
        name="frozen-parameters-zeros-kept-between-steps",
        guarantee="A Muon parameter that never gets a grad keeps nothing alive between steps on the fast path "
                  "(Shard(0) on 2 ranks): the zeros its step reads are let go (issue 67, defect 4).",
        path="dmuon/step/fast_path.py",
        old="keep=not self.made_zeros",
        new="keep=True",
        tests=("tests/test_memory_sweep.py::test_the_memory_sample_holds_every_case_to_its_memory[P2]",),
    ),
    # ------------------------------------------------ the AdamW part's kept moments (issue 69)
    Mutant(
        name="adamw-load-casts-int8-moments-to-float",
        guarantee="A load keeps the AdamW part's int8 moments int8 (torch's load casts every state value to the "
                  "parameter's dtype: int8 values under their own key, but float32).",
        path="dmuon/optimizer.py",
        old="keep_saved_dtypes(self, state_dict, (*MUON_STATE_KEYS, *(k for keys in ADAMW_MOMENTS for k in keys.keys)))",
        new="keep_saved_dtypes(self, state_dict, MUON_STATE_KEYS)",
        tests=("tests/test_adamw_state_dtype.py", "-k", "resume_through_state_dict"),
    ),
    Mutant(
        name="adamw-state-dtype-quantizes-norms",
        guarantee="A parameter of fewer than 2 dims (a norm, a bias) keeps its AdamW moments in its own dtype "
                  "whatever adamw_state_dtype asks.",
        path="dmuon/state/kept_state.py",
        old="return state_dtype if param.ndim >= 2 else None",
        new="return state_dtype",
        tests=("tests/test_adamw_state_dtype.py", "-k", "matrices_keep_the_asked_form"),
    ),
    Mutant(
        name="adamw-int8-second-moment-kept-linear",
        guarantee="int8 keeps the square root of exp_avg_sq (a linear map of v reads back 0 under max / 254 of "
                  "its block: AdamW's step is then m / eps).",
        path="dmuon/state/kept_state.py",
        old='"exp_avg_sq_root_scales", "AdamW moments", root=True)',
        new='"exp_avg_sq_root_scales", "AdamW moments", root=False)',
        tests=("tests/test_adamw_state_dtype.py", "-k", "torchs_adamw_on_the_moments_as_read"),
    ),
    Mutant(
        name="adamw-masked-step-leaves-kept-moments-out",
        guarantee="A step masked on the device keeps every bit of the AdamW part's kept moments (values and "
                  "scales), not only the weights.",
        path="dmuon/step/adamw_part.py",
        old="selected = likes + [local_of(t) for s in states",
        new="selected = likes + [local_of(t) for s in []",
        tests=("tests/test_adamw_state_dtype.py", "-k", "skipped_for_a_nonfinite_grad"),
    ),
    Mutant(
        name="adamw-row-pieces-count-the-step-again",
        guarantee="A parameter the AdamW part steps in row pieces (the CPU's kept moments) counts its step once: "
                  "each piece's bias correction is the step's, the bits of the step on the whole tensor.",
        path="dmuon/step/adamw_part.py",
        old="[firsts.setdefault(i, counters[i].clone()).clone()]",
        new="[counters[i].clone()]",
        tests=("tests/test_adamw_state_dtype.py", "-k", "row_pieces"),
    ),
]

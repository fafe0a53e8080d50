"""Specification of DMuon as a TorchTitan 0.3.x optimizer (``torchtitan_ext.titan03.optimizer``).

In-process, one rank, toy models named like 0.3's llama3 (``tests/titan03_support``):
the config and its checks, the command line, routing, TorchTitan's ``fused`` /
``foreach`` keys, ``init_optim_state``, the flat state dict, and two model parts.
Skipped unless TorchTitan 0.3.x is installed.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

from tests.titan03_support import require_titan03

require_titan03()

import torch  # noqa: E402
from dmuon import DMuon  # noqa: E402
from dmuon.options.table import FACTORY_KWARGS, OPTIONS  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, ParamGroupConfig  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402

from tests.test_option_table import BAD, CHANGED, net  # noqa: E402
from tests.titan03_support import HEAD_DIM, set_grads, ToyLlama3, two_stages  # noqa: E402
from torchtitan_ext.titan03.optimizer import DMuonOptimizersContainer, dmuon_optimizer  # noqa: E402

pytestmark = pytest.mark.unit

MUON_MATRICES = {f"layers.{i}.{m}.weight" for i in (0, 1) for m in
                 ("attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
                  "feed_forward.w3")}
ADAMW_PARAMS = {"tok_embeddings.weight", "lm_head.weight", "norm.weight"} | {
    f"layers.{i}.{n}.weight" for i in (0, 1) for n in ("attention_norm", "ffn_norm")}


def build(config, model_parts=None) -> DMuonOptimizersContainer:
    return config.build(model_parts=model_parts or [ToyLlama3()])


def names_by_use(optimizer: DMuon) -> dict[bool, set[str]]:
    result: dict[bool, set[str]] = {True: set(), False: set()}
    for group in optimizer.param_groups:
        result[group["use_muon"]] |= set(group["param_names"])
    return result


def snapshot(model_parts) -> list[torch.Tensor]:
    return [p.detach().clone() for m in model_parts for p in m.parameters()]


# ------------------------------------------------------------------- config
def test_dmuon_optimizer_gives_a_config_that_builds_the_dmuon_container():
    container = build(dmuon_optimizer(lr=0.02))
    assert type(container) is DMuonOptimizersContainer
    assert [type(o) for o in container] == [DMuon]


def test_a_bad_group_value_fails_when_the_config_is_made_naming_the_field():
    with pytest.raises(ValueError, match=r"optimizer\.param_groups\[0\]\.optimizer_kwargs: ns_steps must be an int"):
        dmuon_optimizer(ns_steps=0)


def test_a_bad_adamw_part_value_names_the_adamw_part():
    with pytest.raises(ValueError, match=r"optimizer\.param_groups\[0\]\.optimizer_kwargs: adamw_betas\[0\] must be a finite number in \[0, 1\), got 1\.5"):
        dmuon_optimizer(adamw_betas=(1.5, 0.9))


def test_a_bad_whole_optimizer_option_names_the_factory_kwargs_field():
    with pytest.raises(ValueError, match=r"optimizer_factory_kwargs_by_name\['DMuon'\]: unknown comm 'x'"):
        dmuon_optimizer(factory_options={"comm": "x"})


def test_skip_nonfinite_is_a_whole_optimizer_switch_taking_a_bool():
    with pytest.raises(ValueError, match=r"optimizer_factory_kwargs_by_name\['DMuon'\]: skip_nonfinite must be a bool"):
        dmuon_optimizer(factory_options={"skip_nonfinite": 1})
    assert all(o.skip_nonfinite for o in build(dmuon_optimizer(factory_options={"skip_nonfinite": True})))


def test_capture_step_is_a_whole_optimizer_switch_refused_on_a_cpu_run_naming_the_field():
    with pytest.raises(ValueError, match=r"optimizer_factory_kwargs_by_name\['DMuon'\]: capture_step must be a bool"):
        dmuon_optimizer(factory_options={"capture_step": "yes"})
    with pytest.raises(ValueError, match=r"^optimizer.optimizer_factory_kwargs_by_name\['DMuon'\]\['capture_step'\] "
                                         r"captures the optimizer step in a CUDA graph: CUDA only, and this job's "
                                         r"parameters are on cpu"):
        build(dmuon_optimizer(factory_options={"capture_step": True}))


def test_an_unknown_group_key_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['ns_step'\].*known: .*'ns_steps'"):
        dmuon_optimizer(ns_step=3)


def test_a_whole_optimizer_option_in_a_group_is_refused_pointing_to_the_factory_kwargs():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['telemetry'\].*optimizer_factory_kwargs_by_name"):
        dmuon_optimizer(telemetry=True)


def test_fused_true_in_a_muon_only_dmuon_group_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"param_groups\[0\]\.optimizer_kwargs: fused=True has no path in a Muon group"):
        DMuonOptimizersContainer.Config(param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="DMuon", optimizer_kwargs={"use_muon": True, "fused": True}),
        ])


def test_a_hand_written_config_is_checked_too():
    with pytest.raises(ValueError, match=r"param_groups\[1\]\.optimizer_kwargs: momentum must be in"):
        DMuonOptimizersContainer.Config(param_groups=[
            ParamGroupConfig(pattern="tok_embeddings", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3}),
            ParamGroupConfig(pattern=".*", optimizer_name="DMuon", optimizer_kwargs={"momentum": 1.0}),
        ])


def test_a_bad_normuon_beta2_fails_when_the_config_is_made_naming_the_field():
    with pytest.raises(ValueError, match=r"^optimizer\.param_groups\[0\]\.optimizer_kwargs: normuon_beta2 must be in "
                                         r"\[0\.0, 1\.0\), got 1\.0$"):
        dmuon_optimizer(normuon=True, normuon_beta2=1.0)


def test_the_update_rule_variants_reach_the_dmuon_param_groups():
    config = dmuon_optimizer(normuon=True, normuon_beta2=0.9, cautious_weight_decay=True)
    optimizer = build(config).optimizers[0]
    muon, adamw = (next(g for g in optimizer.param_groups if g["use_muon"] is use) for use in (True, False))
    assert (muon["normuon"], muon["normuon_beta2"], muon["cautious_weight_decay"]) == (True, 0.9, True)
    assert adamw["cautious_weight_decay"] is True


@pytest.mark.parametrize("momentum_dtype", [None, "bfloat16", "int8"])
def test_the_momentum_dtype_reaches_the_dmuon_muon_group(momentum_dtype):
    optimizer = build(dmuon_optimizer(momentum_dtype=momentum_dtype)).optimizers[0]
    muon = next(g for g in optimizer.param_groups if g["use_muon"])
    assert muon["momentum_dtype"] == momentum_dtype


def test_a_bad_momentum_dtype_fails_when_the_config_is_made_naming_the_field():
    with pytest.raises(ValueError, match=r"^optimizer\.param_groups\[0\]\.optimizer_kwargs: momentum_dtype must be one of"):
        dmuon_optimizer(momentum_dtype="fp8")


def test_gram_newton_schulz_reaches_the_dmuon_muon_group():
    optimizer = build(dmuon_optimizer(ns_algorithm="auto", ns_gram_restarts=(1, 3))).optimizers[0]
    muon = next(g for g in optimizer.param_groups if g["use_muon"])
    assert (muon["ns_algorithm"], muon["ns_gram_restarts"]) == ("auto", (1, 3))


def test_a_bad_ns_algorithm_fails_when_the_config_is_made_naming_the_field():
    with pytest.raises(ValueError, match=r"^optimizer\.param_groups\[0\]\.optimizer_kwargs: ns_algorithm must be one of"):
        dmuon_optimizer(ns_algorithm="fast")


def test_every_option_of_dmuon_optimizer_reaches_dmuon():
    config = dmuon_optimizer(lr=0.03, momentum=0.9, ns_steps=6, adamw_lr=1e-3,
                             factory_options={"comm": "redistribute", "telemetry": True, "ns_dtype": "float32"})
    optimizer = build(config).optimizers[0]
    muon, adamw = (next(g for g in optimizer.param_groups if g["use_muon"] is use) for use in (True, False))
    assert (muon["lr"], muon["momentum"], muon["ns_steps"], adamw["lr"]) == (0.03, 0.9, 6, 1e-3)
    assert (optimizer.comm, optimizer.phases.telemetry.enabled, optimizer.ns_dtype) == ("redistribute", True, "float32")


# Values each option is tried with, besides the table's bad and changed ones (test_option_table)
# and its default: none depends on the parameters (a split_rows of 3 would, as 16 rows do not
# split in 3s), which a config does not have.
PROBES = (None, True, False, "yes", 0, 1, -1.0, 0.5)
GROUP_FIELD = "optimizer.param_groups[0].optimizer_kwargs"
FACTORY_FIELD = "optimizer.optimizer_factory_kwargs_by_name['DMuon']"


def config_with(option, value):
    """A hand-written config setting only ``option``, where TorchTitan 0.3 takes it: a whole-optimizer
    option in the factory's kwargs, any other (group options, torch's flags; ``capturable``'s
    ``capture_step`` is the container's bool) in a DMuon group's."""
    if option.titan03 == FACTORY_KWARGS:
        return DMuonOptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="DMuon", optimizer_kwargs={})],
            optimizer_factory_kwargs_by_name={"DMuon": {option.name: value}})
    return DMuonOptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=".*", optimizer_name="DMuon", optimizer_kwargs={option.name: value})])


def dmuon_refuses(params=None, **options) -> bool:
    try:
        DMuon(params or list(net().named_parameters()), **options)
    except (ValueError, TypeError):
        return True
    return False


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.name)
def test_each_option_is_refused_at_config_time_exactly_when_dmuon_refuses_it_naming_it(option):
    values = [BAD[option.name], option.default, *PROBES]
    if option.name in CHANGED:
        values.append(CHANGED[option.name])
    whole = option.titan03 == FACTORY_KWARGS
    field = FACTORY_FIELD if whole else GROUP_FIELD
    for value in values:
        # As 0.3 hands it to DMuon: a whole-optimizer option as its keyword, any other in a group.
        refused = dmuon_refuses(**{option.name: value}) if whole else \
            dmuon_refuses([{"params": list(net().named_parameters()), option.name: value}])
        try:
            config_with(option, value)
        except ValueError as error:
            assert refused, f"{option.name}={value!r}: the config refuses it, DMuon takes it ({error})"
            # named as the option or as its key in the part it reaches (adamw_eps: the AdamW part's eps)
            assert str(error).startswith(field) and (option.name in str(error) or option.key in str(error)), (
                option.name, value, str(error))
        else:
            assert not refused, f"{option.name}={value!r}: DMuon refuses it, the config takes it"


@pytest.mark.parametrize("option, value, message", [
    ("maximize", True, r"maximize=True has no path in DMuon"),
    ("differentiable", "yes", r"differentiable must be False or None"),
])
def test_a_flag_dmuon_has_no_path_for_is_refused_when_the_config_is_made_naming_the_field(option, value, message):
    with pytest.raises(ValueError, match=rf"^optimizer\.param_groups\[0\]\.optimizer_kwargs: {message}"):
        dmuon_optimizer(**{option: value})


def test_capturable_in_a_group_is_taken_when_the_config_is_made_and_reaches_dmuon():
    config = dmuon_optimizer(capturable=True)
    (optimizer,) = build(config)
    assert all(g["capturable"] and isinstance(g["lr"], torch.Tensor) for g in optimizer.param_groups)


# ------------------------------------------------------------- command line
def parse(*flags: str):
    return ConfigManager().parse_args(["--module", "tests.titan03_support", "--config", "llama3_dmuon", *flags])


def test_command_line_overrides_reach_the_dmuon_config():
    config = parse("--optimizer.param_groups.0.optimizer_kwargs.ns_steps", "7",
                   "--optimizer.optimizer_factory_kwargs_by_name.DMuon.comm", "redistribute")
    assert type(config.optimizer) is DMuonOptimizersContainer.Config
    assert config.optimizer.param_groups[0].optimizer_kwargs["ns_steps"] == 7
    assert config.optimizer.optimizer_factory_kwargs_by_name["DMuon"]["comm"] == "redistribute"


def test_the_update_rule_variants_are_set_from_the_command_line():
    kwargs = parse("--optimizer.param_groups.0.optimizer_kwargs.normuon",
                   "--optimizer.param_groups.0.optimizer_kwargs.normuon_beta2", "0.5",
                   "--optimizer.param_groups.0.optimizer_kwargs.cautious_weight_decay",
                   ).optimizer.param_groups[0].optimizer_kwargs
    assert (kwargs["normuon"], kwargs["normuon_beta2"], kwargs["cautious_weight_decay"]) == (True, 0.5, True)


def test_the_ns_algorithm_is_set_from_the_command_line():
    kwargs = parse("--optimizer.param_groups.0.optimizer_kwargs.ns_algorithm", "gram").optimizer.param_groups[0]
    assert kwargs.optimizer_kwargs["ns_algorithm"] == "gram"


def test_a_bad_command_line_value_stops_parsing_naming_the_field(capsys):
    with pytest.raises(SystemExit):
        parse("--optimizer.param_groups.0.optimizer_kwargs.ns_steps", "0")
    assert "optimizer.param_groups[0].optimizer_kwargs" in capsys.readouterr().err


# ----------------------------------------------------------------- routing
def test_matrices_go_to_muon_and_embeddings_head_and_norms_to_adamw():
    routed = names_by_use(build(dmuon_optimizer()).optimizers[0])
    assert routed == {True: MUON_MATRICES, False: ADAMW_PARAMS}


def test_split_attention_heads_orthogonalizes_the_fused_wqkv_per_head():
    optimizer = build(dmuon_optimizer(split_attention_heads=True)).optimizers[0]
    per_head = [g for g in optimizer.param_groups if g["use_muon"] and g["split_rows"] == HEAD_DIM]
    assert len(per_head) == 1
    assert set(per_head[0]["param_names"]) == {f"layers.{i}.attention.qkv_linear.wqkv.weight" for i in (0, 1)}


def test_a_custom_adamw_regex_moves_matching_matrices_to_adamw():
    routed = names_by_use(build(dmuon_optimizer(adamw_param_regex=r"norm|tok_embeddings|lm_head|feed_forward"))
                          .optimizers[0])
    assert "layers.0.feed_forward.w1.weight" in routed[False]
    assert "layers.0.attention.wo.weight" in routed[True]


def test_a_group_with_use_muon_is_kept_whole():
    config = DMuonOptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r"norm|tok_embeddings|lm_head", optimizer_name="DMuon",
                         optimizer_kwargs={"use_muon": False, "lr": 1e-3}),
        ParamGroupConfig(pattern=".*", optimizer_name="DMuon", optimizer_kwargs={"use_muon": True, "lr": 0.02}),
    ])
    routed = names_by_use(build(config).optimizers[0])
    assert routed == {True: MUON_MATRICES, False: ADAMW_PARAMS}


def test_adamw_and_dmuon_groups_mix_in_one_container():
    config = DMuonOptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r"tok_embeddings", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3}),
        ParamGroupConfig(pattern=".*", optimizer_name="DMuon", optimizer_kwargs={"lr": 0.02}),
    ], implementation="for-loop")
    container = build(config)
    assert [type(o).__name__ for o in container] == ["AdamW", "DMuon"]
    assert "tok_embeddings.weight" not in names_by_use(container.optimizers[1])[False]


def test_titans_fused_and_foreach_keys_stay_out_of_dmuon_groups():
    optimizer = build(dmuon_optimizer()).optimizers[0]  # implementation="fused": fused=True on every group
    assert not any(key in group for group in optimizer.param_groups for key in ("fused", "foreach"))


# ---------------------------------------------------------------- state
def test_init_optim_state_leaves_every_parameter_bit_for_bit_unchanged():
    model_parts = [ToyLlama3()]
    container = build(dmuon_optimizer(lr=torch.tensor(0.02), weight_decay=0.1, adamw_weight_decay=0.1),
                      model_parts)
    before = snapshot(model_parts)
    container.state_dict()  # runs init_optim_state: a zero-grad, lr-0 step
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model_parts)))
    assert len(container.optimizers[0].state) == len(before)


def test_the_state_dict_is_flat_and_keyed_by_parameter_name():
    model_parts = [ToyLlama3()]
    container = build(dmuon_optimizer(), model_parts)
    set_grads(model_parts, seed=1)
    container.step()
    keys = container.state_dict().keys()
    assert "state.layers.0.attention.wo.weight.momentum_buffer" in keys
    assert "state.lm_head.weight.exp_avg" in keys
    assert "param_groups.layers.0.attention.wo.weight.use_muon" in keys


def train(container, model_parts, steps: range) -> None:
    for step in steps:
        set_grads(model_parts, seed=step)
        container.step()
        container.zero_grad()


@pytest.mark.parametrize("parts", [1, 2], ids=["one_part", "two_parts"])
def test_a_reloaded_state_continues_exactly_as_the_original(parts, one_thread):
    def fresh():
        model_parts = [ToyLlama3()] if parts == 1 else two_stages()
        return model_parts, build(dmuon_optimizer(weight_decay=0.1), model_parts)

    parts_a, container_a = fresh()
    train(container_a, parts_a, range(2))
    parts_b, container_b = fresh()
    for model_a, model_b in zip(parts_a, parts_b):
        model_b.load_state_dict(model_a.state_dict())
    # A copy, as a checkpoint is: torch's load_state_dict keeps the tensors it is given.
    container_b.load_state_dict(copy.deepcopy(container_a.state_dict()))
    train(container_a, parts_a, range(2, 4))
    train(container_b, parts_b, range(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(snapshot(parts_a), snapshot(parts_b)))


def test_each_model_part_gets_its_own_dmuon():
    model_parts = two_stages()
    container = build(dmuon_optimizer(), model_parts)
    assert len(container.optimizers) == 2
    first, last = (names_by_use(o) for o in container.optimizers)
    assert "tok_embeddings.weight" in first[False] and "lm_head.weight" in last[False]
    assert first[True].isdisjoint(last[True])


def test_a_stage_without_any_matrix_gets_a_dmuon_with_only_adamw():
    model_parts = [ToyLlama3((), first=True, last=False)]  # the embeddings alone
    optimizer = build(dmuon_optimizer(), model_parts).optimizers[0]
    assert [g["use_muon"] for g in optimizer.param_groups] == [False]


def test_torchtitans_lr_schedulers_scale_both_parts():
    config = dmuon_optimizer(lr=0.02, adamw_lr=1e-3)
    container = build(config)
    LRSchedulersContainer.Config(warmup_steps=4).build(optimizers=container, training_steps=10)
    groups = container.optimizers[0].param_groups
    assert sorted(g["initial_lr"] for g in groups) == [1e-3, 0.02]
    factors = {round(g["lr"] / g["initial_lr"], 12) for g in groups}  # in warmup: one factor below 1
    assert len(factors) == 1 and factors.pop() < 1


# ---------------------------------------------------------------- implementation
def with_implementation(config, implementation: str):
    return dataclasses.replace(config, implementation=implementation)


@pytest.mark.parametrize("implementation, flags", [
    ("for-loop", (False, False)), ("foreach", (True, False)), ("fused", (True, True)),
    ("fused_opt_states_bf16", (True, True)),
])
def test_implementation_maps_onto_dmuons_foreach_and_fused(implementation, flags):
    container = build(with_implementation(dmuon_optimizer(), implementation), [ToyLlama3(), ToyLlama3()])
    assert [(optimizer.foreach, optimizer.fused) for optimizer in container] == [flags, flags]


def test_a_dmuon_groups_own_foreach_overrides_implementation_for_that_group():
    (optimizer,) = build(dmuon_optimizer(foreach=False))  # implementation="fused": foreach=True for DMuon
    assert optimizer.foreach is True
    assert [group["foreach"] for group in optimizer.param_groups] == [False, False]


def test_a_dmuon_groups_own_fused_goes_to_its_adamw_part_only():
    (optimizer,) = build(with_implementation(dmuon_optimizer(fused=True), "foreach"))
    assert [(g["use_muon"], g.get("fused")) for g in optimizer.param_groups] == [(True, None), (False, True)]


def test_a_tensor_lr_with_implementation_foreach_is_refused_when_the_config_is_made():
    with pytest.raises(ValueError, match=r"^optimizer\.param_groups\[0\]\.optimizer_kwargs \(AdamW part\): lr as a "
                                         r"Tensor is not supported for capturable=False and foreach=True"):
        with_implementation(dmuon_optimizer(lr=torch.tensor(0.02)), "foreach")


def test_a_tensor_lr_with_the_default_fused_implementation_builds():
    (optimizer,) = build(dmuon_optimizer(lr=torch.tensor(0.02)))
    assert optimizer.fused is True


def test_a_tensor_lr_with_implementation_foreach_is_taken_when_the_config_captures_the_step():
    # capture_step is DMuon's capturable=True, whose AdamW part takes a Tensor lr with foreach (on CUDA).
    config = dmuon_optimizer(lr=torch.tensor(0.02), factory_options={"capture_step": True})
    assert with_implementation(config, "foreach").implementation == "foreach"


def test_an_unknown_implementation_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"optimizer\.implementation must be one of .*got 'fastest'"):
        with_implementation(dmuon_optimizer(), "fastest")

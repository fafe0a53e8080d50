"""Specification of the DMuon ``OptimizersContainer`` TorchTitan builds.

In-process, single rank, tiny llama3 models: routing of parameters to Muon or
AdamW, one DMuon per model part, and LR scheduling of both param groups.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchtitan_ext.titan02.job  # noqa: F401  (registers the DMuon-aware train specs)
from dmuon import DMuon
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers, OptimizersContainer
from torchtitan.config import ConfigManager
from torchtitan.models.llama3 import Transformer, TransformerModelArgs
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan_ext.titan02.container import (
    DMuonOptimizersContainer,
    dmuon_kwargs,
    route_parameters,
)

pytestmark = pytest.mark.unit


def optimizer_config(*args: str):
    """The ``[optimizer]`` section as TorchTitan parses it with the extension."""
    argv = ["--job.custom_config_module", "torchtitan_ext", "--experimental.custom_import", "torchtitan_ext.titan02.job",
            "--optimizer.name", "DMuon", *args]
    return ConfigManager().parse_args(argv).optimizer


def tiny_llama(n_layers: int = 2) -> Transformer:
    torch.manual_seed(0)
    args = TransformerModelArgs(dim=64, n_layers=n_layers, n_heads=4, vocab_size=128, max_seq_len=32)
    return Transformer(args)


def build(model_parts, *args: str) -> OptimizersContainer:
    spec = get_train_spec("llama3")
    return spec.build_optimizers_fn(model_parts, optimizer_config(*args), None)


def names(pairs) -> set[str]:
    return {name for name, _ in pairs}


def layer_weights(*modules: str, n_layers: int = 2) -> set[str]:
    """The weight names of ``modules`` (e.g. ``"attention.wq"``) in every layer of tiny_llama."""
    return {f"layers.{i}.{m}.weight" for i in range(n_layers) for m in modules}


ATTENTION = ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
FEED_FORWARD = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
NORMS = ("attention_norm", "ffn_norm")


# ----------------------------------------------------------------- routing


def test_embeddings_output_head_and_norms_go_to_adamw():
    routed = route_parameters(tiny_llama(), optimizer_config().adamw_param_regex)
    assert names(routed.adamw) == {
        "tok_embeddings.weight",
        "output.weight",
        "norm.weight",
        "layers.0.attention_norm.weight",
        "layers.0.ffn_norm.weight",
        "layers.1.attention_norm.weight",
        "layers.1.ffn_norm.weight",
    }


def test_attention_and_feed_forward_matrices_go_to_muon():
    routed = route_parameters(tiny_llama(), optimizer_config().adamw_param_regex)
    expected = {
        f"layers.{i}.{m}.weight"
        for i in range(2)
        for m in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                  "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    }
    assert names(routed.muon) == expected


def test_a_custom_regex_moves_matching_matrices_to_adamw():
    routed = route_parameters(tiny_llama(), r"norm|embed|output|feed_forward")
    assert "layers.0.feed_forward.w1.weight" in names(routed.adamw)
    assert names(routed.muon) == layer_weights(*ATTENTION)


def test_parameters_with_fewer_than_two_dims_go_to_adamw_whatever_their_name():
    routed = route_parameters(tiny_llama(), r"(?!)")  # a regex that matches nothing
    assert all(p.ndim >= 2 for _, p in routed.muon)
    # Every matrix, embeddings and output head included (2-D and not matched); the norms' 1-D weights go to AdamW.
    assert names(routed.muon) == layer_weights(*ATTENTION, *FEED_FORWARD) | {"tok_embeddings.weight", "output.weight"}
    assert names(routed.adamw) == layer_weights(*NORMS) | {"norm.weight"}


def test_frozen_parameters_are_left_out():
    model = tiny_llama()
    model.tok_embeddings.weight.requires_grad_(False)
    routed = route_parameters(model, optimizer_config().adamw_param_regex)
    assert "tok_embeddings.weight" not in names(routed.adamw) | names(routed.muon)


def test_the_default_regex_extends_dmuons_own_default_with_norms():
    from dmuon import DEFAULT_ADAMW_NAME_PATTERN

    assert optimizer_config().adamw_param_regex == DEFAULT_ADAMW_NAME_PATTERN + "|norm"


# ----------------------------------------------------------------- container


def test_dmuon_name_builds_a_dmuon_container():
    container = build([tiny_llama()])
    assert isinstance(container, DMuonOptimizersContainer)
    assert len(container) == 1 and isinstance(next(iter(container)), DMuon)


def test_one_dmuon_per_model_part():
    parts = [tiny_llama(), tiny_llama()]  # as pipeline parallelism hands them over
    container = build(parts)
    assert len(container) == 2
    for part, optimizer in zip(parts, container):
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        assert in_optimizer == {id(p) for p in part.parameters()}


def test_a_step_both_model_parts_skipped_counts_once_in_the_containers_figures():
    # Pipeline parallelism: one DMuon per part, stepped one after the other. A NaN in every
    # part's grads is one training step skipped, not one per part (issue 67, item 5).
    parts = [tiny_llama(), tiny_llama()]
    container = build(parts, "--optimizer.telemetry", "--optimizer.skip_nonfinite")
    generator = torch.Generator().manual_seed(0)
    for step in range(2):  # a NaN step, then a finite one (the count is read one step late)
        for part in parts:
            for param in part.parameters():
                param.grad = torch.randn(param.shape, generator=generator)
                if step == 0:
                    param.grad[(0,) * param.ndim] = float("nan")
        container.step()
    assert [optimizer.skipped_steps for optimizer in container] == [1, 1]
    assert container.telemetry().skipped_steps == 1


def test_every_part_gets_a_muon_group_then_an_adamw_group():
    container = build([tiny_llama(), tiny_llama(n_layers=1)])
    for optimizer in container:
        assert [g["use_muon"] for g in optimizer.param_groups] == [True, False]


def test_a_part_without_parameters_for_one_group_is_rejected_with_advice():
    only_norms = nn.Module()
    only_norms.norm = nn.RMSNorm(64)
    with pytest.raises(ValueError, match=r"model part 1 .* no parameter for the muon group"):
        build([tiny_llama(), only_norms])


def test_a_model_without_adamw_parameters_gets_only_a_muon_group():
    matrices_only = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    (optimizer,) = build([matrices_only])
    assert [g["use_muon"] for g in optimizer.param_groups] == [True]


def test_lr_is_muons_and_adamw_lr_is_the_adamw_groups():
    (optimizer,) = build([tiny_llama()], "--optimizer.lr", "0.02", "--optimizer.adamw_lr", "0.003")
    muon, adamw = optimizer.param_groups
    assert (muon["lr"], adamw["lr"]) == (0.02, 0.003)


def test_without_adamw_lr_both_groups_use_lr():
    (optimizer,) = build([tiny_llama()], "--optimizer.lr", "0.001")
    assert [g["lr"] for g in optimizer.param_groups] == [0.001, 0.001]


def test_betas_eps_and_weight_decay_feed_the_adamw_group():
    (optimizer,) = build([tiny_llama()], "--optimizer.beta1", "0.8", "--optimizer.beta2", "0.9",
                         "--optimizer.eps", "1e-6", "--optimizer.weight_decay", "0.05")
    muon, adamw = optimizer.param_groups
    assert (adamw["betas"], adamw["eps"], adamw["weight_decay"]) == ((0.8, 0.9), 1e-6, 0.05)
    assert muon["weight_decay"] == 0.05


def test_config_fields_map_onto_dmuon_arguments():
    kwargs = dmuon_kwargs(optimizer_config("--optimizer.adjust_lr", "none", "--optimizer.ns_steps", "3",
                                           "--optimizer.momentum", "0.9", "--optimizer.no-nesterov"))
    assert kwargs["adjust_lr"] is None
    assert (kwargs["ns_steps"], kwargs["momentum"], kwargs["nesterov"]) == (3, 0.9, False)


def test_ns_dtype_reaches_every_dmuon_of_the_container():
    (optimizer,) = build([tiny_llama()], "--optimizer.ns_dtype", "float32")
    assert optimizer.ns_dtype == "float32"


@pytest.mark.parametrize("implementation, flags", [("for-loop", (False, False)), ("foreach", (True, False)),
                                                    ("fused", (True, True))])
def test_implementation_reaches_every_dmuon_of_the_container(implementation, flags):
    container = build([tiny_llama(1), tiny_llama(1)], "--optimizer.implementation", implementation)
    assert [(optimizer.foreach, optimizer.fused) for optimizer in container] == [flags, flags]


def test_split_replicas_maps_auto_always_never_onto_none_true_false():
    for value, expected in (("auto", None), ("always", True), ("never", False)):
        assert dmuon_kwargs(optimizer_config("--optimizer.split_replicas", value))["split_replicas"] is expected


def test_lr_scheduler_drives_both_groups():
    container = build([tiny_llama()], "--optimizer.lr", "0.02", "--optimizer.adamw_lr", "0.002")
    lr_config = ConfigManager().parse_args(["--lr_scheduler.warmup_steps", "4"]).lr_scheduler
    schedulers = build_lr_schedulers(container, lr_config, 20)
    (optimizer,) = container
    seen = []
    for _ in range(6):
        container.step()  # no grads yet: parameters stay as they are
        schedulers.step()
        muon, adamw = (g["lr"] for g in optimizer.param_groups)
        assert muon / adamw == pytest.approx(10.0)  # one factor scales both groups
        seen.append(muon)
    assert seen[:4] == sorted(seen[:4]) and seen[4] > seen[5]  # warmup, then decay


def test_the_container_trains_a_model():
    model = tiny_llama()
    container = build([model], "--optimizer.lr", "0.02", "--optimizer.adamw_lr", "0.003")
    tokens = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        container.zero_grad()
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        container.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


# ----------------------------------------------------------------- other optimizers


def test_adamw_name_builds_exactly_torchtitans_container():
    cfg = optimizer_config("--optimizer.name", "AdamW", "--optimizer.implementation", "foreach")
    ours = get_train_spec("llama3").build_optimizers_fn([tiny_llama()], cfg, None)
    stock = build_optimizers([tiny_llama()], cfg, None)
    assert type(ours) is type(stock) is OptimizersContainer
    (ours_opt,), (stock_opt,) = list(ours), list(stock)
    assert type(ours_opt) is type(stock_opt) is torch.optim.AdamW
    assert ours_opt.defaults == stock_opt.defaults
    assert [len(g["params"]) for g in ours_opt.param_groups] == [len(g["params"]) for g in stock_opt.param_groups]


@pytest.mark.parametrize("model_name", ["llama4", "deepseek_v3", "qwen3", "gpt_oss"])
def test_every_builtin_model_spec_builds_dmuon(model_name):
    # MoE specs build through TorchTitan's MoE-aware builder; a model part needs the
    # `layers` ModuleDict that builder inspects.
    part = nn.Module()
    part.layers = nn.ModuleDict({"0": nn.Linear(8, 8, bias=False)})
    part.layers["0"].moe_enabled = False
    part.norm = nn.RMSNorm(8)
    container = get_train_spec(model_name).build_optimizers_fn([part], optimizer_config(), None)
    assert isinstance(container, DMuonOptimizersContainer)


# ----------------------------------------------------------------- resuming with another routing


def _saved_checkpoint(tmp_path) -> str:
    import torch.distributed.checkpoint as dcp

    model = tiny_llama()
    container = build([model])
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    container.step()
    dcp.save({"optimizer": container}, checkpoint_id=str(tmp_path))
    return str(tmp_path)


def test_resuming_with_the_same_routing_passes_the_check(tmp_path):
    from torchtitan_ext.titan02.routing_check import check_routing

    check_routing(build([tiny_llama()]), _saved_checkpoint(tmp_path))


def test_resuming_after_changing_adamw_param_regex_names_the_moved_parameters(tmp_path):
    from torchtitan_ext.titan02.routing_check import check_routing

    checkpoint = _saved_checkpoint(tmp_path)
    regex = r"(tok_embeddings|output|norm|\.wq)\."
    with pytest.raises(ValueError, match="adamw_param_regex") as error:
        check_routing(build([tiny_llama()], "--optimizer.adamw_param_regex", regex), checkpoint)
    message = str(error.value)
    assert "2 parameter(s) moved" in message
    assert "Muon -> AdamW: ['layers.0.attention.wq.weight', 'layers.1.attention.wq.weight']" in message


def test_torchtitan_runs_the_routing_check_before_loading():
    from torchtitan.components.checkpoint import CheckpointManager

    assert getattr(CheckpointManager.dcp_load, "_dmuon_routing_check", False)


# ----------------------------------------------------------------- split_attention_heads


def test_split_attention_heads_gives_wq_wk_wv_a_per_head_muon_group():
    model = tiny_llama()  # dim 64, 4 heads: head_dim 16
    container = build([model], "--optimizer.split_attention_heads")
    heads, muon, adamw = container.optimizers[0].param_groups
    names = {container.optimizers[0].param_name(p) for p in heads["params"]}
    assert names == {f"layers.{i}.attention.{w}.weight" for i in range(2) for w in ("wq", "wk", "wv")}
    assert heads["use_muon"] and heads["split_rows"] == 16
    assert muon["use_muon"] and muon["split_rows"] is None
    assert "layers.0.attention.wo.weight" in {container.optimizers[0].param_name(p) for p in muon["params"]}
    assert not adamw["use_muon"]


def test_without_split_attention_heads_the_groups_are_muon_then_adamw():
    groups = build([tiny_llama()]).optimizers[0].param_groups
    assert [g["use_muon"] for g in groups] == [True, False]
    assert groups[0]["split_rows"] is None


def test_a_container_with_heads_split_trains_a_model():
    model = tiny_llama()
    container = build([model], "--optimizer.split_attention_heads", "--optimizer.lr", "0.02")
    tokens = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(6):
        container.zero_grad()
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        container.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3


def test_capture_step_is_refused_on_a_cpu_run_naming_the_field():
    with pytest.raises(ValueError, match=r"^\[optimizer\] capture_step captures the optimizer step in a CUDA graph: "
                                         r"CUDA only, and this job's parameters are on cpu .*set it to false"):
        build([tiny_llama()], "--optimizer.capture_step")


def test_capture_step_turns_on_capturable_and_is_off_by_default():
    assert dmuon_kwargs(optimizer_config("--optimizer.capture_step"))["capturable"] is True
    (optimizer,) = build([tiny_llama()])
    assert optimizer.capturable is False and isinstance(optimizer.param_groups[0]["lr"], float)

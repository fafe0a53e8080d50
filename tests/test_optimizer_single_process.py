"""DMuon on plain tensors, in one process with no process group."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from dmuon import DMuon
from dmuon.numerics.update_rules import shape_scale

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_thread")]

MUON_SHAPES = [(32, 16), (16, 48), (24, 24)]  # tall, wide, square
# torch.optim.Muon runs Newton-Schulz in bf16: parity tests pin DMuon's ns_dtype to it
# (its default, "auto", is float32 on CPUs without a native bf16 matmul).
TORCH_MUON_DTYPE = "bfloat16"


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.attention = nn.Module()
        self.attention.wq = nn.Linear(dim, dim, bias=False)
        self.feed_forward = nn.Module()
        self.feed_forward.w1 = nn.Linear(dim, hidden, bias=True)


class TinyLM(nn.Module):
    """TorchTitan-like names: tok_embeddings, layers.N..., norm, output."""

    def __init__(self, vocab: int = 11, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim, hidden) for _ in range(2)])
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = h + layer.feed_forward.w1(layer.attention.wq(h))[..., : h.shape[-1]]
        return self.output(self.norm(h))


MUON_NAMES = {
    "layers.0.attention.wq.weight",
    "layers.0.feed_forward.w1.weight",
    "layers.1.attention.wq.weight",
    "layers.1.feed_forward.w1.weight",
}
ADAMW_NAMES = {
    "tok_embeddings.weight",
    "layers.0.feed_forward.w1.bias",
    "layers.1.feed_forward.w1.bias",
    "norm.weight",
    "output.weight",
}


def _tiny_lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def _matrices(shapes=MUON_SHAPES, dtype=torch.float32) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in shapes]


def _clone(params: list[torch.Tensor]) -> list[nn.Parameter]:
    return [nn.Parameter(p.detach().clone()) for p in params]


def _set_grads(params, step: int) -> None:
    for index, param in enumerate(params):
        generator = torch.Generator().manual_seed(1000 * step + index)
        param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)


def _run(optimizer: torch.optim.Optimizer, params, steps: range) -> None:
    for step in steps:
        _set_grads(params, step)
        optimizer.step()


def _assert_bitwise_equal(actual, expected) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


def _group_names(optimizer: DMuon) -> list[tuple[bool, set[str]]]:
    return [(g["use_muon"], {optimizer.param_name(p) for p in g["params"]}) for g in optimizer.param_groups]


def _rms(tensor: torch.Tensor) -> float:
    return tensor.float().pow(2).mean().sqrt().item()


# ------------------------------------------------------------------ parity with torch.optim


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_is_bitwise_torch_optim_muon(adjust_lr, nesterov):
    ours, theirs = _matrices(), _matrices()
    hyper = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    dmuon = DMuon([{"params": ours, "use_muon": True}], adjust_lr=adjust_lr, ns_dtype=TORCH_MUON_DTYPE, **hyper)
    reference = torch.optim.Muon(theirs, adjust_lr_fn=adjust_lr, **hyper)

    _run(dmuon, ours, range(3))
    _run(reference, theirs, range(3))

    _assert_bitwise_equal(ours, theirs)
    _assert_bitwise_equal(
        [dmuon.state[p]["momentum_buffer"] for p in ours], [reference.state[p]["momentum_buffer"] for p in theirs]
    )


def test_adamw_group_is_bitwise_torch_optim_adamw():
    generator = torch.Generator().manual_seed(1)
    shapes = [(8, 4), (5,), (3, 2, 2)]
    ours = [nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
    theirs = _clone(ours)
    dmuon = DMuon(
        [{"params": ours, "use_muon": False}],
        lr=0.5,
        adamw_lr=1e-2,
        adamw_betas=(0.8, 0.99),
        adamw_eps=1e-6,
        adamw_weight_decay=0.05,
    )
    reference = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)

    _run(dmuon, ours, range(3))
    _run(reference, theirs, range(3))

    _assert_bitwise_equal(ours, theirs)
    for p, q in zip(ours, theirs):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(dmuon.state[p][key], reference.state[q][key])


def test_whole_model_is_bitwise_torch_muon_plus_torch_adamw():
    ours, theirs = _tiny_lm(), _tiny_lm()
    dmuon = DMuon(ours.named_parameters(), lr=0.02, weight_decay=0.1, adamw_lr=1e-3, adamw_betas=(0.9, 0.95),
                  ns_dtype=TORCH_MUON_DTYPE)
    muon_params = [p for n, p in theirs.named_parameters() if n in MUON_NAMES]
    adamw_params = [p for n, p in theirs.named_parameters() if n in ADAMW_NAMES]
    muon = torch.optim.Muon(muon_params, lr=0.02, weight_decay=0.1, adjust_lr_fn="original")
    adamw = torch.optim.AdamW(adamw_params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)

    for step in range(3):
        _set_grads(list(ours.parameters()), step)
        _set_grads(list(theirs.parameters()), step)
        dmuon.step()
        muon.step()
        adamw.step()

    _assert_bitwise_equal(list(ours.parameters()), list(theirs.parameters()))


# ------------------------------------------------------------------ routing and groups


def test_default_routing_of_named_parameters():
    """Matrices get Muon; embeddings, the output head, norms and biases get AdamW."""
    optimizer = DMuon(_tiny_lm().named_parameters())
    assert _group_names(optimizer) == [(True, MUON_NAMES), (False, ADAMW_NAMES)]


def test_default_routing_of_unnamed_parameters_is_by_ndim():
    matrix, vector, stack = nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(2, 3, 4))
    optimizer = DMuon([matrix, vector, stack])
    assert [(g["use_muon"], g["params"]) for g in optimizer.param_groups] == [(True, [matrix, stack]), (False, [vector])]


def test_group_without_use_muon_is_split_and_keeps_its_options():
    matrix, vector = nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4))
    optimizer = DMuon([{"params": [matrix, vector], "lr": 0.05, "weight_decay": 0.3}])
    muon_group, adamw_group = optimizer.param_groups
    assert (muon_group["use_muon"], muon_group["params"]) == (True, [matrix])
    assert (adamw_group["use_muon"], adamw_group["params"]) == (False, [vector])
    assert muon_group["lr"] == adamw_group["lr"] == 0.05
    assert muon_group["weight_decay"] == adamw_group["weight_decay"] == 0.3


def test_group_with_use_muon_false_keeps_matrices_in_adamw():
    model = _tiny_lm()
    optimizer = DMuon([{"params": list(model.named_parameters()), "use_muon": False}])
    assert _group_names(optimizer) == [(False, MUON_NAMES | ADAMW_NAMES)]


def test_adamw_lr_and_weight_decay_fall_back_to_lr_and_weight_decay():
    optimizer = DMuon(_tiny_lm().named_parameters(), lr=0.1, weight_decay=0.2)
    adamw_group = optimizer.param_groups[1]
    assert (adamw_group["lr"], adamw_group["weight_decay"]) == (0.1, 0.2)


def test_adamw_options_override_the_fallback():
    optimizer = DMuon(
        _tiny_lm().named_parameters(), lr=0.1, weight_decay=0.2, adamw_lr=3e-3, adamw_weight_decay=0.0,
        adamw_betas=(0.8, 0.9), adamw_eps=1e-5,
    )
    muon_group, adamw_group = optimizer.param_groups
    assert (muon_group["lr"], muon_group["weight_decay"]) == (0.1, 0.2)
    assert (adamw_group["lr"], adamw_group["weight_decay"]) == (3e-3, 0.0)
    assert (adamw_group["betas"], adamw_group["eps"]) == ((0.8, 0.9), 1e-5)


def test_per_group_lr_and_momentum_overrides_are_used():
    ours, theirs = _matrices(), _matrices()
    dmuon = DMuon(
        [{"params": ours[:1], "use_muon": True, "lr": 0.05, "momentum": 0.8}, {"params": ours[1:], "use_muon": True}],
        lr=0.02,
        weight_decay=0.1,
        ns_dtype=TORCH_MUON_DTYPE,
    )
    reference = torch.optim.Muon(
        [{"params": theirs[:1], "lr": 0.05, "momentum": 0.8}, {"params": theirs[1:]}],
        lr=0.02,
        weight_decay=0.1,
        adjust_lr_fn="original",
    )
    assert (dmuon.param_groups[0]["lr"], dmuon.param_groups[0]["momentum"]) == (0.05, 0.8)
    assert (dmuon.param_groups[1]["lr"], dmuon.param_groups[1]["momentum"]) == (0.02, 0.95)

    _run(dmuon, ours, range(2))
    _run(reference, theirs, range(2))

    _assert_bitwise_equal(ours, theirs)


def test_per_group_adamw_overrides_are_used():
    ours = [nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(3, 2))]
    theirs = _clone(ours)
    dmuon = DMuon(
        [{"params": ours[:1], "use_muon": False, "lr": 1e-2, "betas": (0.5, 0.9)}, {"params": ours[1:], "use_muon": False}],
        adamw_lr=1e-3,
        adamw_weight_decay=0.01,
    )
    reference = torch.optim.AdamW(
        [{"params": theirs[:1], "lr": 1e-2, "betas": (0.5, 0.9)}, {"params": theirs[1:]}],
        lr=1e-3,
        betas=(0.9, 0.95),
        weight_decay=0.01,
    )
    _run(dmuon, ours, range(2))
    _run(reference, theirs, range(2))
    _assert_bitwise_equal(ours, theirs)


def test_split_group_applies_muon_only_options_to_its_muon_half():
    matrix, vector = nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4))
    optimizer = DMuon([{"params": [matrix, vector], "momentum": 0.9}])
    assert optimizer.param_groups[0]["momentum"] == 0.9


def test_plain_tensors_take_the_local_path():
    optimizer = DMuon(_tiny_lm().named_parameters())
    assert optimizer.comm_paths() == {name: "local" for name in MUON_NAMES}


# ------------------------------------------------------------------ state


def test_state_keys_are_created_on_the_first_step():
    model = _tiny_lm()
    optimizer = DMuon(model.named_parameters())
    assert len(optimizer.state) == 0

    _run(optimizer, list(model.parameters()), range(1))

    for name, param in model.named_parameters():
        expected = {"momentum_buffer"} if name in MUON_NAMES else {"step", "exp_avg", "exp_avg_sq"}
        assert set(optimizer.state[param]) == expected, name
        if name in ADAMW_NAMES:
            assert optimizer.state[param]["step"].item() == 1


def test_zero_grad_lr0_step_leaves_params_unchanged_and_creates_state():
    model = _tiny_lm()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    optimizer = DMuon(model.named_parameters(), lr=0.0, weight_decay=0.1)
    for param in params:
        param.grad = torch.zeros_like(param)

    optimizer.step()

    _assert_bitwise_equal(params, before)
    assert {name for name, param in model.named_parameters() if optimizer.state[param]} == MUON_NAMES | ADAMW_NAMES
    for name, param in model.named_parameters():
        for value in optimizer.state[param].values():
            if name in MUON_NAMES or value.ndim > 0:
                assert value.shape == param.shape and not value.any()


def test_param_without_grad_is_skipped():
    model = _tiny_lm()
    optimizer = DMuon(model.named_parameters())
    skipped = {"layers.0.attention.wq.weight", "norm.weight"}
    named = dict(model.named_parameters())
    before = {name: p.detach().clone() for name, p in named.items()}
    _set_grads([p for name, p in named.items() if name not in skipped], step=0)

    optimizer.step()

    for name, param in named.items():
        if name in skipped:
            assert torch.equal(param, before[name])
            assert len(optimizer.state.get(param, {})) == 0
        else:
            assert not torch.equal(param, before[name])


def test_state_dict_round_trip_continues_bitwise():
    model = _tiny_lm()
    hyper = dict(lr=0.02, weight_decay=0.1, adamw_lr=1e-3)
    original = DMuon(model.named_parameters(), **hyper)
    _run(original, list(model.parameters()), range(2))

    saved = io.BytesIO()
    torch.save(original.state_dict(), saved)
    saved.seek(0)
    restored_model = copy.deepcopy(model)
    restored = DMuon(restored_model.named_parameters(), **hyper)
    restored.load_state_dict(torch.load(saved))

    _run(original, list(model.parameters()), range(2, 4))
    _run(restored, list(restored_model.parameters()), range(2, 4))

    _assert_bitwise_equal(list(restored_model.parameters()), list(model.parameters()))
    for p, q in zip(restored_model.parameters(), model.parameters()):
        assert restored.state[p].keys() == original.state[q].keys()
        _assert_bitwise_equal(list(restored.state[p].values()), list(original.state[q].values()))


def test_state_dict_keeps_group_kinds_and_hyperparameters():
    optimizer = DMuon(_tiny_lm().named_parameters(), lr=0.03, adamw_lr=1e-3)
    groups = optimizer.state_dict()["param_groups"]
    assert [(g["use_muon"], g["lr"]) for g in groups] == [(True, 0.03), (False, 1e-3)]


# ------------------------------------------------------------------ torch.optim integration


def test_lr_scheduler_drives_lr_of_both_kinds_of_groups():
    optimizer = DMuon(_tiny_lm().named_parameters(), lr=0.02, adamw_lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    optimizer.step()  # no grads: a no-op, keeps the scheduler's order warning away
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.01, 5e-4], rel=1e-12)


def test_step_uses_the_scheduled_lr():
    model = _tiny_lm()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    optimizer = DMuon(model.named_parameters(), lr=0.02, adamw_lr=1e-3, weight_decay=0.1)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.0)

    _run(optimizer, params, range(1))

    _assert_bitwise_equal(params, before)


def test_step_pre_and_post_hooks_fire_in_order():
    optimizer = DMuon(_matrices())
    calls = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append(("pre", opt)))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(("post", opt)))
    optimizer.step()
    optimizer.step()
    assert calls == [("pre", optimizer), ("post", optimizer)] * 2


def test_step_evaluates_closure_once_and_returns_its_loss():
    model = _tiny_lm()
    optimizer = DMuon(model.named_parameters())
    tokens = torch.tensor([[1, 2, 3, 4]])
    before = [p.detach().clone() for p in model.parameters()]
    calls = []

    def closure():
        calls.append(1)
        optimizer.zero_grad()
        loss = model(tokens).square().mean()
        loss.backward()
        return loss

    loss = optimizer.step(closure)

    assert len(calls) == 1
    assert isinstance(loss, torch.Tensor) and loss.ndim == 0
    changed = {name for (name, p), b in zip(model.named_parameters(), before, strict=True) if not torch.equal(p, b)}
    assert changed == MUON_NAMES | ADAMW_NAMES


# ------------------------------------------------------------------ update size and edge cases


@pytest.mark.parametrize("shape", [(64, 16), (16, 64)])
def test_spectral_and_none_adjust_lr_scale_the_update(shape):
    """Starting from zero weights, the update is ``-lr * scale * O`` with the same O."""
    rows, cols = shape
    deltas = {}
    for adjust_lr in ("spectral", None, "original"):
        param = nn.Parameter(torch.zeros(shape))
        optimizer = DMuon([param], lr=0.01, adjust_lr=adjust_lr)
        _run(optimizer, [param], range(1))
        deltas[adjust_lr] = param.detach()
    assert _rms(deltas["spectral"]) / _rms(deltas[None]) == pytest.approx((rows / cols) ** 0.5, rel=1e-6)
    assert _rms(deltas["original"]) / _rms(deltas[None]) == pytest.approx(max(1, rows / cols) ** 0.5, rel=1e-6)


def test_match_rms_adamw_update_has_rms_near_lr_times_matched_rms():
    param = nn.Parameter(torch.zeros(64, 32))
    optimizer = DMuon([param], lr=0.01, adjust_lr="match_rms_adamw", matched_adamw_rms=0.2)
    _run(optimizer, [param], range(1))
    assert _rms(param) == pytest.approx(0.01 * 0.2, rel=0.25)


def test_3d_and_4d_parameters_take_muon_steps():
    params = _matrices([(3, 8, 12), (8, 2, 3, 3)])
    before = [p.detach().clone() for p in params]
    optimizer = DMuon(params)
    assert optimizer.param_groups[0]["use_muon"] and len(optimizer.param_groups) == 1
    _run(optimizer, params, range(1))
    for param, old in zip(params, before):
        assert torch.isfinite(param).all() and not torch.equal(param, old)


def test_bf16_param_without_nesterov_keeps_its_momentum_buffer():
    """torch.optim.Muon's defect: there the in-place normalization overwrites a bf16 buffer."""
    (param,) = _matrices([(16, 32)], dtype=torch.bfloat16)
    optimizer = DMuon([param], nesterov=False, momentum=0.9)
    _set_grads([param], step=0)
    expected = torch.zeros_like(param).lerp_(param.grad, 0.1)

    optimizer.step()

    assert torch.equal(optimizer.state[param]["momentum_buffer"], expected)


def test_nan_grad_makes_that_matrix_non_finite_without_raising():
    poisoned, healthy = _matrices([(8, 16), (8, 16)])
    optimizer = DMuon([poisoned, healthy])
    _set_grads([poisoned, healthy], step=0)
    poisoned.grad[0, 0] = float("nan")

    optimizer.step()

    assert not torch.isfinite(poisoned).any()
    assert torch.isnan(optimizer.state[poisoned]["momentum_buffer"][0, 0])
    assert torch.isfinite(healthy).all()


# ----------------------------------------------------------------- per-head orthogonalization


def test_split_rows_orthogonalizes_each_block_of_rows_on_its_own():
    from dmuon.numerics.newton_schulz import orthogonalize_row_blocks

    generator = torch.Generator().manual_seed(0)
    weight, grad = torch.randn(12, 20, generator=generator), torch.randn(12, 20, generator=generator)
    param = nn.Parameter(weight.clone())
    param.grad = grad.clone()
    DMuon([param], lr=0.1, momentum=0.0, nesterov=False, split_rows=4, adjust_lr="spectral",
          ns_dtype="bfloat16").step()
    scale = shape_scale((4, 20), "spectral", 0.2)  # a block's A x B, not the whole matrix's
    expected = weight.clone().add_(orthogonalize_row_blocks(grad, 4), alpha=-0.1 * scale)
    assert torch.equal(param.detach(), expected)


def test_split_rows_scales_the_update_by_the_block_shape():
    generator = torch.Generator().manual_seed(1)
    weight, grad = torch.randn(8, 4, generator=generator), torch.randn(8, 4, generator=generator)
    split, whole = nn.Parameter(weight.clone()), nn.Parameter(weight.clone())
    split.grad, whole.grad = grad.clone(), grad.clone()
    DMuon([split], lr=0.1, momentum=0.0, nesterov=False, split_rows=4, ns_dtype="bfloat16").step()  # scale 1
    from dmuon.numerics.newton_schulz import orthogonalize_row_blocks

    assert torch.equal(split.detach(), weight - 0.1 * orthogonalize_row_blocks(grad, 4).float())


def test_a_block_of_a_split_is_bit_for_bit_the_block_orthogonalized_alone():
    from dmuon.numerics.newton_schulz import orthogonalize, orthogonalize_row_blocks

    update = torch.randn(12, 20, generator=torch.Generator().manual_seed(2))
    assert torch.equal(orthogonalize_row_blocks(update, 4)[4:8], orthogonalize(update[4:8]))


@pytest.mark.parametrize("shape, split_rows, message", [
    ((10, 8), 4, r"row count is a multiple"),
    ((2, 8, 8), 2, r"needs a 2-D parameter"),
])
def test_split_rows_that_do_not_fit_a_parameter_are_rejected_naming_it(shape, split_rows, message):
    with pytest.raises(ValueError, match=rf"'w'.*{message}"):
        DMuon([{"params": [("w", nn.Parameter(torch.zeros(shape)))], "use_muon": True}], split_rows=split_rows)


@pytest.mark.parametrize("split_rows", [0, -4, 2.5, True])
def test_split_rows_must_be_a_positive_int(split_rows):
    with pytest.raises(ValueError, match="split_rows must be None or a positive int"):
        DMuon([nn.Parameter(torch.zeros(8, 8))], split_rows=split_rows)

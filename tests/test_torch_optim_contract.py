"""DMuon keeps the torch.optim contract as torch.optim.Muon and AdamW keep it.

Each test gives DMuon and torch's optimizers the same inputs and expects the same
outcome: the same bits after a step, the same error, the same ``state_dict`` content.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from dmuon import DMuon
from tests.test_optimizer_single_process import ADAMW_NAMES, MUON_NAMES, TORCH_MUON_DTYPE, TinyLM

MUON_LR, ADAMW_LR, WEIGHT_DECAY = 0.02, 1e-3, 0.1
# DMuon's options that make it torch.optim.Muon (Muon part) plus torch.optim.AdamW (the rest).
HYPER = dict(lr=MUON_LR, adamw_lr=ADAMW_LR, weight_decay=WEIGHT_DECAY, ns_dtype=TORCH_MUON_DTYPE)


@pytest.fixture(autouse=True)
def one_thread():
    """Bitwise comparisons need the same reduction order: one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tiny_lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def _torch_pair(model: nn.Module, muon_lr=MUON_LR, adamw_lr=ADAMW_LR, **adamw) -> list[torch.optim.Optimizer]:
    """torch.optim.Muon on the model's Muon matrices, AdamW on the rest (DMuon's routing)."""
    named = list(model.named_parameters())
    muon = torch.optim.Muon([(n, p) for n, p in named if n in MUON_NAMES], lr=muon_lr, weight_decay=WEIGHT_DECAY,
                            adjust_lr_fn="original")
    adamw = dict(dict(betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY), **adamw)
    return [muon, torch.optim.AdamW([(n, p) for n, p in named if n in ADAMW_NAMES], lr=adamw_lr, **adamw)]


def _params(*optimizers: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter, in group order (DMuon: Muon group first, as in ``_torch_pair``)."""
    return [p for opt in optimizers for g in opt.param_groups for p in g["params"]]


def _step(optimizers, step: int) -> None:
    for index, param in enumerate(_params(*optimizers)):
        param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(1000 * step + index))
    for optimizer in optimizers:
        optimizer.step()


def _run(optimizers, steps: range) -> list[torch.Tensor]:
    for step in steps:
        _step(optimizers, step)
    return [p.detach().clone() for p in _params(*optimizers)]


def _assert_bitwise_equal(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))


# ------------------------------------------------------------------ copies


def _pickle_round_trip(optimizer):
    return pickle.loads(pickle.dumps(optimizer))


@pytest.mark.parametrize("copy_of", [copy.deepcopy, _pickle_round_trip], ids=["deepcopy", "pickle"])
def test_copied_optimizer_steps_bitwise_like_the_original_as_torch_optimizers_do(copy_of):
    dmuon = DMuon(_tiny_lm().named_parameters(), **HYPER)
    reference = _torch_pair(_tiny_lm())
    _run([dmuon], range(2))
    _run(reference, range(2))

    copies = copy_of(dmuon), [copy_of(opt) for opt in reference]

    # The derived caches (paths, plans with their process groups) are not carried over.
    assert "_paths" not in dmuon.__getstate__() and "_fast_plans" not in dmuon.__getstate__()
    public = {k for k in vars(dmuon) if not k.startswith("_")}
    assert {k for k in vars(copies[0]) if not k.startswith("_")} == public
    expected = _run([dmuon], range(2, 3))
    _assert_bitwise_equal(_run([copies[0]], range(2, 3)), expected)
    _assert_bitwise_equal(_run(copies[1], range(2, 3)), expected)
    _assert_bitwise_equal(_run(reference, range(2, 3)), expected)


# ------------------------------------------------------------------ Tensor lr


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_one_element_tensor_lr_of_any_shape_steps_bitwise_like_torch(shape):
    def tensor(value: float) -> torch.Tensor:
        return torch.tensor(value).reshape(shape)

    dmuon = DMuon(_tiny_lm().named_parameters(), **dict(HYPER, lr=tensor(MUON_LR), adamw_lr=tensor(ADAMW_LR)))
    reference = _torch_pair(_tiny_lm(), muon_lr=tensor(MUON_LR), adamw_lr=tensor(ADAMW_LR))
    with_floats = DMuon(_tiny_lm().named_parameters(), **dict(HYPER, lr=tensor(MUON_LR).item(),
                                                              adamw_lr=tensor(ADAMW_LR).item()))

    ours = _run([dmuon], range(3))

    _assert_bitwise_equal(ours, _run(reference, range(3)))
    # torch computes with a Tensor lr in the Tensor's dtype and with a float in float64,
    # so the two may differ in the last bit (torch.optim.AdamW and Muon alike).
    for a, e in zip(ours, _run([with_floats], range(3))):
        torch.testing.assert_close(a, e)


def test_tensor_lr_with_more_than_one_element_is_refused_like_torch():
    matrix, vector, two = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4)), torch.tensor([0.01, 0.02])
    for optimizer_class in (torch.optim.Muon, torch.optim.AdamW):
        with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
            optimizer_class([matrix], lr=two)
    with pytest.raises(ValueError, match=r"^DMuon: a Tensor lr must be 1-element .*got shape \(2,\)"):
        DMuon([matrix], lr=two)
    with pytest.raises(ValueError, match=r"AdamW part\): a Tensor lr must be 1-element"):
        DMuon([matrix], adamw_lr=two)
    optimizer = DMuon([matrix])
    with pytest.raises(ValueError, match=r"param group 1: a Tensor lr must be 1-element"):
        optimizer.add_param_group({"params": [vector], "lr": two})

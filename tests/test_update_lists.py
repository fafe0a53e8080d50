"""The elementwise rules over lists (dmuon.numerics.update_rules): the foreach ops give the
per-tensor rules' bits, for every dtype mix a step meets."""

from __future__ import annotations

import pytest
import torch

from dmuon.numerics.update_rules import apply_muon_, by_signature, lookahead, momentum_, resolve_foreach
from tests.muon_reference import nesterov_lookahead
from dmuon.optimizer import DMuon

pytestmark = pytest.mark.unit

SHAPES = [(6, 10), (3, 7), (1, 5), (4, 2, 3)]
# (parameter and state dtype, update dtype): fp32 and bf16 weights, each with bf16 updates.
DTYPES = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float64, torch.bfloat16)]


def _tensors(seed: int, dtype: torch.dtype, shapes=SHAPES) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]


def _clones(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _apply(params, orthos, lr, weight_decay, scale, cautious, foreach):
    apply_muon_(params, orthos, lr=lr, weight_decay=weight_decay, scale=scale, cautious_weight_decay=cautious,
                foreach=foreach)


def _torch_rule(param: torch.Tensor, ortho: torch.Tensor, lr, weight_decay: float, scale: float) -> None:
    """Muon's apply as torch.optim.Muon writes it, one tensor with torch's own ops: the
    reference the rule is checked against (a Tensor lr with its own arithmetic)."""
    lr = lr.squeeze() if isinstance(lr, torch.Tensor) else lr
    param.mul_(1 - lr * weight_decay)
    _add_in_the_vector_loop_(param, ortho, -lr * scale)


def _add_in_the_vector_loop_(param: torch.Tensor, ortho: torch.Tensor, alpha) -> None:
    """``param.add_(ortho, alpha=alpha)`` with every element in its vector loop: on the CPU a
    bf16 or fp16 ``add_`` rounds ``alpha * ortho`` to that dtype first in the scalar loop over its
    last ``numel % (2 * vector width)`` elements, bits of where an element sits, which a row
    shard could not give (``update_rules.apply_muon_``'s ``addcmul_`` route); padded to 256 elements,
    a multiple of every width's, no element is left to that loop."""
    n = param.numel()
    padded, other = (torch.zeros(n + (-n) % 256, dtype=t.dtype) for t in (param, ortho))
    padded[:n], other[:n] = param.flatten(), ortho.flatten()
    param.copy_(padded.add_(other, alpha=alpha)[:n].view_as(param))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_momentum_as_list_ops_is_bitwise_the_per_tensor_rule(dtype):
    grads = _tensors(0, dtype)
    bufs, expected = _tensors(1, dtype), _tensors(1, dtype)
    momentum_(bufs, grads, 0.95, foreach=True)
    momentum_(expected, grads, 0.95, foreach=False)
    assert _equal(bufs, expected)


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("nesterov", [True, False])
def test_lookahead_of_a_list_is_bitwise_the_per_tensor_rule(nesterov, foreach):
    """Against ``update_rules.nesterov_lookahead``, one pair at a time: with Nesterov
    ``lerp(grad, buf, momentum)``, without it the buffer."""
    grads, bufs = _tensors(0, torch.float32), _tensors(1, torch.float32)
    expected = [nesterov_lookahead(grad, buf, 0.9, nesterov) for grad, buf in zip(grads, bufs)]
    assert _equal(lookahead(grads, bufs, 0.9, nesterov, foreach=foreach), expected)
    assert _equal(expected, bufs) != nesterov  # the two rules differ on these tensors


def test_lookahead_leaves_grads_and_buffers_unchanged():
    grads, bufs = _tensors(0, torch.float32), _tensors(1, torch.float32)
    lookahead(grads, bufs, 0.9, True, foreach=True)
    assert _equal(grads, _tensors(0, torch.float32)) and _equal(bufs, _tensors(1, torch.float32))


@pytest.mark.parametrize(("param_dtype", "update_dtype"), DTYPES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("cautious", [False, True])
def test_the_update_as_list_ops_is_bitwise_the_per_tensor_rule(param_dtype, update_dtype, weight_decay, cautious):
    orthos = _tensors(2, update_dtype)
    params, expected = _tensors(3, param_dtype), _tensors(3, param_dtype)
    _apply(params, orthos, 0.02, weight_decay, 1.7, cautious, foreach=True)
    _apply(expected, orthos, 0.02, weight_decay, 1.7, cautious, foreach=False)
    assert _equal(params, expected)
    if not cautious:
        reference = _tensors(3, param_dtype)
        for param, ortho in zip(reference, orthos):
            _torch_rule(param, ortho, 0.02, weight_decay, 1.7)
        assert _equal(params, reference)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_update_of_row_shards_is_the_whole_matrix_update_bit_for_bit(dtype, foreach):
    """Issue 60, item 3: a (129, 7) bf16 matrix on 2 ranks (rows 0-64 and 65-128) was updated
    with other bits than the whole matrix in the elements ``add_``'s scalar loop took on the
    one and its vector loop on the other (903 = 14 * 64 + 7, 455 = 7 * 64 + 7)."""
    (param,), (ortho,) = _tensors(3, dtype, [(129, 7)]), _tensors(2, torch.bfloat16, [(129, 7)])
    ortho = ortho.to(dtype) * 3  # larger steps: more ties for a rounding to show in
    whole, rows = param.clone(), param.clone()
    _apply([whole], [ortho], 0.05, 0.01, 4.29, False, foreach)
    _apply([rows[:65], rows[65:]], [ortho[:65], ortho[65:]], 0.05, 0.01, 4.29, False, foreach)
    assert torch.equal(rows, whole)
    odd = param.clone()  # and row 0, then rows 1-7 each a shard of its own: 7 elements, all in the scalar loop
    _apply([odd[:1], *odd[1:8].unbind()], [ortho[:1], *ortho[1:8].unbind()], 0.05, 0.01, 4.29, False, foreach)
    assert torch.equal(odd[:8], whole[:8])


def test_a_list_mixing_dtypes_is_stepped_per_signature_with_the_same_bits():
    orthos = _tensors(2, torch.bfloat16)
    params = _tensors(3, torch.float32)[:2] + _tensors(3, torch.bfloat16)[2:]
    expected = _clones(params)
    assert by_signature(params, orthos) == [[0, 1], [2, 3]]
    _apply(params, orthos, 0.02, 0.1, 1.0, False, foreach=True)
    _apply(expected, orthos, 0.02, 0.1, 1.0, False, foreach=False)
    assert _equal(params, expected)


# An lr, decay and scale for which a Tensor lr's arithmetic (in the Tensor's fp32, as
# torch.optim.Muon does it) gives other bits than the same lr as a number (double).
TENSOR_LR, TENSOR_LR_DECAY, TENSOR_LR_SCALE = 0.017, 0.1, 1.7


def test_a_tensor_lr_through_the_list_form_gives_the_bits_of_the_per_tensor_rule():
    """``apply_muon_(foreach=True)`` with a Tensor lr against torch.optim.Muon's own ops one
    tensor at a time, with that Tensor."""
    orthos, lr = _tensors(2, torch.bfloat16), torch.tensor(TENSOR_LR)
    params, expected = _tensors(3, torch.float32), _tensors(3, torch.float32)
    _apply(params, orthos, lr, TENSOR_LR_DECAY, TENSOR_LR_SCALE, False, foreach=True)
    for param, ortho in zip(expected, orthos):
        _torch_rule(param, ortho, lr, TENSOR_LR_DECAY, TENSOR_LR_SCALE)
    assert _equal(params, expected)
    # The list ops with the lr as a number give other bits: a list form that took them would show.
    as_number = _tensors(3, torch.float32)
    _apply(as_number, orthos, lr.item(), TENSOR_LR_DECAY, TENSOR_LR_SCALE, False, foreach=True)
    assert not _equal(as_number, expected)


def test_foreach_none_is_torchs_default_for_the_device():
    assert resolve_foreach(None, torch.device("cpu")) is False  # torch.optim steps CPU tensors one by one
    assert resolve_foreach(None, torch.device("cuda")) is True
    assert resolve_foreach(True, torch.device("cpu")) is True


def _model_params(device: str) -> list[tuple[str, torch.nn.Parameter]]:
    shapes = {"wq": (8, 8), "w1": (12, 8), "w2": (8, 12), "experts": (3, 6, 4), "norm": (8,),
              "tok_embeddings.weight": (10, 8)}
    generator = torch.Generator().manual_seed(4)
    return [(n, torch.nn.Parameter(torch.randn(s, generator=generator).to(device))) for n, s in shapes.items()]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [{}, {"weight_decay": 0.1, "cautious_weight_decay": True, "normuon": True}],
                         ids=["plain", "variants"])
def test_dmuon_with_foreach_steps_the_bits_of_dmuon_without(options, device):
    runs = {}
    for foreach in (True, False):
        params = _model_params(device)
        optimizer = DMuon(params, lr=0.02, foreach=foreach, **options)
        for step in range(3):
            for (_, p), g in zip(params, _tensors(10 + step, torch.float32, [p.shape for _, p in params])):
                p.grad = g.to(device)
            optimizer.step()
        runs[foreach] = {n: p.detach() for n, p in params}
    # Both halves: the Muon matrices and the AdamW ones (the 1-D norm, the embeddings).
    assert {"norm", "tok_embeddings.weight"} < runs[True].keys() == runs[False].keys()
    assert [n for n, p in runs[True].items() if not _equal([p], [runs[False][n]])] == []


@pytest.mark.parametrize("value", [1, 0, "yes", 1.0])
def test_a_foreach_that_is_not_a_bool_or_none_is_rejected_naming_it(value):
    with pytest.raises(ValueError, match="foreach must be True, False or None"):
        DMuon([torch.nn.Parameter(torch.zeros(4, 4))], foreach=value)


@pytest.mark.parametrize("foreach", [False, True])
def test_a_masked_momentum_list_with_empty_tensors_first_in_each_dtype_steps(foreach):
    # A matrix with fewer rows than ranks leaves some rank an empty shard; first in a list it
    # crashed the list form (issue 60, item 2), and an empty one first in its dtype's list
    # would have joined the previous dtype's chunk.
    shapes = [((0, 129), torch.float32), ((3, 4), torch.float32), ((0, 5), torch.bfloat16), ((2, 5), torch.bfloat16)]
    gen = torch.Generator().manual_seed(3)
    bufs = [torch.randn(s, generator=gen).to(d) for s, d in shapes]
    grads = [torch.randn(s, generator=gen).to(d) for s, d in shapes]
    expected = [b.lerp(g, 1 - 0.9) for b, g in zip(bufs, grads)]
    oks = [torch.tensor(True)] * len(bufs)
    momentum_(bufs, grads, 0.9, foreach, oks)
    assert all(torch.equal(b, e) for b, e in zip(bufs, expected))


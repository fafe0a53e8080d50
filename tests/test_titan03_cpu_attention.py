"""``CpuBlockCausalAttention`` (torchtitan_ext/titan03/cpu_attention.py) computes what
TorchTitan 0.3's FlexAttention computes with the per-document causal mask its models build,
and trains on CPU (FlexAttention's CPU backward does not exist).

The references are built from TorchTitan's own pieces: the mask mods the decoder ANDs
(``get_causal_mask_mod`` and ``get_efficient_causal_mask_mod_for_packed_document``) and
the ``VarlenMetadata`` its varlen path derives from the same ``positions``. Skipped without
TorchTitan 0.3 (the main suite runs on the 0.2.x stack).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

from tests.titan03_support import require_titan03  # noqa: E402

require_titan03()

from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention  # noqa: E402
from torchtitan.models.common.attention import (  # noqa: E402
    create_varlen_metadata_for_document,
    get_causal_mask_mod,
    get_efficient_causal_mask_mod_for_packed_document,
)

from torchtitan_ext.titan03.cpu_attention import (  # noqa: E402
    CpuBlockCausalAttention,
    use_cpu_attention,
)

# float32 flex (CPU math path) against SDPA's fused CPU kernel: a few ulps of the
# softmax-weighted sums; gradients pass through one more matmul.
FORWARD_ATOL = 1e-5
BACKWARD_ATOL = 1e-4
SEQ_LEN = 64
HEAD_DIM = 16


def _positions(doc_lengths_per_row: list[list[int]]) -> torch.Tensor:
    """Per-document positions (0, 1, ... restarting at each document), one row per sequence."""
    rows = [torch.cat([torch.arange(n) for n in lengths]) for lengths in doc_lengths_per_row]
    assert all(len(r) == SEQ_LEN for r in rows)
    return torch.stack(rows)


def _qkv(batch: int, n_heads: int, n_kv_heads: int, *, grad: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, SEQ_LEN, n, HEAD_DIM) for n in (n_heads, n_kv_heads, n_kv_heads)]
    return [torch.randn(s, generator=g).requires_grad_(grad) for s in shapes]


def _cpu_attention(q, k, v, positions: torch.Tensor) -> torch.Tensor:
    module = CpuBlockCausalAttention.Config().build()
    masks = create_varlen_metadata_for_document(positions)
    return module(q, k, v, attention_masks=masks, enable_gqa=q.shape[2] != k.shape[2])


def _flex_attention(q, k, v, positions: torch.Tensor) -> torch.Tensor:
    """Eager FlexAttention with the mask TorchTitan's Decoder builds (forward only on CPU)."""
    batch = positions.shape[0]
    mask_mod = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions))
    block_mask = create_block_mask(mask_mod, batch, None, SEQ_LEN, SEQ_LEN, device="cpu")
    out = flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=block_mask,
                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _dense_reference(q, k, v, positions: torch.Tensor) -> torch.Tensor:
    """Explicit masked softmax in float64: the mask written out from the definition."""
    doc = torch.cumsum((positions == 0).long(), dim=1)
    idx = torch.arange(SEQ_LEN)
    allowed = (doc[:, :, None] == doc[:, None, :]) & (idx[None, :, None] >= idx[None, None, :])
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    groups = qd.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(groups, dim=1), vd.repeat_interleave(groups, dim=1)
    scores = (qd @ kd.transpose(-1, -2)) / HEAD_DIM**0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1) @ vd).transpose(1, 2)


# Two sequences, several documents each (different boundaries per row).
MULTI_DOC = [[10, 30, 24], [5, 5, 40, 14]]


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (8, 2)], ids=["MHA", "GQA"])
def test_forward_equals_flex_attention_with_torchtitans_mask(n_heads, n_kv_heads):
    positions = _positions(MULTI_DOC)
    q, k, v = _qkv(len(MULTI_DOC), n_heads, n_kv_heads)
    ours = _cpu_attention(q, k, v, positions)
    torch.testing.assert_close(ours, _flex_attention(q, k, v, positions), atol=FORWARD_ATOL, rtol=0)


def test_backward_matches_dense_reference_with_gqa():
    positions = _positions(MULTI_DOC)
    q, k, v = _qkv(len(MULTI_DOC), 8, 2, grad=True)
    out = _cpu_attention(q, k, v, positions)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    ours = torch.autograd.grad((out * weights).sum(), (q, k, v))
    ref_out = _dense_reference(q, k, v, positions)
    ref = torch.autograd.grad((ref_out * weights.double()).sum(), (q, k, v))
    torch.testing.assert_close(out, ref_out.float(), atol=FORWARD_ATOL, rtol=0)
    for mine, theirs in zip(ours, ref, strict=True):
        torch.testing.assert_close(mine, theirs.float(), atol=BACKWARD_ATOL, rtol=0)


def test_single_document_equals_plain_causal_attention():
    positions = _positions([[SEQ_LEN], [SEQ_LEN]])
    q, k, v = _qkv(2, 4, 4)
    causal = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
    torch.testing.assert_close(_cpu_attention(q, k, v, positions), causal, atol=FORWARD_ATOL, rtol=0)


def test_a_sequence_that_does_not_start_a_document_is_refused():
    positions = _positions(MULTI_DOC)
    positions[1, 0] = 7  # row 1 would continue row 0's last document
    q, k, v = _qkv(2, 4, 4)
    with pytest.raises(ValueError, match="must start a document"):
        _cpu_attention(q, k, v, positions)


def test_use_cpu_attention_replaces_every_layers_inner_attention():
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.llama3 import model_registry

    model = model_registry("debugmodel").model
    n_layers = len(model.layers)
    assert use_cpu_attention(model) == n_layers
    inner = [layer.attention.inner_attention for layer in model.layers]
    assert all(isinstance(c, CpuBlockCausalAttention.Config) for c in inner)
    assert not any(True for _ in model.traverse(FlexAttention.Config))
    assert use_cpu_attention(model) == 0  # idempotent


def test_use_cpu_attention_refuses_a_model_with_masks_of_its_own():
    from torchtitan.models.gpt_oss import model_registry

    with pytest.raises(NotImplementedError, match="builds its own attention masks"):
        use_cpu_attention(model_registry("debugmodel").model)

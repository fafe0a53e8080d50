"""QK-clip from TorchTitan 0.3's configs (torchtitan_ext/titan03/max_logits.py): the
container registers each attention of the real llama3 debug model with DMuon and its
``inner_attention`` pre-hook reports the logits the softmax sees.

In process, on the debug model (6 layers, 16 heads of 16, fused ``wqkv``) with the CPU
inner attention, batches of 2 x 64 tokens holding two documents per sequence. Skipped
without TorchTitan 0.3 (the main suite runs on the 0.2.x stack).
"""

from __future__ import annotations

import pytest

from tests.titan03_support import require_titan03

pytestmark = pytest.mark.unit

require_titan03()

import torch  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402

from dmuon.attention.qk_clip import head_max_logits  # noqa: E402
from torchtitan_ext.titan03.cpu_attention import document_ids_from_boundaries, use_cpu_attention  # noqa: E402
from torchtitan_ext.titan03.optimizer import dmuon_optimizer  # noqa: E402

SEQ_LEN = 64
FIRST_DOCUMENT = 20  # tokens 0..19 one document, 20..63 the next, in both sequences
LAYER0 = "layers.0.attention"
# Any finite threshold turns QK-clip on; this one clips nothing in these tests' steps
# until a test lowers it.
NO_CLIP = 1e9


def _debug_model(seed: int = 0):
    torch.manual_seed(seed)
    config = model_registry("debugmodel").model
    use_cpu_attention(config)
    return config.build()


def _batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 2048, (2, SEQ_LEN), generator=generator)
    positions = torch.cat([torch.arange(FIRST_DOCUMENT), torch.arange(SEQ_LEN - FIRST_DOCUMENT)]).repeat(2, 1)
    return tokens, positions


def _forward(model, tokens, positions):
    return model(tokens, positions, model.get_attention_masks(positions))


def _container(model, **group_options):
    return dmuon_optimizer(**group_options).build(model_parts=[model])


def test_a_bad_qk_clip_threshold_fails_when_the_config_is_made_naming_the_field():
    with pytest.raises(ValueError, match=r"optimizer\.param_groups\[0\]\.optimizer_kwargs.*qk_clip_threshold"):
        dmuon_optimizer(qk_clip_threshold=-1.0)


def test_without_a_threshold_no_attention_is_hooked():
    model = _debug_model()
    container = _container(model)
    assert container.qk_clip_hooks == []
    assert container.optimizers[0].phases.attention_clip.targets == []


def test_every_attention_is_registered_by_its_module_name_with_the_fused_layout():
    model = _debug_model()
    container = _container(model, qk_clip_threshold=NO_CLIP)
    targets = container.optimizers[0].phases.attention_clip.targets
    assert [t.name for t in targets] == [f"layers.{i}.attention" for i in range(len(model.layers))]
    wqkv = model.layers["0"].attention.qkv_linear.wqkv.weight
    assert targets[0].q_weight is wqkv and targets[0].k_weight is wqkv
    assert targets[0].heads.row_layout == "fused_grouped" and targets[0].heads.n_heads == 16


def test_the_hook_reports_the_per_head_maxima_of_the_attentions_own_q_and_k_within_documents():
    model = _debug_model()
    container = _container(model, qk_clip_threshold=NO_CLIP)
    seen = {}

    def capture(module, args, kwargs):
        seen["q"], seen["k"], seen["masks"] = args[0].detach(), args[1].detach(), kwargs["attention_masks"]

    model.layers["0"].attention.inner_attention.register_forward_pre_hook(capture, with_kwargs=True)
    tokens, positions = _batch()
    _forward(model, tokens, positions)
    reported = container.optimizers[0].max_logits.take(LAYER0, 16, torch.device("cpu"))

    q, k = seen["q"].transpose(1, 2), seen["k"].transpose(1, 2)
    doc = document_ids_from_boundaries(seen["masks"].cu_seq_q, 2, SEQ_LEN)
    within = head_max_logits(q, k, mask_mod=lambda b, h, qi, ki: doc[b, qi] == doc[b, ki])
    across = head_max_logits(q, k)  # causal only: also the logits between the two documents
    assert torch.equal(reported, within)
    assert not torch.equal(reported, across), "the test data do not tell the document mask apart"


def test_the_hook_ignores_forwards_without_autograd():
    model = _debug_model()
    container = _container(model, qk_clip_threshold=NO_CLIP)
    with torch.no_grad():
        _forward(model, *_batch())
    assert container.optimizers[0].max_logits.take(LAYER0, 16, torch.device("cpu")).isinf().all()


def test_fused_wqkv_clipping_scales_a_clipped_heads_q_and_k_rows_and_never_v():
    model = _debug_model()
    # lr 0: the step changes the weights only by clipping them.
    container = _container(model, lr=0.0, adamw_lr=0.0, weight_decay=0.0, qk_clip_threshold=NO_CLIP)
    dmuon = container.optimizers[0]
    tokens, positions = _batch()
    _forward(model, tokens, positions)
    maxima = dmuon.max_logits.take(LAYER0, 16, torch.device("cpu"))
    threshold = float(maxima.median())  # about half the heads of layer 0 over it
    for group in dmuon.param_groups:
        if group["use_muon"]:
            group["qk_clip_threshold"] = threshold
    wqkv = model.layers["0"].attention.qkv_linear.wqkv.weight
    before = wqkv.detach().clone()
    _forward(model, tokens, positions).float().mean().backward()
    container.step()
    assert torch.equal(dmuon.last_max_logits()[LAYER0], maxima)  # same batch, same logits

    head_dim = 16
    rows = before.view(16, 3, head_dim, -1)  # per key head (MHA: one query head each): q, k, v rows
    after = wqkv.detach().view(16, 3, head_dim, -1)
    over = maxima > threshold
    assert 0 < int(over.sum()) < 16
    for head in range(16):
        assert torch.equal(after[head, 2], rows[head, 2]), f"head {head}'s v rows changed"
        if over[head]:
            factor = (threshold / maxima[head]).sqrt()
            for part in (0, 1):
                torch.testing.assert_close(after[head, part], rows[head, part] * factor)
        else:
            assert torch.equal(after[head, :2], rows[head, :2]), f"unclipped head {head} changed"


def test_an_attention_with_qk_norm_is_refused_naming_it():
    from torchtitan.models.qwen3 import model_registry as qwen3_registry

    config = qwen3_registry("debugmodel").model
    use_cpu_attention(config)
    model = config.build()
    with pytest.raises(ValueError, match=r"layers\.0\.attention has a QK-norm.*qk_clip_threshold"):
        _container(model, qk_clip_threshold=NO_CLIP)


def test_the_step_line_shows_max_logit_and_clipped_heads_only_with_qk_clip():
    from torchtitan.tools.utils import NoColor

    from dmuon.step.telemetry import StepFigures
    from torchtitan_ext.step_figures import console_text

    sums = [4.0, 100.0, 400.0, 1.0, 25.0, 100.0]
    with_clip = StepFigures.from_sums(0.15, 0.1, 2**20, sums, max_logit=12.5, qk_clipped_heads=3)
    assert console_text(with_clip, NoColor()).endswith("max_logit: 12.50  clipped_heads: 3")
    assert "max_logit" not in console_text(StepFigures.from_sums(0.15, 0.1, 2**20, sums), NoColor())


def test_multi_head_latent_attention_is_refused_naming_it():
    from torchtitan.models.deepseek_v3 import model_registry as deepseek_registry

    model = deepseek_registry("debugmodel").model.build()
    with pytest.raises(ValueError, match=r"layers\.0\.attention .*multi-head latent attention"):
        _container(model, qk_clip_threshold=NO_CLIP)


# A 2-rank "fake" process group (torch's test backend: collectives do nothing) in a
# fresh interpreter, so the test process keeps no default group: enough to build a
# DTensor on a mesh with a 2-wide ``cp`` axis, which is all the check reads.
_CONTEXT_PARALLEL_CHILD = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Replicate
from torchtitan_ext.titan03.max_logits import _refuse_context_parallel
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
try:
    _refuse_context_parallel("layers.0.attention", distribute_tensor(torch.ones(4, 4), mesh, [Replicate()]))
except ValueError as error:
    print(error)
"""


def test_context_parallel_weights_are_refused_naming_the_attention():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _CONTEXT_PARALLEL_CHILD], capture_output=True, text=True, timeout=120)
    assert "layers.0.attention runs under context parallelism" in out.stdout, out.stderr[-2000:]

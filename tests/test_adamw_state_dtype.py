"""``DMuon(adamw_state_dtype=...)`` in one process: the AdamW part's moments kept in bf16 or
int8 (``dmuon.state.kept_state``): the forms each parameter gets, the rule's bits against
torch's AdamW on the moments as read, every implementation alike, a masked step, and a resume
or an edit that converts the form. Multi-rank exactness: tests/test_adamw_state_ranks.py."""

from __future__ import annotations

import logging

import pytest
import torch

from dmuon import DMuon
from dmuon.state import kept_state
from dmuon.numerics.momentum_storage import dequantize_int8, quantize_int8

pytestmark = pytest.mark.unit

SHAPES = {"tok_embeddings.weight": (24, 300), "output.weight": (6, 256), "norm.weight": (300,),
          "narrow.weight": (9, 3)}
INT8_KEYS = ("exp_avg_int8", "exp_avg_scales", "exp_avg_sq_root_int8", "exp_avg_sq_root_scales")
BETAS, EPS, LR, WD = (0.9, 0.95), 1e-8, 1e-3, 0.1


def _params(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.nn.Parameter(torch.randn(shape, generator=generator)) for name, shape in SHAPES.items()}


def _grads(params: dict[str, torch.Tensor], step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for param in params.values():
        param.grad = torch.randn(param.shape, generator=generator) * 10 ** torch.empty(1).uniform_(-3, 0, generator=generator)


def _stepped(state_dtype, steps: int = 3, **options):
    params = _params()
    optimizer = DMuon([{"params": list(params.items()), "use_muon": False}], lr=LR, weight_decay=WD,
                      adamw_betas=BETAS, adamw_state_dtype=state_dtype, **options)
    for step in range(steps):
        _grads(params, step)
        optimizer.step()
    return params, optimizer


def _held(state: dict) -> str:
    return "int8" if "exp_avg_int8" in state else str(state["exp_avg"].dtype).removeprefix("torch.")


@pytest.mark.parametrize("value", ["fp8", torch.float16, 8])
def test_an_unknown_adamw_state_dtype_is_refused_naming_the_option(value):
    with pytest.raises(ValueError, match=r"state_dtype must be one of None .*'int8'"):
        DMuon([torch.nn.Parameter(torch.zeros(4, 4))], adamw_state_dtype=value)


@pytest.mark.parametrize("state_dtype, matrices", [(None, "float32"), ("bfloat16", "bfloat16"), ("int8", "int8")])
def test_matrices_keep_the_asked_form_vectors_their_dtype_and_narrow_rows_bf16(state_dtype, matrices):
    params, optimizer = _stepped(state_dtype)
    held = {name: _held(optimizer.state[p]) for name, p in params.items()}
    assert held == {"tok_embeddings.weight": matrices, "output.weight": matrices, "norm.weight": "float32",
                    "narrow.weight": "bfloat16" if state_dtype else "float32"}


def test_a_narrow_int8_state_falls_back_to_bf16_with_one_log_line_naming_it(caplog):
    with caplog.at_level(logging.INFO, logger="dmuon"):
        _stepped("int8")
    lines = [r.getMessage() for r in caplog.records if "not int8" in r.getMessage()]
    assert len(lines) == 1 and "'narrow.weight' keeps its AdamW moments in bfloat16" in lines[0]


@pytest.mark.parametrize("state_dtype, most_bytes", [("bfloat16", 4.0), ("int8", 2.07)])
def test_the_moments_of_a_matrix_cost_their_bytes_per_element(state_dtype, most_bytes):
    params, optimizer = _stepped(state_dtype)
    param = params["output.weight"]  # rows of whole blocks
    moments = [t for k, t in optimizer.state[param].items() if k != "step"]
    assert sum(t.nbytes for t in moments) / param.numel() <= most_bytes


def _kept(values: torch.Tensor, scales: torch.Tensor, root: bool) -> torch.Tensor:
    read = dequantize_int8(values, scales, torch.float32)
    return read.square() if root else read


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_a_step_is_torchs_adamw_on_the_moments_as_read_then_rounded_back(state_dtype):
    """The rule: read the moments as fp32 (int8: exp_avg_sq as the square of its root), step
    torch.optim.AdamW on them, round the result back (int8: the root of exp_avg_sq)."""
    params, optimizer = _stepped(state_dtype, steps=2)
    param = params["tok_embeddings.weight"]
    state = optimizer.state[param]
    if state_dtype == "int8":
        exp_avg = _kept(state["exp_avg_int8"], state["exp_avg_scales"], False)
        exp_avg_sq = _kept(state["exp_avg_sq_root_int8"], state["exp_avg_sq_root_scales"], True)
    else:
        exp_avg, exp_avg_sq = state["exp_avg"].float(), state["exp_avg_sq"].float()
    twin = torch.nn.Parameter(param.detach().clone())
    reference = torch.optim.AdamW([twin], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    reference.state[twin] = {"step": state["step"].clone(), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    _grads(params, 2)
    twin.grad = param.grad.clone()
    optimizer.step()
    reference.step()
    assert torch.equal(param, twin)
    after = reference.state[twin]
    if state_dtype == "int8":
        for values, scales, want in ((state["exp_avg_int8"], state["exp_avg_scales"], after["exp_avg"]),
                                     (state["exp_avg_sq_root_int8"], state["exp_avg_sq_root_scales"],
                                      after["exp_avg_sq"].sqrt())):
            expected = quantize_int8(want)
            assert torch.equal(values, expected[0]) and torch.equal(scales, expected[1])
    else:
        assert torch.equal(state["exp_avg"], after["exp_avg"].bfloat16())
        assert torch.equal(state["exp_avg_sq"], after["exp_avg_sq"].bfloat16())


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("flags", [dict(foreach=False), dict(foreach=True), dict(capturable=True),
                                   dict(cautious_weight_decay=True, foreach=False)])
def test_the_for_loop_list_and_capturable_forms_step_to_the_same_bits(state_dtype, flags):
    cautious = flags.get("cautious_weight_decay", False)
    base, base_optimizer = _stepped(state_dtype, cautious_weight_decay=cautious)
    params, optimizer = _stepped(state_dtype, **flags)
    for name, param in params.items():
        assert torch.equal(param, base[name]), name
        mine, theirs = optimizer.state[param], base_optimizer.state[base[name]]
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs if k != "step"), name


PIECE_SHAPES = {"tok_embeddings.weight": (24, 300), "output.weight": (6, 256), "many_rows.weight": (200, 40),
                "experts.weight": (3, 5, 128), "norm.weight": (300,)}


def _stepped_in_pieces(state_dtype, piece_numel: int, monkeypatch, **flags):
    monkeypatch.setattr(kept_state, "CPU_PIECE_NUMEL", piece_numel)
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in PIECE_SHAPES.values()]
    optimizer = DMuon([{"params": params, "use_muon": False}], lr=LR, weight_decay=WD, adamw_betas=BETAS,
                      adamw_state_dtype=state_dtype, **flags)
    for step in range(3):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("flags", [dict(foreach=False), dict(foreach=True), dict(fused=True), dict(capturable=True),
                                   dict(cautious_weight_decay=True)])
def test_a_step_in_row_pieces_gives_the_bits_of_the_step_on_whole_tensors(state_dtype, flags, monkeypatch):
    # one row a piece; fused: 64 rows (its CPU kernel computes a piece's tail otherwise)
    whole, whole_optimizer = _stepped_in_pieces(state_dtype, 1 << 30, monkeypatch, **flags)
    cut, optimizer = _stepped_in_pieces(state_dtype, 64 * 40 if flags.get("fused") else 1, monkeypatch, **flags)
    for name, mine, theirs in zip(PIECE_SHAPES, cut, whole):
        assert torch.equal(mine, theirs), name
        state, expected = optimizer.state[mine], whole_optimizer.state[theirs]
        assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state), name


def test_a_parameter_is_cut_into_pieces_of_whole_rows_with_its_moments_rows():
    state = {"exp_avg_int8": torch.zeros(200, 40, dtype=torch.int8), "exp_avg_scales": torch.zeros(200, 1),
             "exp_avg_sq": torch.zeros(200, 40, dtype=torch.bfloat16)}
    pieces = kept_state.step_pieces([state, {}], [torch.zeros(200, 40), torch.zeros(7)], kept_state.ADAMW_MOMENTS,
                                    [True, True])
    per_piece = (kept_state.CPU_PIECE_NUMEL // 40) // 64 * 64
    assert pieces[0] == kept_state.Piece([1])  # held in its own dtype: stepped whole, as a list
    assert [p.rows for p in pieces[1:]] == [slice(r, min(r + per_piece, 200)) for r in range(0, 200, per_piece)]
    rows = kept_state.state_rows(state, slice(3, 5), kept_state.ADAMW_MOMENTS)
    assert {k: t.shape for k, t in rows.items()} == {"exp_avg_int8": (2, 40), "exp_avg_scales": (2, 1),
                                                     "exp_avg_sq": (2, 40)}
    assert rows["exp_avg_int8"].data_ptr() == state["exp_avg_int8"][3].data_ptr()  # views: stores write through


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("fused", [None, True])  # selected back after the step; torch's own skip (found_inf)
def test_a_step_skipped_for_a_nonfinite_grad_changes_no_bit_of_the_kept_moments(state_dtype, fused):
    params, optimizer = _stepped(state_dtype, skip_nonfinite=True, fused=fused)
    before = {name: {k: t.clone() for k, t in optimizer.state[p].items()} for name, p in params.items()}
    weights = {name: p.detach().clone() for name, p in params.items()}
    _grads(params, 7)
    params["output.weight"].grad[0, 0] = float("nan")
    optimizer.step()
    optimizer.state_dict()  # counts the skip
    assert optimizer.skipped_steps == 1
    for name, param in params.items():
        assert torch.equal(param, weights[name])
        assert all(torch.equal(optimizer.state[param][k], t) for k, t in before[name].items()), name


def test_a_float32_checkpoint_resumed_with_int8_rounds_each_moment_once(caplog):
    params, saved = _stepped(None)
    resumed = DMuon([{"params": list(params.items()), "use_muon": False}], lr=LR, weight_decay=WD,
                    adamw_betas=BETAS, adamw_state_dtype="int8")
    with caplog.at_level(logging.INFO, logger="dmuon"):
        resumed.load_state_dict(saved.state_dict())
    state, fp32 = resumed.state[params["output.weight"]], saved.state[params["output.weight"]]
    assert all(torch.equal(a, b) for a, b in zip(quantize_int8(fp32["exp_avg"]),
                                                 (state["exp_avg_int8"], state["exp_avg_scales"])))
    assert all(torch.equal(a, b) for a, b in zip(quantize_int8(fp32["exp_avg_sq"].sqrt()),
                                                 (state["exp_avg_sq_root_int8"], state["exp_avg_sq_root_scales"])))
    assert "DMuon: AdamW moments converted on resume from float32 to int8: tok_embeddings.weight, output.weight" \
        in caplog.text


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_a_resume_through_state_dict_continues_bit_for_bit(state_dtype):
    whole, whole_optimizer = _stepped(state_dtype, steps=4)
    params, optimizer = _stepped(state_dtype, steps=2)
    resumed = DMuon([{"params": list(params.items()), "use_muon": False}], lr=LR, weight_decay=WD,
                    adamw_betas=BETAS, adamw_state_dtype=state_dtype)
    resumed.load_state_dict(optimizer.state_dict())
    for name, param in params.items():  # each moment in its saved form (torch's load casts to the parameter's)
        assert {k: t.dtype for k, t in resumed.state[param].items()} == \
            {k: t.dtype for k, t in optimizer.state[param].items()}, name
    for step in (2, 3):
        _grads(params, step)
        resumed.step()
    assert all(torch.equal(params[name], whole[name]) for name in SHAPES)


@pytest.mark.parametrize("old, new", [(None, "int8"), ("int8", "bfloat16"), ("bfloat16", None)])
def test_a_state_dtype_edited_between_steps_converts_the_moments_as_a_resume_does(old, new):
    params, optimizer = _stepped(old)
    optimizer.param_groups[0]["state_dtype"] = new
    _grads(params, 5)
    optimizer.step()
    twin, twin_optimizer = _stepped(old)
    resumed = DMuon([{"params": list(twin.items()), "use_muon": False}], lr=LR, weight_decay=WD,
                    adamw_betas=BETAS, adamw_state_dtype=new)
    resumed.load_state_dict(twin_optimizer.state_dict())
    _grads(twin, 5)
    resumed.step()
    assert {_held(optimizer.state[p]) for n, p in params.items() if n != "norm.weight"} == \
        {_held(resumed.state[p]) for n, p in twin.items() if n != "norm.weight"}
    assert all(torch.equal(params[name], twin[name]) for name in SHAPES)

"""``DMuon(momentum_dtype=...)`` in one process: the option's rules, the state each form
keeps, and a resume that keeps, or converts, the saved form (``dmuon.state.kept_state``)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dmuon import DMuon
from dmuon.numerics.momentum_storage import dequantize_int8, quantize_int8

pytestmark = pytest.mark.unit

SHAPE = (16, 300)  # three blocks a row, the last one short


def _stepped(momentum_dtype, steps: int = 2, param: torch.nn.Parameter | None = None):
    param = param if param is not None else torch.nn.Parameter(
        torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)))
    optimizer = DMuon([("w", param)], lr=0.02, momentum_dtype=momentum_dtype, ns_dtype="float32")
    for step in range(steps):
        param.grad = torch.randn(SHAPE, generator=torch.Generator().manual_seed(10 + step)).to(param.dtype)
        optimizer.step()
    return param, optimizer


def _state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("value", ["fp8", torch.float16, 8])
def test_an_unknown_momentum_dtype_is_refused_naming_the_option_and_the_allowed_values(value):
    with pytest.raises(ValueError, match=r"DMuon: momentum_dtype must be one of None .*'int8'"):
        DMuon([torch.nn.Parameter(torch.zeros(4, 4))], momentum_dtype=value)


def test_a_groups_momentum_dtype_is_checked_naming_the_group():
    with pytest.raises(ValueError, match=r"DMuon param group 0: momentum_dtype must be one of"):
        DMuon([{"params": [torch.nn.Parameter(torch.zeros(4, 4))], "use_muon": True, "momentum_dtype": "int4"}])


@pytest.mark.parametrize("momentum_dtype, key, held, most_bytes", [(None, "momentum_buffer", torch.float32, 4.0),
                                                                   (torch.bfloat16, "momentum_buffer", torch.bfloat16, 2.0),
                                                                   ("int8", "momentum_int8", torch.int8, 1.05)])
def test_each_form_keeps_its_dtype_within_its_bytes_per_element(momentum_dtype, key, held, most_bytes):
    param, optimizer = _stepped(momentum_dtype)
    state = optimizer.state[param]
    assert state[key].dtype == held
    assert _state_bytes(state) / param.numel() <= most_bytes


def test_int8_momentum_keeps_one_fp32_scale_per_block_of_a_row():
    param, optimizer = _stepped("int8")
    scales = optimizer.state[param]["momentum_scales"]
    assert scales.dtype == torch.float32 and tuple(scales.shape) == (16, 3)


def test_a_bf16_parameters_bf16_momentum_steps_as_the_default():
    start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).bfloat16()
    runs = [_stepped(dtype, param=torch.nn.Parameter(start.clone()))[0] for dtype in (None, "bfloat16")]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("momentum_dtype", ["bfloat16", "int8"])
def test_a_resume_through_state_dict_continues_bit_for_bit(momentum_dtype):
    whole, _ = _stepped(momentum_dtype, steps=3)
    param, optimizer = _stepped(momentum_dtype, steps=2)
    saved = optimizer.state_dict()
    resumed = DMuon([("w", param)], lr=0.02, momentum_dtype=momentum_dtype, ns_dtype="float32")
    resumed.load_state_dict(saved)
    param.grad = torch.randn(SHAPE, generator=torch.Generator().manual_seed(12))
    resumed.step()
    assert torch.equal(param, whole)


def test_an_int8_checkpoint_resumed_without_it_reads_the_momentum_it_held(caplog):
    param, optimizer = _stepped("int8")
    saved = optimizer.state_dict()
    held = dequantize_int8(saved["state"][0]["momentum_int8"], saved["state"][0]["momentum_scales"], torch.float32)
    resumed = DMuon([("w", param)], lr=0.02, ns_dtype="float32")
    with caplog.at_level(logging.INFO, logger="dmuon"):
        resumed.load_state_dict(saved)
    assert set(resumed.state[param]) == {"momentum_buffer"}
    assert torch.equal(resumed.state[param]["momentum_buffer"], held)
    assert "DMuon: momentum converted on resume from int8 to float32: w" in caplog.text
    assert "DMuon: changed on resume: momentum_dtype int8 -> None" in caplog.text


def test_a_float32_checkpoint_resumed_with_int8_rounds_its_momentum_once():
    param, optimizer = _stepped(None)
    saved = optimizer.state_dict()
    resumed = DMuon([("w", param)], lr=0.02, momentum_dtype="int8", ns_dtype="float32")
    resumed.load_state_dict(saved)
    values, scales = quantize_int8(saved["state"][0]["momentum_buffer"])
    assert resumed.param_groups[0]["momentum_dtype"] == "int8"  # the optimizer's value, not the checkpoint's
    assert torch.equal(resumed.state[param]["momentum_int8"], values)
    assert torch.equal(resumed.state[param]["momentum_scales"], scales)


# ------------------------------------------------- a group's momentum_dtype edited between steps (issue 60, item 6)

@pytest.mark.parametrize("old, new", [(None, "int8"), ("int8", None), ("int8", "bfloat16"), (None, torch.bfloat16)])
def test_a_momentum_dtype_edited_between_steps_converts_the_momentum_as_a_resume_does(old, new, caplog):
    param, optimizer = _stepped(old, steps=2)
    resumed_param = torch.nn.Parameter(param.detach().clone())
    resumed = DMuon([("w", resumed_param)], lr=0.02, momentum_dtype=new, ns_dtype="float32")
    resumed.load_state_dict(optimizer.state_dict())
    optimizer.param_groups[0]["momentum_dtype"] = new
    with caplog.at_level(logging.INFO, logger="dmuon"):
        for p, opt in ((param, optimizer), (resumed_param, resumed)):
            p.grad = torch.randn(SHAPE, generator=torch.Generator().manual_seed(99))
            opt.step()
    assert torch.equal(param, resumed_param)
    assert optimizer.state[param].keys() == resumed.state[resumed_param].keys()
    assert all(torch.equal(optimizer.state[param][k], resumed.state[resumed_param][k]) for k in optimizer.state[param])
    assert optimizer.param_groups[0]["momentum_dtype"] == ("bfloat16" if new is torch.bfloat16 else new)
    assert "DMuon: momentum converted after param_groups changed from" in caplog.text


@pytest.mark.parametrize("value", ["fp8", torch.float16, "int4"])
def test_an_illegal_momentum_dtype_edited_into_a_group_is_refused_at_the_next_step_naming_it(value):
    param, optimizer = _stepped("int8", steps=1)
    before = {k: t.clone() for k, t in optimizer.state[param].items()}
    weights = param.detach().clone()
    optimizer.param_groups[0]["momentum_dtype"] = value
    param.grad = torch.ones(SHAPE)
    with pytest.raises(ValueError, match=r"param_groups\[0\] \(w\), edited after construction: momentum_dtype must"):
        optimizer.step()
    assert torch.equal(param, weights)
    assert all(torch.equal(optimizer.state[param][k], t) for k, t in before.items())


# ------------------------------------------------------------------- the reads' masks

def test_a_masked_read_keeps_each_mask_with_its_momentum_when_some_have_no_state_yet():
    # The masks of the kept momenta only, in their order: a parameter without state (its
    # first grad) shifts nothing.
    from dmuon.state.kept_state import MomentumReads, new_momentum

    likes = [torch.zeros(2, 128), torch.zeros(3, 128), torch.zeros(4, 128)]
    states = [None, new_momentum(likes[1], "int8"), new_momentum(likes[2], "int8")]
    oks = [torch.tensor(True), torch.tensor(False), torch.tensor(True)]
    reads = MomentumReads()
    working = reads.read(states, likes, oks)
    for work in working:
        work.fill_(1.0)
    reads.store()
    assert torch.all(states[1]["momentum_int8"] == 0) and torch.all(states[1]["momentum_scales"] == 0)  # masked
    assert torch.all(states[2]["momentum_int8"] == 127)  # stored: 1.0 is its block's maximum


@pytest.mark.parametrize("momentum_dtype", ["bfloat16", "int8"])
def test_a_masked_step_stores_each_momentum_beside_a_parameter_without_state_as_a_single_process(
        one_rank_gloo, momentum_dtype):
    # A one-rank mesh steps its DTensors on the local path under their masks. The first
    # parameter never has a grad (no state, its mask False); the second's momentum is read,
    # stepped and stored under its own mask (True), bitwise as single process (issue 67, item 5).
    mesh = init_device_mesh("cpu", (1,))
    generator = torch.Generator().manual_seed(0)
    idle_start, start = torch.randn(4, 128, generator=generator), torch.randn(SHAPE, generator=generator)
    idle = torch.nn.Parameter(distribute_tensor(idle_start.clone(), mesh, [Shard(0)]))
    param = torch.nn.Parameter(distribute_tensor(start.clone(), mesh, [Shard(0)]))
    optimizer = DMuon([("idle", idle), ("w", param)], lr=0.02, momentum_dtype=momentum_dtype, ns_dtype="float32")
    oracle = torch.nn.Parameter(start.clone())
    reference = DMuon([("w", oracle)], lr=0.02, momentum_dtype=momentum_dtype, ns_dtype="float32")
    for step in range(3):
        grad = torch.randn(SHAPE, generator=torch.Generator().manual_seed(10 + step))
        param.grad, oracle.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)]), grad.clone()
        optimizer.step()
        reference.step()
    assert optimizer.comm_paths() == {"idle": "local", "w": "local"}
    assert torch.equal(idle.detach().to_local(), idle_start) and idle not in optimizer.state
    assert torch.equal(param.detach().to_local(), oracle.detach())
    state, expected = optimizer.state[param], reference.state[oracle]
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k].to_local(), expected[k]) for k in expected)

"""The Newton-Schulz compute dtype (``ns_dtype``): what each choice computes, how
"auto" decides, and that every front end validates it with one rule."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from dmuon import DMuon
from dmuon.numerics.newton_schulz import (
    NS_DTYPE_CHOICES,
    UPDATE_DTYPE,
    native_bf16_matmul,
    orthogonalize,
    resolve_ns_dtype,
)
from dmuon.numerics.cpu_bf16 import bf16_gemm_verdict, cpu_facts
from dmuon.options.checks import check_ns_dtype

pytestmark = pytest.mark.unit

# What a CPU without bf16 hardware looks like to torch (scripts/as_avx2.sh): ATen's, oneDNN's
# and MKL's kernels capped at AVX2 (then torch.ops.mkldnn._is_mkldnn_bf16_supported() is False).
AVX2_ONLY_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(UPDATE_DTYPE)


def _polar_error(result: torch.Tensor, update: torch.Tensor) -> float:
    """Distance of ``result`` from the exact polar factor U V^T of ``update``."""
    u, _, vh = torch.linalg.svd(update.double(), full_matrices=False)
    return (result.double() - u @ vh).norm().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (3, 8, 20)])
def test_every_compute_dtype_returns_a_bf16_result_of_the_input_shape(shape, dtype):
    result = orthogonalize(_randn(*shape), dtype=dtype)
    assert result.dtype == UPDATE_DTYPE and result.shape == shape


def test_float32_newton_schulz_is_the_same_iteration_run_in_float32():
    update = _randn(24, 40)
    x = update.float()
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = 3.4445 * x + (-4.7750 * gram + 2.0315 * gram @ gram) @ x
    torch.testing.assert_close(orthogonalize(update, dtype=torch.float32).float(), x.bfloat16().float(),
                               atol=1e-2, rtol=0)


def test_float32_newton_schulz_differs_from_bf16_and_lands_nearer_the_polar_factor():
    update = _randn(64, 96)
    in_fp32, in_bf16 = orthogonalize(update, dtype=torch.float32), orthogonalize(update, dtype=torch.bfloat16)
    assert not torch.equal(in_fp32, in_bf16)
    assert _polar_error(in_fp32, update) < _polar_error(in_bf16, update)


def test_float32_newton_schulz_is_bitwise_reproducible_and_never_modifies_its_input():
    update = _randn(32, 16)
    before = update.clone()
    assert torch.equal(orthogonalize(update, dtype=torch.float32), orthogonalize(update, dtype=torch.float32))
    assert torch.equal(update, before)


def test_accelerators_count_as_native_bf16():
    assert native_bf16_matmul("cuda") and native_bf16_matmul("xpu")


def test_auto_follows_the_cpu_rule_and_explicit_choices_are_taken_as_given():
    native = bf16_gemm_verdict(cpu_facts())[0]
    assert resolve_ns_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
    assert resolve_ns_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_ns_dtype("float32", "cuda") == torch.float32
    assert resolve_ns_dtype("bfloat16", "cpu") == torch.bfloat16


def test_auto_is_float32_on_a_cpu_without_bf16_hardware_and_says_so_once():
    script = (
        "import logging, torch; logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "from dmuon import DMuon\n"
        "opt = DMuon([torch.nn.Parameter(torch.randn(8, 4))])\n"
        "for _ in range(2):\n"
        "    opt.param_groups[0]['params'][0].grad = torch.randn(8, 4); opt.step()\n"
        "from dmuon.numerics.newton_schulz import resolve_ns_dtype\n"
        "print('capability', torch.backends.cpu.get_cpu_capability(), resolve_ns_dtype('auto', 'cpu'))\n"
    )
    env = dict(os.environ, **AVX2_ONLY_ENV)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "capability AVX2 torch.float32" in out.stdout
    lines = [line for line in out.stderr.splitlines() if "ns_dtype='auto'" in line]
    assert lines == ["DMuon: ns_dtype='auto' runs Newton-Schulz in float32 on cpu (capability AVX2, "
                     "no oneDNN bf16 GEMM: bf16 matmul is a scalar fallback, native bf16 matmul: no)"]


@pytest.mark.parametrize("value, name", [("bfloat16", "bfloat16"), (torch.float32, "float32"), ("auto", "auto")])
def test_ns_dtype_accepts_the_choices_and_their_torch_dtypes(value, name):
    assert DMuon([nn.Parameter(torch.zeros(4, 4))], ns_dtype=value).ns_dtype == name


@pytest.mark.parametrize("bad", ["fp16", "float16", torch.float16, None, "BF16"])
def test_an_unknown_ns_dtype_is_rejected_with_the_same_message_from_every_front_end(bad):
    with pytest.raises(ValueError) as from_validator:
        check_ns_dtype(bad, "where")
    with pytest.raises(ValueError) as from_dmuon:
        DMuon([nn.Parameter(torch.zeros(4, 4))], ns_dtype=bad)
    rule = str(from_validator.value).removeprefix("where: ")
    assert str(from_dmuon.value) == f"DMuon: {rule}"
    assert all(repr(choice) in rule for choice in NS_DTYPE_CHOICES)

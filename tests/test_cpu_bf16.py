"""``ns_dtype="auto"`` on each CPU class: the facts torch reports for it (mocked here, so
every class is checked on any machine) decide fp32 where bf16 GEMM is a fallback or
emulated, bf16 where it is native; the choice is made once and logged once, with why."""

from __future__ import annotations

import logging

import pytest
import torch

from dmuon.numerics import cpu_bf16
from dmuon.numerics import newton_schulz as ns
from dmuon.numerics.cpu_bf16 import CpuFacts, bf16_gemm_verdict

pytestmark = pytest.mark.unit

# What torch reports on each class (docs/development.md, "CPU classes"; the AVX-512
# rows as read on a Cascade Lake and a Sapphire Rapids Xeon).
AVX2 = CpuFacts("x86_64", "AVX2", onednn_bf16=False, avx512_bf16=False, amx=False)
AVX512_WITHOUT_BF16 = CpuFacts("x86_64", "AVX512", onednn_bf16=True, avx512_bf16=False, amx=False)
AVX512_BF16 = CpuFacts("x86_64", "AVX512", onednn_bf16=True, avx512_bf16=True, amx=False)
AMX = CpuFacts("x86_64", "AVX512", onednn_bf16=True, avx512_bf16=True, amx=True)
ARM_BF16 = CpuFacts("aarch64", "SVE256", onednn_bf16=True, avx512_bf16=False, amx=False)
ARM_WITHOUT_BF16 = CpuFacts("aarch64", "DEFAULT", onednn_bf16=False, avx512_bf16=False, amx=False)

CLASSES = {  # facts -> (Newton-Schulz dtype, words the reason must hold)
    "avx2": (AVX2, torch.float32, "no oneDNN bf16 GEMM"),
    "avx512-without-bf16": (AVX512_WITHOUT_BF16, torch.float32, "no AVX512_BF16 or AMX: oneDNN emulates bf16"),
    "avx512-bf16": (AVX512_BF16, torch.bfloat16, "AVX512_BF16"),
    "amx": (AMX, torch.bfloat16, "AMX"),
    "arm-bf16": (ARM_BF16, torch.bfloat16, "Arm with BF16"),
    "arm-without-bf16": (ARM_WITHOUT_BF16, torch.float32, "no oneDNN bf16 GEMM"),
}


@pytest.fixture
def decided_afresh():
    """Clears the once-per-process decisions before and after (other tests see the real CPU's)."""
    ns.resolve_ns_dtype.cache_clear()
    ns._cpu_verdict.cache_clear()
    yield
    ns.resolve_ns_dtype.cache_clear()
    ns._cpu_verdict.cache_clear()


@pytest.mark.parametrize("name", CLASSES)
def test_auto_picks_fp32_where_bf16_gemm_is_not_native_and_logs_why_once(name, monkeypatch, caplog,
                                                                          decided_afresh):
    facts, expected, reason = CLASSES[name]
    reads = []
    monkeypatch.setattr(ns, "cpu_facts", lambda: reads.append(1) or facts)
    with caplog.at_level(logging.INFO, logger="dmuon"):
        assert [ns.resolve_ns_dtype("auto", "cpu") for _ in range(3)] == [expected] * 3
        assert ns.native_bf16_matmul("cpu") == (expected == torch.bfloat16)
    lines = [r.getMessage() for r in caplog.records if "ns_dtype='auto'" in r.getMessage()]
    assert len(lines) == 1 and reason in lines[0] and f"capability {facts.capability}" in lines[0], lines
    assert f"in {ns.ns_dtype_name(expected)} on cpu" in lines[0]
    assert reads == [1]


def test_the_emulated_class_is_the_one_onednns_own_query_calls_bf16_capable():
    """Why oneDNN's query alone cannot decide: it is True on the emulated class too."""
    assert AVX512_WITHOUT_BF16.onednn_bf16 and not bf16_gemm_verdict(AVX512_WITHOUT_BF16)[0]


def test_an_unknown_machine_trusts_onednns_bf16_gemm():
    assert bf16_gemm_verdict(CpuFacts("riscv64", "DEFAULT", True, False, False))[0]
    assert not bf16_gemm_verdict(CpuFacts("riscv64", "DEFAULT", False, False, False))[0]


def test_an_accelerator_is_bf16_whatever_the_cpu(monkeypatch, decided_afresh):
    monkeypatch.setattr(ns, "cpu_facts", lambda: AVX2)
    assert ns.resolve_ns_dtype("auto", "cuda") == torch.bfloat16


def test_this_machines_facts_are_read_from_torch_and_decide_as_their_class_does():
    facts = cpu_bf16.cpu_facts()
    assert facts.capability == torch.backends.cpu.get_cpu_capability()
    native, reason = bf16_gemm_verdict(facts)
    assert isinstance(native, bool) and reason.startswith(f"capability {facts.capability}")

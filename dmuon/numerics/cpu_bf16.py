"""Whether this CPU multiplies bf16 matrices in hardware, and why: what ``ns_dtype="auto"``
decides from on a CPU (``dmuon.numerics.newton_schulz.native_bf16_matmul``).

Three x86 classes, and the bf16 GEMM each has (``docs/development.md``, "CPU classes"):

| class | example | bf16 GEMM |
| --- | --- | --- |
| AVX2 only | older AMD and Intel | none in oneDNN: ATen's scalar fallback, ~50x slower than fp32 |
| AVX-512 without AVX512_BF16 or AMX | Skylake-SP, Cascade Lake | oneDNN emulates it: ~3-4x slower than fp32 |
| AVX-512 with AVX512_BF16, or AMX | Cooper Lake, Sapphire Rapids, AMD Zen 4 | native, faster than fp32 |

oneDNN's own query (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``) is True on the second class
too (it can run bf16 there, slowly), and ``get_cpu_capability()`` says ``AVX512`` for both the
second and the third: so on x86 the features AVX512_BF16 and AMX decide. On Arm, oneDNN reports bf16
only where the CPU has the BF16 extension (native), so its query is the answer. The facts come from
torch (cpuinfo), never from timing: the decision is the same on a busy machine and a quiet one."""

from __future__ import annotations

import platform
from dataclasses import dataclass

import torch

from dmuon.torch_compat import amx_tile_supported, avx512_bf16_supported, mkldnn_bf16_supported

# platform.machine() of the two families whose rules differ (lower case).
X86_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686"})
ARM_MACHINES = frozenset({"aarch64", "arm64", "armv8l"})


@dataclass(frozen=True)
class CpuFacts:
    """What torch tells about this CPU, as far as bf16 GEMM goes (all read once)."""

    machine: str  # platform.machine(), lower case
    capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX2", "AVX512", "DEFAULT", "SVE256", ...
    onednn_bf16: bool  # oneDNN has a bf16 GEMM here (native or emulated)
    avx512_bf16: bool  # x86 AVX512_BF16
    amx: bool  # x86 AMX tiles (with AMX-BF16)


def cpu_facts() -> CpuFacts:
    """This machine's :class:`CpuFacts`, read from torch."""
    return CpuFacts(machine=platform.machine().lower(), capability=torch.backends.cpu.get_cpu_capability(),
                    onednn_bf16=mkldnn_bf16_supported(), avx512_bf16=avx512_bf16_supported(),
                    amx=amx_tile_supported())


def bf16_gemm_verdict(facts: CpuFacts) -> tuple[bool, str]:
    """``(native, reason)``: whether bf16 GEMM runs at hardware speed on a CPU with ``facts``,
    and a short reason that names the facts it was decided from."""
    if not facts.onednn_bf16:
        return False, f"capability {facts.capability}, no oneDNN bf16 GEMM: bf16 matmul is a scalar fallback"
    if facts.machine in ARM_MACHINES:
        return True, f"capability {facts.capability}, Arm with BF16 (oneDNN's bf16 GEMM)"
    if facts.machine in X86_MACHINES:
        if facts.amx:
            return True, f"capability {facts.capability}, AMX"
        if facts.avx512_bf16:
            return True, f"capability {facts.capability}, AVX512_BF16"
        return False, (f"capability {facts.capability}, no AVX512_BF16 or AMX: oneDNN emulates bf16, "
                       "slower than fp32")
    return True, f"capability {facts.capability}, machine {facts.machine}: oneDNN's bf16 GEMM"

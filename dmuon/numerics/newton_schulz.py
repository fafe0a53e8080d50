"""Newton-Schulz orthogonalization: the expensive, pure core of Muon.

Everything here is a function of one tensor. There is no distributed code in this module: the
distributed step only decides *where* these functions run.

Exactness contract: for a given input tensor (same values, shape and layout) and the same
number of threads, the output is bitwise reproducible. The distributed step relies on that: the
owner rank calls :func:`orthogonalize` on exactly the bf16 matrix a single process would build,
so both get the same bits."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence

import torch

from dmuon.numerics.gram_newton_schulz import (  # noqa: F401 (re-exported: the algorithm is a Newton-Schulz option)
    AUTO,
    DEFAULT_GRAM_RESTARTS,
    DEFAULT_NS_ALGORITHM,
    GRAM,
    NS_ALGORITHMS,
    STANDARD,
    gram_dtype,
    gram_flops,
    gram_iterate,
    resolve_ns_algorithm,
    standard_flops,
    uses_gram,
)
from dmuon.numerics.cpu_bf16 import bf16_gemm_verdict, cpu_facts
from dmuon.numerics.standard_iteration import (IterationBuffers, NewtonSchulzBuffers, Triple, normalized,
                                               standard_iterate)

# Keller Jordan's quintic coefficients (also torch.optim.Muon's default): chosen to maximize
# the slope at zero, so 5 steps push every singular value into ~[0.7, 1.2].
KELLER_COEFFICIENTS: Triple = (3.4445, -4.7750, 2.0315)

# Polar Express (Amsel, Persson, Musco and Gower, "The Polar Express: Optimal Matrix Sign
# Methods and Their Application to the Muon Algorithm", 2025, arXiv 2505.16932, Algorithm 1): a
# different quintic in each iteration, each the worst-case optimal one for the singular values
# that can remain; iteration 8 on stays at the converged (1.875, -1.25, 0.375). For bf16, every
# triple but the last is divided by (s, s^3, s^5) with the safety factor s = 1.01, and the
# input is normalized by s * ||X||_F + eps instead of ||X||_F.
POLAR_EXPRESS_SAFETY = 1.01
_POLAR_EXPRESS_OPTIMAL: tuple[Triple, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
POLAR_EXPRESS_COEFFICIENTS: tuple[Triple, ...] = tuple(
    (a / POLAR_EXPRESS_SAFETY, b / POLAR_EXPRESS_SAFETY**3, c / POLAR_EXPRESS_SAFETY**5)
    for a, b, c in _POLAR_EXPRESS_OPTIMAL[:-1]
) + _POLAR_EXPRESS_OPTIMAL[-1:]

# Named coefficient schedules accepted by ``DMuon(ns_coefficients=...)``: one triple for every
# iteration, or one per iteration (the last repeats).
NS_COEFFICIENT_SETS: dict[str, Triple | tuple[Triple, ...]] = {
    "keller": KELLER_COEFFICIENTS,
    "polar_express": POLAR_EXPRESS_COEFFICIENTS,
}
# The default schedule by name, for front ends that take names only (TOML): it names
# KELLER_COEFFICIENTS, DMuon's default, which behaves the same given either way.
DEFAULT_NS_COEFFICIENTS_NAME = "keller"
# Named schedules normalize by ``safety * ||X||_F + eps`` (others: ``max(||X||_F, eps)``).
NS_NORM_SAFETY: dict[str, float] = {"polar_express": POLAR_EXPRESS_SAFETY}

DEFAULT_NS_STEPS = 5
DEFAULT_NS_EPS = 1e-7
# torch.optim.Muon refuses 100 or more steps; more never helps the quintic iteration.
MAX_NS_STEPS = 100

# Muon's update is bf16 before and after Newton-Schulz: the dtype matrices travel in between
# ranks, and the dtype of every result, whatever Newton-Schulz computed in.
UPDATE_DTYPE = torch.bfloat16

# The dtype Newton-Schulz multiplies in (``DMuon(ns_dtype=...)``). "bfloat16" is what Muon is
# tuned for and what torch.optim.Muon does; "float32" is for CPUs whose bf16 matmul is slow;
# "auto" picks per device with :func:`native_bf16_matmul`. The input is always the bf16 update
# and the output is rounded back to bf16, so every choice keeps the owner's input and the
# result's dtype the same on every rank and at every world size.
NS_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
NS_DTYPE_CHOICES = ("auto", *NS_DTYPES)
DEFAULT_NS_DTYPE = "auto"

logger = logging.getLogger("dmuon")


def ns_dtype_name(dtype: torch.dtype) -> str:
    """The :data:`NS_DTYPES` name of a compute dtype (``torch.float32`` -> ``"float32"``)."""
    return next(name for name, known in NS_DTYPES.items() if known == dtype)


def native_bf16_matmul(device_type: str) -> bool:
    """Whether bf16 matrix multiply runs at hardware speed on this kind of device: on every
    accelerator; on a CPU where :func:`dmuon.numerics.cpu_bf16.bf16_gemm_verdict` says so
    (AVX512_BF16 or AMX on x86, BF16 on Arm)."""
    return device_type != "cpu" or _cpu_verdict()[0]


@functools.lru_cache(maxsize=None)
def _cpu_verdict() -> tuple[bool, str]:
    """This CPU's bf16 GEMM verdict, read once per process."""
    return bf16_gemm_verdict(cpu_facts())


@functools.lru_cache(maxsize=None)
def resolve_ns_dtype(choice: str, device_type: str) -> torch.dtype:
    """The dtype Newton-Schulz runs in for ``choice`` (one of :data:`NS_DTYPE_CHOICES`) on a
    device of ``device_type``. Decided once per process and device type; an ``"auto"`` choice
    is logged once, with the reason on a CPU."""
    if choice != "auto":
        return NS_DTYPES[choice]
    native = native_bf16_matmul(device_type)
    dtype = torch.bfloat16 if native else torch.float32
    reason = f"{_cpu_verdict()[1]}, " if device_type == "cpu" else ""
    logger.info("DMuon: ns_dtype='auto' runs Newton-Schulz in %s on %s (%snative bf16 matmul: %s)",
                ns_dtype_name(dtype), device_type, reason, "yes" if native else "no")
    return dtype


def matrix_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape Newton-Schulz sees for a parameter of ``shape``.

    2-D: the matrix itself. 3-D ``[E, A, B]``: a stack of E independent matrices (MoE experts),
    orthogonalized one by one. 4-D and more (convolution filters): flattened to
    ``[out, in * kernel...]``, as in Keller Jordan's Muon."""
    if len(shape) < 2:
        raise ValueError(f"Newton-Schulz needs at least 2 dimensions, got shape {tuple(shape)}")
    if len(shape) <= 3:
        return tuple(shape)
    return (shape[0], math.prod(shape[1:]))


def coefficient_schedule(coefficients: str | Triple | Sequence[Triple], steps: int) -> tuple[list[Triple], float]:
    """The ``(a, b, c)`` of each of ``steps`` iterations, and the norm's safety factor.

    ``coefficients`` is a name from :data:`NS_COEFFICIENT_SETS`, one triple (every iteration),
    or one triple per iteration (the last repeats when ``steps`` is longer)."""
    safety = 1.0
    if isinstance(coefficients, str):
        safety = NS_NORM_SAFETY.get(coefficients, 1.0)
        coefficients = NS_COEFFICIENT_SETS[coefficients]
    if isinstance(coefficients[0], (int, float)):
        return [tuple(coefficients)] * steps, safety  # type: ignore[list-item]
    listed = [tuple(t) for t in coefficients]
    return (listed + listed[-1:] * steps)[:steps], safety  # type: ignore[return-value]


def orthogonalize(update: torch.Tensor, coefficients: str | Triple | Sequence[Triple] = KELLER_COEFFICIENTS,
                  steps: int = DEFAULT_NS_STEPS, eps: float = DEFAULT_NS_EPS, dtype: torch.dtype = torch.bfloat16, *,
                  algorithm: str = DEFAULT_NS_ALGORITHM, restarts: Sequence[int] = DEFAULT_GRAM_RESTARTS,
                  gram_dtype_override: torch.dtype | None = None,
                  buffers: NewtonSchulzBuffers | None = None) -> torch.Tensor:
    """Approximate the polar factor ``U V^T`` of ``update`` with quintic Newton-Schulz.

    ``coefficients``: see :func:`coefficient_schedule` (Keller Jordan's by default). ``dtype``:
    what the standard iteration multiplies in (a value of :data:`NS_DTYPES`). ``algorithm``:
    one of :data:`NS_ALGORITHMS`; a unit that runs Gram Newton-Schulz (:func:`uses_gram`)
    multiplies in :func:`gram_dtype` and restarts after the iterations in ``restarts``
    (:mod:`dmuon.numerics.gram_newton_schulz`); ``gram_dtype_override`` replaces that dtype
    (accuracy studies). ``buffers``: where the standard iteration keeps its buffers between
    matrices of one shape (the same bits; :mod:`dmuon.numerics.standard_iteration`).

    ``update`` is 2-D ``[A, B]`` or a 3-D stack ``[E, A, B]`` (see :func:`matrix_shape`).
    Returns a new contiguous bf16 tensor of the same shape (rounded from ``dtype``); ``update``
    is never modified (this avoids torch.optim.Muon's aliasing defect, where ``x.bfloat16()``
    of a bf16 buffer is the buffer itself and the in-place normalization corrupts momentum).

    A 3-D stack is E independent matrices, each orthogonalized on its own by the 2-D routine.
    That makes expert ``e`` of the result a function of expert ``e`` alone, bit for bit, so the
    distributed step may orthogonalize experts on different ranks (a batched matmul gives no
    such guarantee across batch sizes).

    The 2-D standard case performs exactly torch.optim.Muon's operations, so a plain tensor
    gets torch's bits."""
    if update.ndim == 3:
        return torch.stack([orthogonalize(matrix, coefficients, steps, eps, dtype, algorithm=algorithm,
                                          restarts=restarts, gram_dtype_override=gram_dtype_override, buffers=buffers)
                            for matrix in update])
    if update.ndim != 2:
        raise ValueError(f"orthogonalize expects a 2-D or 3-D tensor, got shape {tuple(update.shape)}")
    schedule, safety = coefficient_schedule(coefficients, steps)
    algorithm = resolve_ns_algorithm(algorithm, dtype, update.device.type)
    # Work on the wide orientation (rows <= cols): the Gram matrix X X^T is then the small one,
    # which makes each step cheaper.
    tall = update.size(0) > update.size(1)
    if uses_gram(algorithm, update.shape, steps, restarts):
        compute = gram_dtype_override or gram_dtype(dtype, update.device.type)
        # fp16 holds values below 65504 only, so an fp16 start is normalized in fp32 first
        # (freed by the cast).
        x = normalized(update, torch.float32 if compute == torch.float16 else compute, safety, eps)
        x = (x.T if tall else x).to(compute)
        return _result(gram_iterate(x, schedule, restarts), tall=tall)
    return _result(*standard_iterate(update, dtype, safety, eps, schedule, tall, buffers), tall=tall)


def _result(x: torch.Tensor, held: IterationBuffers | None = None, *, tall: bool) -> torch.Tensor:
    """The last iterate in ``update``'s orientation, contiguous bf16: CUDA's ``_chunk_cat``
    would copy a tall matrix's transposed view again when the scatter flattens results. With
    buffers (``held``), never more memory than the workspace the memory bound counts (two
    iterates, the Gram matrix, the polynomial, and a bf16 result when the iteration ran wider):
    a bf16 iterate returned as it is leaves the buffers; a bf16 one copied out (a tall matrix)
    is copied with the other buffers dropped; a wider one is rounded beside them."""
    seen = x.T if tall else x
    if seen.dtype != UPDATE_DTYPE:
        return seen.to(UPDATE_DTYPE, memory_format=torch.contiguous_format)
    if held is not None and seen.is_contiguous():
        held.hand_over(x)
    elif held is not None:
        held.keep_only(x)
    return seen.contiguous()


def orthogonalize_row_blocks(update: torch.Tensor, split_rows: int,
                             coefficients: str | Triple | Sequence[Triple] = KELLER_COEFFICIENTS,
                             steps: int = DEFAULT_NS_STEPS, eps: float = DEFAULT_NS_EPS,
                             dtype: torch.dtype = torch.bfloat16, *, algorithm: str = DEFAULT_NS_ALGORITHM,
                             restarts: Sequence[int] = DEFAULT_GRAM_RESTARTS,
                             buffers: NewtonSchulzBuffers | None = None) -> torch.Tensor:
    """Orthogonalize each block of ``split_rows`` consecutive rows of a 2-D ``update`` on its
    own (one attention head of ``wq``, ``wk`` or ``wv``); block ``h`` of the result is
    ``orthogonalize(update[h * split_rows : (h + 1) * split_rows])``, bit for bit."""
    blocks = update.split(split_rows)
    options = dict(algorithm=algorithm, restarts=restarts, buffers=buffers)
    if len(blocks) == 1:  # one block (an owner's unit): no copy through cat
        return orthogonalize(update, coefficients, steps, eps, dtype, **options)
    return torch.cat([orthogonalize(block, coefficients, steps, eps, dtype, **options) for block in blocks])


def newton_schulz_flops(shape: Sequence[int], steps: int = DEFAULT_NS_STEPS, algorithm: str = DEFAULT_NS_ALGORITHM,
                        restarts: Sequence[int] = DEFAULT_GRAM_RESTARTS) -> int:
    """Floating-point operations of :func:`orthogonalize` for a parameter of ``shape`` under
    ``algorithm`` (as resolved for the device: :func:`resolve_ns_algorithm`): :func:`standard_flops`
    or :func:`gram_flops` per matrix. Used to balance Newton-Schulz work across ranks."""
    dims = matrix_shape(shape)
    batch = dims[0] if len(dims) == 3 else 1
    m, n = sorted(dims[-2:])
    if uses_gram(algorithm, (m, n), steps, restarts):
        return batch * gram_flops(m, n, steps, restarts)
    return batch * standard_flops(m, n, steps)

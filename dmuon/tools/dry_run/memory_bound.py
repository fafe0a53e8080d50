"""The documented bound on the device memory one DMuon step holds above parameters,
grads and state (docs/dry_run.md, "Memory"). The dry run measures the real peak and
checks it against this.

The step runs three phases one after another, each freeing its scratch before the
next, so the bound is the largest of three terms (``e``: the parameter's element size;
``s``: Newton-Schulz's; a matrix ``m x n`` with ``m <= n``):

- *owner exchange*: ``OwnerPlan.peak_scratch_bytes`` (bf16 send, receive, whole-matrix
  and result buffers of at most three batches: bounded by ``max_batch_numel``), plus
  the Newton-Schulz workspace of the largest matrix this rank orthogonalizes
  (:func:`newton_schulz_workspace`), plus the larger of the look-ahead of its largest
  packing chunk (``dmuon.plan.pack_layout.PACK_CHUNK_NUMEL`` elements or one block, in the
  parameters' dtype; twice that on an accelerator for parameters wider than bf16, whose
  chunk is flattened into a stage before its cast: ``dmuon.exchange.packing.stages_casts``),
  its largest scatter receive buffer widened to the parameters' dtype
  (``OwnerRun.widen``) and the elementwise temporaries of its largest block
  (:func:`elementwise_bytes`);
- *whole matrices* (plain tensors, replicated DTensors, the reference path): for the
  largest, its bf16 update and result (and the results a stack of experts or heads is
  concatenated from), its workspace and its elementwise temporaries;
- *AdamW*: torch's foreach AdamW makes a few lists as large as its parameters (the
  root of the second moment, the step): ``ADAMW_TEMPORARIES`` times their local bytes;
  under a mask only the device knows, a group that is not fused (or decays cautiously)
  is copied before its step, parameters and both moments as they are kept (fp32 moments:
  ``ADAMW_MASK_COPIES`` times its local bytes; ``dmuon.step.adamw_part``). A group whose
  moments are kept in another dtype (``adamw_state_dtype``: bf16, or int8 values and scales)
  steps a read chunk at a time (``dmuon.state.kept_state.read_chunks``: ``READ_CHUNK_NUMEL``
  elements, or the largest shard where larger, never more than the group): the chunk's two
  moments as working copies in the parameters' dtype, and beside them the largest of what
  reading one makes (``ADAMW_READ_BYTES_PER_ELEMENT``), torch's lists over the chunk, and what
  rounding one back makes (its new values in the kept form and the quantization's
  temporaries of one rounding chunk) (:func:`adamw_reads`);
- plus, through every phase, the masks' small tensors (``MASK_SCALAR_BYTES`` per parameter);
- *masked momentum*: the EMAs computed out of place before they are selected
  (``dmuon.numerics.masked_updates``): a chunk of ``MASKED_CHUNK_NUMEL`` elements, or the
  largest Muon shard where that is larger;
- *momentum kept in bf16 or int8* (``dmuon.state.kept_state``): through every Muon phase, the
  momenta of one chunk read into the parameters' dtype (a pack chunk on the fast path,
  ``READ_CHUNK_NUMEL`` elements off it, or the largest such shard where larger: each chunk is
  let go before the next is read); while they are rounded back, the new values in their kept
  form, an fp32 copy where int8 is read for a parameter narrower than fp32, and the
  quantization's temporaries of one rounding chunk (``QUANTIZE_BYTES_PER_ELEMENT`` times
  ``ROUNDING_CHUNK_NUMEL`` at most, or the largest momentum read alone).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from dmuon.exchange.packing import stages_casts
from dmuon.state.kept_state import ADAMW_MOMENTS, READ_CHUNK_NUMEL, kept_momentum, read_as_itself
from dmuon.numerics.momentum_storage import ROUNDING_CHUNK_NUMEL, read_together
from dmuon.numerics.update_rules import MASKED_CHUNK_NUMEL
from dmuon.numerics.newton_schulz import matrix_shape, resolve_ns_dtype
from dmuon.optimizer import DMuon
from dmuon.plan.owner_plan import WIRE_BYTES
from dmuon.plan.pack_layout import PACK_CHUNK_NUMEL
from dmuon.plan.paths import ALL_TO_ALL
from dmuon.torch_compat import local_of

# Lists of AdamW-parameter size torch's foreach AdamW holds at once.
ADAMW_TEMPORARIES = 2
# The step's masks, decay factors and status, small tensors alive through a phase: at most
# one caching-allocator block (512 bytes) per parameter.
MASK_SCALAR_BYTES = 512
# NorMuon's normalization holds an fp32 copy of the matrix and its square.
NORMUON_FP32_COPIES = 2
# Cautious decay's mask: the signs of update and weight, their product and the factor.
CAUTIOUS_TEMPORARIES = 4
FP32_BYTES = 4
# Copies of an AdamW group's local tensors (parameters, exp_avg, exp_avg_sq) a masked step keeps,
# where the moments are held in the parameters' dtype (else: the parameters and the kept forms).
ADAMW_MASK_COPIES = 3
# Reading a kept AdamW moment into the parameters' dtype (``dmuon.numerics.momentum_storage.
# read_momenta``), per element, beside the moments' working copies: the concatenation in the kept
# form (bf16's 2 bytes, or int8's 1 and its scales'), and int8's fp32 product with the scales
# before its cast to a parameter dtype narrower than fp32 (a byte to spare).
ADAMW_READ_BYTES_PER_ELEMENT = 2 + FP32_BYTES + 1
# int8 quantization's and dequantization's temporaries of one tensor (``dmuon.numerics.
# momentum_storage``), per element: its padded fp32 blocks, their absolute values, the
# quotient and the select (fp32 each), and the int8 values before and after trimming.
QUANTIZE_BYTES_PER_ELEMENT = 4 * FP32_BYTES + 2


def newton_schulz_workspace(shape: tuple[int, int], ns_bytes: int, normuon: bool) -> int:
    """Bytes Newton-Schulz holds for one ``m x n`` matrix beyond its bf16 input: the
    iterate twice (old and new), the Gram matrix and the polynomial, in ``s`` bytes; the
    bf16 result when ``s`` is not bf16 (in bf16 the last iterate is the result); and
    NorMuon's fp32 copies and its bf16 result."""
    m, n = sorted(shape)
    workspace = ns_bytes * (2 * m * n + 2 * m * m) + (WIRE_BYTES * m * n if ns_bytes != WIRE_BYTES else 0)
    return workspace + ((NORMUON_FP32_COPIES * FP32_BYTES + WIRE_BYTES) * m * n if normuon else 0)


def elementwise_bytes(numel: int, param_bytes: int, cautious: bool) -> int:
    """Momentum's look-ahead (one block in the parameter's dtype) and cautious decay's
    mask temporaries."""
    return numel * param_bytes + (CAUTIOUS_TEMPORARIES * FP32_BYTES * numel if cautious else 0)


def peak_bound_bytes(optimizer: DMuon, plan_rank: int) -> int:
    """The bound for this rank of ``optimizer`` (after its first step: plan and paths made)."""
    groups = {p: g for g in optimizer.param_groups for p in g["params"]}
    ns_bytes = torch.empty((), dtype=resolve_ns_dtype(optimizer.ns_dtype, "cuda")).element_size()
    read, rounding = _momentum_reads(optimizer)
    muon = [p for p, g in groups.items() if g["use_muon"]]
    phases = max(_exchange(optimizer, groups, plan_rank, ns_bytes) + read, _whole(optimizer, groups, ns_bytes) + read,
                 adamw_term(optimizer), _masked_momentum(muon) + read + rounding)
    return phases + MASK_SCALAR_BYTES * len(groups)


def _momentum_reads(optimizer: DMuon) -> tuple[int, int]:
    """The momenta kept in another dtype than their parameter's, read into it a chunk at a
    time (a pack chunk on the fast path, ``READ_CHUNK_NUMEL`` elements off it, or one shard
    where that is larger), and what reading and rounding one chunk back holds beside
    (module docstring)."""
    read_bytes = kept_bytes = largest = total = batched = alone = 0
    for group in (g for g in optimizer.param_groups if g["use_muon"]):
        for param in group["params"]:
            momentum = kept_momentum(optimizer.state.get(param))
            if read_as_itself(momentum, param):
                continue
            local = local_of(param)
            numel = local.numel()
            read_bytes = max(read_bytes, local.element_size())
            kept = sum(_local_bytes(t) for t in momentum if t is not None) / max(numel, 1)
            kept += FP32_BYTES if momentum[1] is not None and local.element_size() < FP32_BYTES else 0
            kept_bytes = max(kept_bytes, math.ceil(kept))
            largest, total = max(largest, numel), total + numel
            if momentum[1] is not None:
                if read_together(*map(local_of, momentum)):  # rounded with the others, chunk by chunk
                    batched += numel
                else:
                    alone = max(alone, numel)
    chunk = min(total, max(PACK_CHUNK_NUMEL, READ_CHUNK_NUMEL, largest))
    rounding = QUANTIZE_BYTES_PER_ELEMENT * max(min(batched, chunk, ROUNDING_CHUNK_NUMEL), alone)
    return read_bytes * chunk, kept_bytes * chunk + rounding


def _masked_momentum(muon: list[torch.Tensor]) -> int:
    """The out-of-place EMAs alive at once: a chunk of ``MASKED_CHUNK_NUMEL`` elements, or the
    largest shard where it is larger, never more than every shard together."""
    if not muon:
        return 0
    sizes = [_local_bytes(p) for p in muon]
    chunk = MASKED_CHUNK_NUMEL * max(p.element_size() for p in muon)
    return min(sum(sizes), max(max(sizes), chunk))


def adamw_term(optimizer: DMuon) -> int:
    """The AdamW part's temporaries, with the copies of the groups a device mask copies."""
    total = 0
    for group in (g for g in optimizer.param_groups if not g["use_muon"]):
        copied = not group.get("fused", optimizer.fused) or group["cautious_weight_decay"]
        param_bytes = sum(map(_local_bytes, group["params"]))
        kept = [t for p in group["params"] for keys in ADAMW_MOMENTS
                for t in kept_momentum(optimizer.state.get(p), keys) or () if t is not None]
        reads = adamw_reads(optimizer, group)
        copies = (param_bytes + sum(map(_local_bytes, kept)) if reads else ADAMW_MASK_COPIES * param_bytes) \
            if copied else 0
        total += copies + (reads or ADAMW_TEMPORARIES * param_bytes)
    return total


def adamw_reads(optimizer: DMuon, group: dict) -> int:
    """What an AdamW group whose moments are kept in another dtype than their parameters' holds
    while it steps a read chunk at a time (module docstring; ``dmuon.step.adamw_part``); 0 where
    every moment is its own working tensor (torch's AdamW runs on the whole group)."""
    read = []  # per moment read: (local elements, kept bytes an element, int8, read together)
    largest = total = widest = 0
    for param in group["params"]:
        local = local_of(param)
        numel = local.numel()
        largest, total, widest = max(largest, numel), total + numel, max(widest, local.element_size())
        for keys in ADAMW_MOMENTS:
            moment = kept_momentum(optimizer.state.get(param), keys)
            if read_as_itself(moment, local):
                continue  # no state yet, or its own working tensor
            kept = sum(_local_bytes(t) for t in moment if t is not None) / max(numel, 1)
            int8 = moment[1] is not None
            read.append((numel, kept, int8, int8 and read_together(*map(local_of, moment))))
    if not read:
        return 0
    chunk = min(total, max(READ_CHUNK_NUMEL, largest))  # elements of the parameters stepped at once
    working = 2 * widest * chunk  # both moments of the chunk, in the parameters' dtype
    reading = ADAMW_READ_BYTES_PER_ELEMENT * chunk
    torch_lists = ADAMW_TEMPORARIES * widest * chunk
    # Rounding one moment back: its new values in the kept form, and int8's quantization
    # temporaries (a rounding chunk of those read together, or the largest read alone).
    batched = min(chunk, ROUNDING_CHUNK_NUMEL) if any(together for *_, together in read) else 0
    alone = max((numel for numel, _, int8, together in read if int8 and not together), default=0)
    rounding = math.ceil(max(kept for _, kept, _, _ in read)) * chunk + QUANTIZE_BYTES_PER_ELEMENT * max(batched, alone)
    return working + max(reading, torch_lists, rounding)


def _exchange(optimizer: DMuon, groups: dict, rank: int, ns_bytes: int) -> int:
    plans = optimizer.owner_plans()
    if not plans:
        return 0
    (plan,) = plans
    run = optimizer.phases.fast_path.owner_run  # the plan's parameters and batch layouts
    params = run.params
    workspace = elementwise = 0
    widest = max(p.element_size() for p in params)
    for batch in plan.batches:  # each chunk's look-ahead, packed at once, in its parameters' dtype
        layout = run.layout(batch)
        for first, _, start, end in layout.send_chunks:
            param_bytes = params[plan.units[layout.send_units[first]].param].element_size()
            # On an accelerator, a chunk wider than bf16 is flattened into a stage of its dtype first.
            staged = param_bytes != WIRE_BYTES and stages_casts(run.device)
            elementwise = max(elementwise, (2 if staged else 1) * (end - start) * param_bytes)
        # The results received, widened to the parameters' dtype for the list ops (OwnerRun.widen).
        elementwise = max(elementwise, sum(layout.scatter_recv_sizes) * widest)
    for unit in plan.units:
        group = groups[params[unit.param]]
        if unit.owner == rank:
            workspace = max(workspace, newton_schulz_workspace(unit.matrix[-2:], ns_bytes, group["normuon"]))
        if (block := unit.block(rank)) is not None:
            param_bytes = params[unit.param].element_size()
            elementwise = max(elementwise, elementwise_bytes(block.numel, param_bytes, group["cautious_weight_decay"]))
    return plan.peak_scratch_bytes(rank) + workspace + elementwise


def _whole(optimizer: DMuon, groups: dict, ns_bytes: int) -> int:
    largest = 0
    for param, path in optimizer.phases.paths(optimizer.param_groups, optimizer.param_name).items():  # the step's
        if path == ALL_TO_ALL:
            continue
        group = groups[param]
        numel = math.prod(param.shape)
        matrix = matrix_shape(param.shape)[-2:]
        # The bf16 update and result, and for a stack of experts or heads the list of
        # results it is concatenated from.
        updates = (3 if len(param.shape) == 3 or group["split_rows"] else 2) * numel * WIRE_BYTES
        largest = max(largest, updates + newton_schulz_workspace(matrix, ns_bytes, group["normuon"])
                      + elementwise_bytes(numel, param.element_size(), group["cautious_weight_decay"]))
    return largest


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()

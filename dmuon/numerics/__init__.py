"""Layer 1, the numerics: Muon's and AdamW's math as pure functions on tensors.

Newton-Schulz (the standard iteration and Gram Newton-Schulz), the elementwise update
rules (momentum, the Nesterov look-ahead, shape-aware scale, decoupled and cautious weight
decay, NorMuon), each written once with its for-loop and list forms (the same bits), and
AdamW's step. Nothing here knows about ranks, meshes, plans or process groups.

May import: no other dmuon layer; only ``dmuon.torch_compat`` (torch's private names).

- ``newton_schulz``: ``orthogonalize`` and its coefficient schedules, dtypes and flops;
- ``cpu_bf16``: whether a CPU's bf16 GEMM is native (AVX512_BF16, AMX, Arm BF16), for
  ``ns_dtype="auto"``;
- ``standard_iteration``: the standard iteration, its buffers kept between matrices of one shape;
- ``gram_newton_schulz``: the Gram iteration, its flops, when it pays;
- ``update_rules``: Muon's update, each line one function over lists of tensors (momentum,
  look-ahead and its bf16 copy, Newton-Schulz with a group's settings and NorMuon, shape scale,
  decay, apply), the mask and ``capturable`` inside each;
- ``adamw_rules``: AdamW's state, and its step through torch's functional AdamW (local shards,
  cautious decay, ``capturable``);
- ``masked_updates``: the mask primitives (select, zero), exact on the bits;
- ``momentum_storage``: momentum kept in bf16 or block-wise int8 (blocks inside rows), and back;
- ``device_scalars``: hyperparameters as 0-dim device tensors (``capturable``), a step's
  scalars made once;
- ``finite``: whether tensors hold a NaN or inf, decided on the device (``skip_nonfinite``);
- ``alignment``: a matrix view copied where a reduction would read it from an odd offset.
"""

"""Layer 1, the numerics: Muon's and AdamW's math as pure functions on tensors.

Newton-Schulz (the standard iteration and Gram Newton-Schulz), the elementwise update
rules (momentum, the Nesterov look-ahead, shape-aware scale, decoupled and cautious weight
decay, NorMuon), each written once with its for-loop and list forms (the same bits), and the
functional Muon, NorMuon and AdamW steps on whole tensors. Nothing here knows about ranks,
meshes, plans or process groups.

May import: no other dmuon layer; only ``dmuon.torch_compat`` (torch's private names).

- ``newton_schulz``: ``orthogonalize`` and its coefficient schedules, dtypes and flops;
- ``cpu_bf16``: whether a CPU's bf16 GEMM is native (AVX512_BF16, AMX, Arm BF16), for ``ns_dtype="auto"``;
- ``standard_iteration``: the standard iteration, its buffers kept between matrices of one shape;
- ``gram_newton_schulz``: the Gram iteration, its flops, when it pays;
- ``update_rules``: the math on one tensor (shape scale, look-ahead, NorMuon, cautious decay's mask);
- ``adamw_rules``: AdamW's step through torch's functional AdamW (local shards, cautious decay, ``capturable``);
- ``update_lists``: Muon's rules, each written once (momentum, decay and its factor, the apply), for-loop or
  list form, the mask and ``capturable`` inside each;
- ``masked_updates``: the mask primitives (select, zero), exact on the bits;
- ``momentum_storage``: momentum kept in bf16 or block-wise int8 (blocks inside rows), and back;
- ``device_scalars``: hyperparameters as 0-dim device tensors (``capturable``), their products made once a step;
- ``finite``: whether tensors hold a NaN or inf, decided on the device (``skip_nonfinite``);
- ``alignment``: a matrix view copied where a reduction would read it from an odd offset;
- ``functional``: whole-tensor Muon, NorMuon and AdamW steps (the single-process reference).
"""

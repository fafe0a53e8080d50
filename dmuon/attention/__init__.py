"""Layer 4, QK-clip (MuonClip): the attention logits a model reports, their one MAX reduction
over the ranks, and the row scaling of each rank's block of ``W_q`` and ``W_k``.

May import: ``dmuon.numerics``, ``dmuon.plan`` (which rows a rank holds), ``dmuon.exchange``
(the group and the reduction) and ``dmuon.torch_compat``; never the optimizer's own modules.

- ``qk_clip``: the clip math, pure (``AttentionHeads``, per-head max logits, factors, rows);
- ``max_logits``: ``MaxLogitTracker``, which a model's attention reports its logits to;
- ``clipping``: ``AttentionClip``, the per-step bookkeeping: reduce, then scale rows in place."""

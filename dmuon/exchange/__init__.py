"""Layer 3, the exchange: runs a plan with collectives. The only layer that issues them
(``tests/test_layers.py`` checks it), so every collective a step makes is in this folder.

May import: ``dmuon.numerics``, ``dmuon.plan`` and ``dmuon.torch_compat``; never QK-clip
or the optimizer's own modules.

- ``comm``: one batch's ``all_to_all_single`` on flat bf16 buffers, the bytes it sent, the
  scratch meter;
- ``packing``: filling and draining those buffers with a few ops per batch;
- ``owner_exchange``: the fast path, a plan's batches executed in the schedule's order
  (blocks travel to one owner per matrix and back);
- ``reference``: every rank gathers and orthogonalizes the whole parameter
  (``comm="redistribute"``, and layouts the plan cannot describe);
- ``groups``: the process group of each rank set, for device collectives and host sums;
- ``grad_status``: which grads a step applies, summed on the device, its errors raised on every rank;
- ``status_channel``: which parameters share that sum, over which ranks (made at planning);
- ``status_masks``: the step's and each parameter's masks read from those sums (0-dim device bools),
  and the tally a captured step's replays add them to;
- ``replicated_grads``: the grads of parameters replicated on every mesh dim (``Partial`` or
  not), summed by every rank alike;
- ``host_copy``: small host facts up and device sums down through pinned memory, without a sync;
- ``host_staging``: under FSDP2's CPU offload, the fast path's blocks up to the device and its
  results down to the host, through pinned buffers reused step to step, and the waits that takes;
- ``reductions``: the small all-reduces of the step (NorMuon's rows, QK-clip's logits,
  telemetry's sums).

A rank holding the whole parameter (the ``local`` path) needs no exchange: it
orthogonalizes its own update in place. Which path a parameter takes is decided in
``dmuon.plan.paths``; a new layout is a new case in ``dmuon.plan.layout``, not new step code.
"""

"""Layer 3, the exchange: runs a plan with collectives. The only layer that issues them
(``tests/test_layers.py`` checks it), so every collective a step makes is in this folder.

May import: ``dmuon.numerics``, ``dmuon.plan`` and ``dmuon.torch_compat``; never QK-clip
or the optimizer's own modules. Its modules (one line each: docs/architecture.md, "Layers
and files"): ``comm``, ``packing``, ``owner_exchange``, ``reference``, ``groups``,
``grad_status``, ``status_channel``, ``status_masks``, ``replicated_grads``, ``host_copy``,
``host_staging``, ``reductions``.

A rank holding the whole parameter (the ``local`` path) needs no exchange: it
orthogonalizes its own update in place. Which path a parameter takes is decided in
``dmuon.plan.paths``; a new layout is a new case in ``dmuon.plan.layout``, not new step code.
"""

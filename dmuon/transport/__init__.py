"""How a Muon matrix reaches the rank that orthogonalizes it, when it must move: one
module per way. (A rank holding the whole parameter, the ``local`` path, orthogonalizes
its own update in place: nothing moves, so it needs no transport.)

- :mod:`~dmuon.transport.owner_exchange`: the fast path for every layout the plan can
  describe (FSDP, HSDP, FSDP + TP, TP, EP): blocks travel to one owner per matrix and
  back, batch by batch (``dmuon.plan`` says which blocks go where);
- :mod:`~dmuon.transport.reference`: every rank gathers and orthogonalizes the whole
  parameter (``comm="redistribute"``, and layouts the plan cannot describe).

Which one a parameter takes is decided in ``dmuon.paths``; a new layout is a new case in
``dmuon.layout``/``dmuon.plan``, not new step code.
"""

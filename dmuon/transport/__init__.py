"""How a Muon matrix reaches the rank that orthogonalizes it: one module per way.

- :mod:`~dmuon.transport.local`: the rank holds the whole parameter (plain tensor,
  replicated DTensor, one-rank mesh): nothing moves;
- :mod:`~dmuon.transport.owner_exchange`: the fast path for every layout the plan can
  describe (FSDP, HSDP, FSDP + TP, TP, EP): blocks travel to one owner per matrix and
  back, batch by batch (``dmuon.plan`` says which blocks go where);
- :mod:`~dmuon.transport.reference`: every rank gathers and orthogonalizes the whole
  parameter (``comm="redistribute"``, and layouts the plan cannot describe).

Which one a parameter takes is ``dmuon.plan.comm_path``; a new layout is a new case in
``dmuon.layout``/``dmuon.plan``, not new step code.
"""

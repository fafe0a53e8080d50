"""The captured step: ``DMuon.step`` recorded once in a CUDA graph and replayed, and what each
replay checks first. Above the optimizer: it wraps a built ``DMuon``.

May import: the layers, the optimizer's folders, ``dmuon.optimizer`` and
``dmuon.torch_compat``; never the tools.

- ``cuda_graphs``: ``CapturedStep``, the warm-up, the capture and the replays;
- ``replay_guard``: what a captured step's graph reads, held and checked before each replay."""

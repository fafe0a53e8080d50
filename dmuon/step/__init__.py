"""One ``DMuon.step``: its phases, the fast path's owner exchange, Muon's update rules run
with a group's settings, the AdamW part, and the step's figures.

May import: the layers, ``dmuon.options``, ``dmuon.state`` and ``dmuon.torch_compat``;
never the optimizer (``dmuon.optimizer``), the captured step or the tools.

- ``phases``: ``Step``, one step as one object's phases, made by ``StepPhases``;
- ``grad_checks``: the first phase, this rank's own problems with its grads;
- ``adamw_part``: the AdamW part of a step, under the step's mask;
- ``group_steps``: Muon's rules run with a group's settings; the local and reference paths;
- ``fast_path``: ``OwnerRun``, the owner plan's run, and ``FastStep``, one exchange step;
- ``converted_momenta``: the fast path's momenta kept in bf16 or int8, read block by block;
- ``telemetry``: a step's figures (time, Newton-Schulz time, bytes, update and weight RMS).
"""

"""One ``DMuon.step``: its phases, the fast path's owner exchange, the functional steps run
with a group's settings, the AdamW part, and the step's figures.

May import: the layers, ``dmuon.options``, ``dmuon.state`` and ``dmuon.torch_compat``;
never the optimizer (``dmuon.optimizer``), the captured step or the tools.

- ``phases``: ``Step``, one step as one object's phases (check locally, agree, wait,
  compute and apply, report), made by ``StepPhases``, which holds what lasts between steps;
- ``grad_checks``: the first phase, this rank's own problems with its grads, recorded for
  the end of the step;
- ``adamw_part``: the AdamW part of a step, under the step's mask;
- ``group_steps``: the functional Muon and AdamW steps run with one group's settings,
  counted and timed;
- ``fast_path``: one DMuon's owner plan and process group (``OwnerRun``), and ``FastStep``, one
  step of the batched owner exchange (pack, orthogonalize, apply as its methods);
- ``converted_momenta``: the fast path's momenta kept in bf16 or int8, read block by block
  as the exchange packs them;
- ``telemetry``: a step's figures (time, Newton-Schulz time, bytes, update and weight RMS).
"""

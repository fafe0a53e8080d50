"""The optimizer's options: what each is, its default and check, and the param groups
made from the user's ``params``. The lowest of the optimizer's folders.

May import: the layers (``dmuon.numerics``, ``dmuon.plan``, ``dmuon.exchange``,
``dmuon.attention``) and ``dmuon.torch_compat``; never the state, the step or the
optimizer.

- ``table``: every option once: its default, check, scope, what a resume does with a change,
  and its TorchTitan names; the constructor, the group keys, the resume contract, TorchTitan's
  fields and the docs' option tables are read from it;
- ``checks``: the legal values of each option, with errors that name the option, the group
  (or front end) and what to do;
- ``param_groups``: DMuon's ``params`` argument turned into checked Muon and AdamW groups
  (the default routing, ``adamw_<x>`` aliases, ``(name, tensor)`` pairs);
- ``implementation_flags``: torch.optim's ``foreach``, ``fused`` and ``capturable`` on DMuon,
  and the flags it has no path for (``maximize``, ``differentiable``);
- ``device_hyperparameters``: a capturable group's ``lr`` and ``weight_decay`` kept as the
  same 0-dim device tensors for the optimizer's life.
"""

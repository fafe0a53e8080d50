"""The optimizer's options: what each is, its default and check, and the param groups
made from the user's ``params``. The lowest of the optimizer's folders.

May import: the layers (``dmuon.numerics``, ``dmuon.plan``, ``dmuon.exchange``,
``dmuon.attention``) and ``dmuon.torch_compat``; never the state, the step or the
optimizer.

- ``table``: every option once (default, check, scope, resume, TorchTitan names);
- ``checks``: the legal values of each option, with errors that say what to do;
- ``param_groups``: DMuon's ``params`` argument turned into checked Muon and AdamW groups;
- ``implementation_flags``: torch.optim's ``foreach``, ``fused``, ``capturable`` and the rest;
- ``device_hyperparameters``: a capturable group's ``lr`` and ``weight_decay`` device tensors.

A public module (docs/development.md, "The public surface"): what a front end (TorchTitan's
``[optimizer]`` fields and 0.3's factory) needs to read, route and check DMuon's options.
"""

from dmuon.options.checks import check_bool
from dmuon.options.implementation_flags import (IMPLEMENTATION_KEYS, NO_PATH_KEYS, check_no_fused_muon,
                                                check_no_path_flags, own_flags, takes_fused_adamw)
from dmuon.options.param_groups import GROUP_OPTIONS, part_values, split_options
from dmuon.options.table import (DEFAULTS, FACTORY_KWARGS, LAYOUT_KEYS, MUON_KEYS, OPTIONS, check_group,
                                 check_optimizer_options)

__all__ = [
    "DEFAULTS", "FACTORY_KWARGS", "GROUP_OPTIONS", "IMPLEMENTATION_KEYS", "LAYOUT_KEYS", "MUON_KEYS", "NO_PATH_KEYS",
    "OPTIONS", "check_bool", "check_group", "check_no_fused_muon", "check_no_path_flags", "check_optimizer_options",
    "own_flags", "part_values", "split_options", "takes_fused_adamw",
]

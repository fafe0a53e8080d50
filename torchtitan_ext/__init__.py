"""TorchTitan integration of DMuon: name this module in the TOML and set the optimizer.

    [job]
    custom_config_module = "torchtitan_ext"

    [optimizer]
    name = "DMuon"

TorchTitan 0.2.x imports this module while parsing the config. Importing it:

1. provides ``JobConfig`` (``config.py``), whose ``[optimizer]`` fields TorchTitan
   merges into its own, and hooks config validation so bad DMuon settings fail
   at parse time with the TOML key in the message;
2. installs the CPU/gloo compatibility layer (``cpu_compat.py``; a no-op when an
   accelerator exists);
3. registers the embedded ``pydoc`` / ``pydoc_validation`` datasets (``dataset.py``;
   tokenizer built on first use by ``tokenizer.py``);
4. re-registers TorchTitan's built-in model specs so that ``name = "DMuon"``
   builds a ``DMuonOptimizersContainer`` (``train_specs.py``,
   ``optimizer_container.py``) while ``Adam``/``AdamW`` stay stock;
5. checks, before a checkpoint is loaded, that no parameter moved between Muon and
   AdamW since it was saved (``routing_check.py``);
6. adds DMuon's step figures to TorchTitan's step metrics when ``[optimizer]
   telemetry = true`` (``step_metrics.py``);
7. warns when ``torchrun`` may restart the job in a way that can fail to
   reconnect (``launch_checks.py``);
8. for tests only, and only when their environment variables are set: arms a
   fault (a rank SIGKILLs itself at a given step, ``fault_injection.py``) and
   dumps the state a resume loaded (``state_dump.py``). Unset, they do nothing.
"""

import importlib.metadata as _metadata

# TEMPORARY (issue 15 in progress): the 0.2.x installation below runs only beside
# TorchTitan 0.2.x; the 0.3.x adapter lives in torchtitan_ext.titan03.
if _metadata.version("torchtitan").startswith("0.2."):
    from . import cpu_compat, fault_injection, launch_checks, routing_check, state_dump, step_metrics
    from .config import install_config_validation, JobConfig, Optimizer
    from .dataset import register_datasets
    from .optimizer_container import build_dmuon_optimizers, DMuonOptimizersContainer
    from .train_specs import register_builtin_specs, with_dmuon

    __all__ = [
        "JobConfig",
        "Optimizer",
        "DMuonOptimizersContainer",
        "build_dmuon_optimizers",
        "with_dmuon",
    ]

    cpu_compat.apply()
    install_config_validation()
    register_datasets()
    register_builtin_specs()
    routing_check.install()
    step_metrics.install()
    launch_checks.warn_about_risky_restarts()
    fault_injection.install_from_env()
    state_dump.install_from_env()

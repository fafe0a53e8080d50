"""``CpuTrainer``: TorchTitan 0.3's ``Trainer`` that installs the CPU layer at job start.

Why a subclass: TorchTitan picks its device in ``Trainer.__init__``, after the config
function has run, and a config function should stay free of side effects (tests call
them to check configs). 0.3 builds the trainer from the ``Config`` the config function
returns (``config.build()``), so returning ``CpuTrainer.Config`` is how a job asks for
``cpu_compat.install()``; it is a no-op on a machine with an accelerator.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.trainer import Trainer

from . import cpu_compat


class CpuTrainer(Trainer):
    """``Trainer`` that runs on CPU/gloo when torch sees no accelerator."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def __init__(self, config: Config) -> None:
        cpu_compat.install()
        super().__init__(config)

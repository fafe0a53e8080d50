"""Warn about a ``torchrun`` launch whose restarts can fail to reconnect.

``torchrun`` with the c10d rendezvous (what ``--standalone`` uses) shares its
rendezvous TCPStore with the workers (``TORCHELASTIC_USE_AGENT_STORE=True``) and,
in torch 2.13, keeps that store -- same port, no per-attempt key prefix -- when
it restarts the workers. A restarted worker can then read a key its dead
predecessor wrote, e.g. the peer address gloo connects to, and fail with
``Gloo connectFullMesh failed ... Connection refused`` (pytorch/pytorch#135712).
Launching with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives every attempt a
fresh store. docs/reliability.md, "Restarting after a killed rank", has the details.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from torchtitan.tools.logging import logger


def restarts_share_a_stale_store(env: Mapping[str, str] = os.environ) -> bool:
    """True if torchrun may restart this job while sharing its rendezvous store."""
    return (
        int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
        and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    )


def warn_about_risky_restarts(env: Mapping[str, str] = os.environ) -> None:
    if restarts_share_a_stale_store(env) and env.get("RANK", "0") == "0":
        logger.warning(
            "torchrun may restart this job (--max-restarts > 0) but shares its rendezvous "
            "store across attempts: a restarted worker can read keys of the dead attempt and "
            "fail to connect (pytorch/pytorch#135712). Launch torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for reliable restarts."
        )

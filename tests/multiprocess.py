"""Run a function on P real ranks (spawned processes, one thread each): the launcher of
the multi-rank tests, ``benchmarks.spawned_ranks`` (a timeout on every launch, every rank
judged by what it reported and how it exited; its docstring says how)."""

from benchmarks.spawned_ranks import DEFAULT_TIMEOUT_S, EXIT_TIMEOUT_S, free_port, run_on_ranks

__all__ = ["DEFAULT_TIMEOUT_S", "EXIT_TIMEOUT_S", "free_port", "run_on_ranks"]

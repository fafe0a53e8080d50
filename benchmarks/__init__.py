"""Tools that measure dmuon, kept out of the runtime package (and its wheel).

``benchmarks.bench`` times an optimizer step on a llama-like stack (its parts:
``bench_workload``, ``bench_timing``, ``bench_report``); ``benchmarks.layouts``
builds the FSDP/HSDP/TP layouts it steps. Run from the repository root, e.g.
``torchrun --standalone --nproc-per-node 2 -m benchmarks.bench``. Nothing under
``dmuon/`` imports this package (tests/test_package_boundaries.py checks).
"""

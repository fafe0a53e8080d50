"""The tools users run from the command line, above the runtime: nothing in the optimizer
imports them (``tests/test_layers.py``).

May import: everything in dmuon.

- ``plan_report``: what the fast path does at scale, from shapes alone
  (``python -m dmuon.tools.plan_report``);
- ``option_table``: the option table (``dmuon.options.table``) as docs/optimizer.md holds it
  (``python -m dmuon.tools.option_table --check`` / ``--write``);
- ``dry_run``: DMuon's CUDA step at real scale on fake CUDA tensors, without a GPU
  (``python -m dmuon.tools.dry_run``).
"""

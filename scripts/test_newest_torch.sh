#!/usr/bin/env bash
# The newest torch the registry serves (2.15.0; the CUDA build, ~3.7 GB, runs on CPU), in
# two environments, one per TorchTitan line (the two releases cannot share one):
#
#   .venv-torch2.15  torch 2.15 + TorchTitan 0.2.2: every in-process test whose outcome can
#                    depend on the torch release (all but those marked `any_torch`:
#                    documents, import layers, launchers, the planner's pure functions; the
#                    dry run on torch's CUDA build included) and the multi-rank tests marked
#                    `every_torch` (exactness on every layout at P = 1, 2, 4, the 2 x 2
#                    meshes, TorchTitan's own parallelize, DCP resharding), then two 0.2.x
#                    end-to-end runs (the loss, and train, checkpoint, resume bit for bit);
#   .venv-titan0.3   TorchTitan 0.3.0 and its own requirements, over .venv-torch2.15's
#                    packages (scripts/setup_titan03.sh): the 0.3.x adapter's
#                    tests, its CPU end-to-end runs and layouts included, the import check,
#                    and tests/test_vs_distmuon.py (its model of DistMuon's balancing is
#                    checked against TorchTitan 0.3's own function, skipped beside 0.2.x);
#                    tests/test_titan03_vs_distmuon_time.py runs `benchmarks.vs_distmuon
#                    --time` at a tiny width (DMuon and DistMuon bitwise torch.optim.Muon).
#
# The second environment borrows the first one's torch rather than installing its own: one
# ~6 GB copy instead of two (a CI machine ran out of disk with two, plus pip's cache).
# Arguments go to every pytest call (two xdist workers, grouped as scripts/test.sh says).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1

python=$(DMUON_VENV=.venv-torch2.15 TORCH_VERSION=2.15.0 bash scripts/setup.sh)
"$python" -c "import torch, torchtitan; print('torch', torch.__version__, '+ TorchTitan 0.2 line')"
"$python" -m pytest -n 2 --dist loadgroup -m "(unit or every_torch) and not any_torch and not extended" "$@"
"$python" -m pytest tests/test_torchtitan_e2e.py -k "resuming_from_a_checkpoint or loss_at_the_last_step" "$@"

python=$(bash scripts/setup_titan03.sh)
"$python" -c "import torch, importlib.metadata as m; print('torch', torch.__version__, '+ TorchTitan', m.version('torchtitan'))"
exec "$python" -m pytest -n 2 --dist loadgroup tests/test_extension_imports.py tests/test_vs_distmuon.py \
    tests/test_titan03_*.py tests/test_option_sweep.py "$@"

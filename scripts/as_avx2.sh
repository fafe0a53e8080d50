#!/usr/bin/env bash
# Run a command as if this CPU had no AVX-512 or AMX: ATen's, oneDNN's and MKL's kernels
# are capped at AVX2, so torch.backends.cpu.get_cpu_capability() says AVX2,
# torch.ops.mkldnn._is_mkldnn_bf16_supported() is False, and bf16 matmuls take torch's
# slow fallback, as on a CPU without bf16 hardware. Use it to check that something stays
# fast there, e.g.
#
#   bash scripts/as_avx2.sh bash scripts/test.sh
#   bash scripts/as_avx2.sh torchrun --standalone --nproc-per-node 1 -m benchmarks.bench --optimizers dmuon,dmuon_bf16
set -euo pipefail
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
exec "$@"

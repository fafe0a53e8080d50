"""What QK-clip's logit hooks cost a training step of the llama3 debug model on CPU.

One process, one configuration (so that the peak RSS is that configuration's):

    OMP_NUM_THREADS=1 python scripts/qk_clip_overhead.py off
    OMP_NUM_THREADS=1 python scripts/qk_clip_overhead.py hook    # measure logits only
    OMP_NUM_THREADS=1 python scripts/qk_clip_overhead.py clip    # measure and clip (threshold 0.5)

Each runs the debug model (dim 256, 6 layers, 16 heads, vocab 2048) at batch 2 x seq_len
256 in fp32 with TorchTitan's DMuon container, 3 warm-up steps then 10 timed steps of
forward + backward + optimizer step, and prints the median step time, the time spent
inside the hooks per step, and the process's peak resident memory. Numbers on a shared CPU are indicative only.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time

import torch

import torchtitan_ext.titan02.job  # noqa: F401  (registers the DMuon-aware train specs)
from torchtitan.config import ConfigManager
from torchtitan.models.llama3 import llama3_args, Transformer
from torchtitan.protocols.train_spec import get_train_spec

MODES = {"off": [], "hook": ["--optimizer.track_max_logits"], "clip": ["--optimizer.qk_clip_threshold", "0.5"]}


def main(mode: str) -> None:
    torch.set_num_threads(1)
    args = llama3_args["debugmodel"]
    args.vocab_size = 2048
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    argv = ["--job.custom_config_module", "torchtitan_ext", "--experimental.custom_import",
            "torchtitan_ext.titan02.job", "--optimizer.name", "DMuon", "--optimizer.ns_dtype", "float32", *MODES[mode]]
    optimizers = get_train_spec("llama3").build_optimizers_fn([model], ConfigManager().parse_args(argv).optimizer, None)
    # Time spent inside the hooks themselves: on a shared CPU the step times are noisy,
    # this part of them much less so.
    in_hooks = [0.0]
    for optimizer in optimizers.optimizers:
        observe = optimizer.max_logits.observe

        def timed(*a, observe=observe, **kw):
            start = time.perf_counter()
            observe(*a, **kw)
            in_hooks[0] += time.perf_counter() - start

        optimizer.max_logits.observe = timed
    tokens = torch.randint(0, args.vocab_size, (2, 257), generator=torch.Generator().manual_seed(0))
    times = []
    for step in range(13):
        start = time.perf_counter()
        optimizers.zero_grad()
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizers.step()
        if step == 2:
            in_hooks[0] = 0.0
        if step >= 3:
            times.append(time.perf_counter() - start)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print(f"{mode}: {statistics.median(times) * 1e3:.1f} ms/step (median of {len(times)}), "
          f"{in_hooks[0] / len(times) * 1e3:.1f} ms/step in the hooks, peak RSS {peak_mib:.0f} MiB, "
          f"cpu {torch.backends.cpu.get_cpu_capability()}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "off")

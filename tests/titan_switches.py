"""The switch runs of ``tests/test_torchtitan_switches.py`` and ``tests/test_titan03_switches.py``:
a TorchTitan job (0.2.x through ``tests/titan_runs.py``; 0.3.x with a config function of
``tests/titan03_switches.py``) with the probe of ``tests/titan_hooks/step_probe.py``, and
what each of its ranks recorded after every step.

Every run is a recipe cut short (seq_len 128, a few steps, 2 gloo ranks); what a switch
promises is read from the records: the exact logged loss, a digest of the rank's
parameter shards, each attention's per-head largest logit, the Muon weights' local tensor
types and float8 scales, Dynamo's compiled versions of a block, graph breaks.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests import launch
from tests.titan_hooks.step_probe import PROBE_ENV
from tests.titan_runs import REPO, RUN_TIMEOUT_S, RunFailed, torchrun
from torchtitan_ext.titan_log import parse_log, TitanLog

PROBE_MODULE = "tests.titan_hooks.switch_probe"
TITAN03_MODULE = "tests.titan03_switches"
RECIPE_8B = REPO / "train_configs" / "llama3_8b_dmuon.toml"
# The 8B recipe's float8 line as it ships (commented out), and uncommented.
FLOAT8_LINE_COMMENTED = '# converters = ["quantize.linear.float8"]\n'
FLOAT8_LINE = 'converters = ["quantize.linear.float8"]\n'


@dataclass(frozen=True)
class SwitchRun:
    """One finished run: rank 0's log and console, and every rank's step records."""

    log: TitanLog
    out: str
    records: list[list[dict[str, Any]]]

    def steps(self, rank: int = 0) -> dict[int, dict[str, Any]]:
        """Rank ``rank``'s records by training step."""
        return {record["step"]: record for record in self.records[rank]}

    def losses(self) -> dict[int, float]:
        """The exact loss TorchTitan logged at each step (equal on every rank)."""
        return {step: record["loss"] for step, record in self.steps().items()}

    def digests(self) -> list[dict[int, str]]:
        """Per rank, the digest of its parameter shards after each step."""
        return [{r["step"]: r["digest"] for r in rank} for rank in self.records]


def switch_run(toml: Path, folder: Path, *overrides: str, nproc: int = 2) -> SwitchRun:
    """Run ``toml`` (TorchTitan 0.2.x) with ``overrides`` and the probe; the records are
    read back per rank."""
    probe = folder / "probe"
    probe.mkdir(parents=True, exist_ok=True)
    log, out = torchrun(toml, folder, *overrides, "--experimental.custom_import", PROBE_MODULE, nproc=nproc,
                        env={PROBE_ENV: str(probe)})
    return SwitchRun(log, out, _records(probe, nproc))


def titan03_switch_run(config: str, folder: Path, tokenizer_dir: Path, *overrides: str, steps: int,
                       nproc: int = 2) -> SwitchRun:
    """Run TorchTitan 0.3.x's config function ``config`` of ``tests/titan03_switches.py``
    (which arms the probe) for ``steps`` steps, with ``overrides``."""
    probe = folder / "probe"
    probe.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--local-ranks-filter=0", "-m", "torchtitan.train", "--module", TITAN03_MODULE, "--config", config,
           "--dump_folder", str(folder), "--hf_assets_path", str(tokenizer_dir), "--training.steps", str(steps),
           "--training.seq_len", "128", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
           "--validator.no-enable", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               **{PROBE_ENV: str(probe)})
    proc = launch.run(cmd, timeout_s=RUN_TIMEOUT_S, cwd=REPO, env=env)
    if proc.returncode != 0:
        raise RunFailed(f"torchrun exited with {proc.returncode}:\n{proc.stdout[-6000:]}")
    return SwitchRun(parse_log(proc.stdout), proc.stdout, _records(probe, nproc))


def _records(probe: Path, nproc: int) -> list[list[dict[str, Any]]]:
    return [[json.loads(line) for line in (probe / f"rank{rank}.jsonl").read_text().splitlines()]
            for rank in range(nproc)]


def recipe_with_float8(folder: Path) -> Path:
    """The 8B recipe with its float8 converter line uncommented, as a user would."""
    text = RECIPE_8B.read_text()
    assert FLOAT8_LINE_COMMENTED in text, f"{RECIPE_8B.name} no longer has the line {FLOAT8_LINE_COMMENTED!r}"
    path = folder / "llama3_8b_dmuon_float8.toml"
    path.write_text(text.replace(FLOAT8_LINE_COMMENTED, FLOAT8_LINE))
    return path


def recipe_on_cpu(tokenizer_dir: Path, steps: int) -> list[str]:
    """Overrides that run the 8B recipe's settings on the debug model on CPU ranks: the
    embedded data and tokenizer, short sequences, no profiler or TensorBoard, and
    TorchTitan's float8 emulation (real float8 matmuls need an SM89 GPU)."""
    return [
        "--model.flavor", "debugmodel", "--model.hf_assets_path", str(tokenizer_dir),
        "--training.dataset", "pydoc", "--training.seq_len", "128", "--training.local_batch_size", "2",
        "--training.steps", str(steps), "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
        "--metrics.no-enable_tensorboard", "--profiling.no-enable_profiling",
        "--quantize.linear.float8.emulate",
    ]


def relative_gaps(actual: dict[str, list[float]], expected: dict[str, list[float]]) -> float:
    """The largest relative difference between two runs' per-head max logits (same
    attentions, same heads); ``inf`` where one is missing or not finite."""
    if actual.keys() != expected.keys() or not expected:
        return math.inf
    gaps = [abs(a - e) / abs(e) if math.isfinite(a) and math.isfinite(e) and e else math.inf
            for name in expected for a, e in zip(actual[name], expected[name], strict=True)]
    return max(gaps)

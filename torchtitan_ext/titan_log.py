"""Read TorchTitan's console output back into numbers (for the demo and the tests).

TorchTitan 0.2.2 prints, on each rank, lines such as::

    [titan] 2026-11-22 08:20:19,431 - root - INFO - step: 10  loss:  7.86704  grad_norm: ...
    [titan] 2026-11-22 08:20:20,363 - root - INFO - validate step: 20  loss:  7.0685  ...

With ``[optimizer] telemetry = true`` a DMuon step line ends with DMuon's figures
(``step_metrics.py``)::

    ... mfu: 0.01%  opt: 151.2ms  ns: 98.7ms  sent: 0.30MiB  muon_rms upd/w: 1.05e-03/2.71e-02  adamw_rms upd/w: ...

``parse_log`` turns one log (use ``torchrun --local-ranks-filter 0`` so there is
one rank's output) into losses by step, the wall-clock time of each line, and those
figures by step when present. With QK-clip the figures end with
``max_logit: 31.52  clipped_heads: 7``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TIME = r"\[titan\] (?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
_TRAIN = re.compile(_TIME + r".*?(?<!validate )step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-+0-9.eEnaif]+)")
_NUMBER = r"[-+0-9.eEnaif]+"
_TELEMETRY = re.compile(
    rf"opt: (?P<optimizer_step_ms>{_NUMBER})ms  ns: (?P<newton_schulz_ms>{_NUMBER})ms  "
    rf"sent: (?P<sent_mib>{_NUMBER})MiB  "
    rf"muon_rms upd/w: (?P<muon_update_rms>{_NUMBER})/(?P<muon_weight_rms>{_NUMBER})  "
    rf"adamw_rms upd/w: (?P<adamw_update_rms>{_NUMBER})/(?P<adamw_weight_rms>{_NUMBER})"
)
# Only with QK-clip (or track_max_logits): after the figures above.
_QK_CLIP = re.compile(rf"max_logit: (?P<max_logit>{_NUMBER})  clipped_heads: (?P<qk_clipped_heads>\d+)")
_VALID = re.compile(_TIME + r".*?validate step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-+0-9.eEnaif]+)")


@dataclass
class TitanLog:
    train_loss: dict[int, float] = field(default_factory=dict)
    val_loss: dict[int, float] = field(default_factory=dict)
    train_time: dict[int, datetime] = field(default_factory=dict)
    val_time: dict[int, datetime] = field(default_factory=dict)
    telemetry: dict[int, dict[str, float]] = field(default_factory=dict)
    """Step -> DMuon's figures on that step line (``optimizer_step_ms``, ``newton_schulz_ms``,
    ``sent_mib``, ``muon_update_rms``, ``muon_weight_rms``, ``adamw_update_rms``,
    ``adamw_weight_rms``, and with QK-clip ``max_logit``, ``qk_clipped_heads``); empty when
    telemetry was off."""

    def steps_per_second(self) -> float:
        """Training throughput between the first and last logged step after step 1.

        Step 1 (warm-up, lazy initialisation) is excluded, and so is the time spent
        in validation passes, so AdamW and DMuon runs compare like for like.
        """
        steps = sorted(s for s in self.train_time if s > 1)
        if len(steps) < 2:
            raise ValueError("need at least two logged training steps after step 1")
        first, last = steps[0], steps[-1]
        seconds = (self.train_time[last] - self.train_time[first]).total_seconds()
        for step, t_val in self.val_time.items():
            if first <= step < last and step in self.train_time:
                seconds -= (t_val - self.train_time[step]).total_seconds()
        return (last - first) / seconds


def _time(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f")


def parse_log(text: str) -> TitanLog:
    """Losses and times from TorchTitan console text (first occurrence of each step wins)."""
    log = TitanLog()
    for line in _ANSI.sub("", text).splitlines():
        if m := _VALID.search(line):
            step = int(m["step"])
            log.val_loss.setdefault(step, float(m["loss"]))
            log.val_time.setdefault(step, _time(m["time"]))
        elif m := _TRAIN.search(line):
            step = int(m["step"])
            log.train_loss.setdefault(step, float(m["loss"]))
            log.train_time.setdefault(step, _time(m["time"]))
            if t := _TELEMETRY.search(line):
                figures = {k: float(v) for k, v in t.groupdict().items()}
                if q := _QK_CLIP.search(line):
                    figures.update({k: float(v) for k, v in q.groupdict().items()})
                log.telemetry.setdefault(step, figures)
    return log

"""Read TorchTitan's console output back into numbers (for the demo and the tests).

TorchTitan 0.2.2 prints, on each rank, lines such as::

    [titan] 2026-11-22 08:20:19,431 - root - INFO - step: 10  loss:  7.86704  grad_norm: ...
    [titan] 2026-11-22 08:20:20,363 - root - INFO - validate step: 20  loss:  7.0685  ...

``parse_log`` turns one log (use ``torchrun --local-ranks-filter 0`` so there is
one rank's output) into losses by step and the wall-clock time of each line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TIME = r"\[titan\] (?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
_TRAIN = re.compile(_TIME + r".*?(?<!validate )step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-+0-9.eEnaif]+)")
_VALID = re.compile(_TIME + r".*?validate step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-+0-9.eEnaif]+)")


@dataclass
class TitanLog:
    train_loss: dict[int, float] = field(default_factory=dict)
    val_loss: dict[int, float] = field(default_factory=dict)
    train_time: dict[int, datetime] = field(default_factory=dict)
    val_time: dict[int, datetime] = field(default_factory=dict)

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
    return log

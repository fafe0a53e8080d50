"""Gathers what ``scripts/gpu_check.sh``'s parts left in its work folder into one
``summary.json`` in the output folder: the device, the torch, and per part its status
(ok, failed or skipped), seconds, reason, log and figures.

    python -m benchmarks.gpu_check_summary WORK OUT

The script calls it after every part, so the summary is current even if the whole check
is killed. Read from WORK:

- ``parts.tsv``: one line per part, ``name<TAB>status<TAB>seconds<TAB>log<TAB>reason``;
- ``setup.json``: the device name, torch and Python versions, the mode;
- ``NAME.json``: a part's figures (a ``benchmarks.gpu_check`` fragment's ``figures``, or
  any JSON object a part printed, e.g. ``benchmarks.ns_throughput --json``);
- ``NAME.xml``: a pytest part's JUnit report (passed, failed, skipped, and skip reasons);
- OUT's ``torchtitan.log``: the losses of TorchTitan's step lines (first, last, falls).
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# TorchTitan 0.2.2's step line: "step:  1  loss:  8.1234  ..." (colors off in the TOML).
LOSS = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.]+)")


def junit_figures(path: Path) -> dict:
    """Counts of a pytest JUnit report, and the first few skip and failure messages."""
    root = ET.parse(path).getroot()
    cases = root.iter("testcase")
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    notes: list[str] = []
    for case in cases:
        failure = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            counts["failed"] += 1
            notes.append(f"FAILED {case.get('name')}: {(failure.get('message') or '')[:200]}")
        elif skipped is not None:
            counts["skipped"] += 1
            notes.append(f"skipped {case.get('name')}: {(skipped.get('message') or '')[:120]}")
        else:
            counts["passed"] += 1
    return {**counts, "notes": notes[:12]}


def loss_figures(log: Path) -> dict:
    """First and last loss of TorchTitan's step lines, and whether it fell."""
    steps = [(int(s), float(v)) for s, v in LOSS.findall(log.read_text(errors="replace"))]
    if not steps:
        return {}
    (first_step, first), (last_step, last) = steps[0], steps[-1]
    return {"first_step": first_step, "first_loss": first, "last_step": last_step, "last_loss": last,
            "loss_falls": last < first}


def summarize(work: Path, out: Path) -> dict:
    setup = json.loads((work / "setup.json").read_text()) if (work / "setup.json").exists() else {}
    parts = {}
    tsv = work / "parts.tsv"
    for line in tsv.read_text().splitlines() if tsv.exists() else []:
        name, status, seconds, log, reason = (line.split("\t") + [""] * 5)[:5]
        part = {"status": status, "seconds": float(seconds or 0), "log": log, "reason": reason, "figures": {}}
        fragment = work / f"{name}.json"
        if fragment.exists():
            try:
                data = json.loads(fragment.read_text())
                part["figures"] = data.get("figures", data) if isinstance(data, dict) else data
                if isinstance(data, dict) and data.get("reason"):
                    part["reason"] = f"{part['reason']}: {data['reason']}" if part["reason"] else data["reason"]
            except ValueError as error:
                part["reason"] = (part["reason"] + f"; unreadable figures: {error}").strip("; ")
        if (work / f"{name}.xml").exists():
            part["figures"]["tests"] = junit_figures(work / f"{name}.xml")
        if name == "torchtitan" and (out / "torchtitan.log").exists():
            part["figures"].update(loss_figures(out / "torchtitan.log"))
            if status == "ok" and not part["figures"].get("loss_falls"):
                part.update(status="failed", reason="no falling loss in TorchTitan's step lines")
        parts[name] = part
    statuses = [p["status"] for p in parts.values()]
    summary = {**setup, "parts": parts,
               "ok": sum(s == "ok" for s in statuses), "failed": sum(s == "failed" for s in statuses),
               "skipped": sum(s == "skipped" for s in statuses)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m benchmarks.gpu_check_summary WORK OUT")
    summary = summarize(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"summary: {summary['ok']} ok, {summary['failed']} failed, {summary['skipped']} skipped")

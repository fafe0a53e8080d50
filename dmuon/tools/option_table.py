"""``python -m dmuon.tools.option_table``: DMuon's option table (``dmuon.options.table``) as the
Markdown table docs/optimizer.md holds between its markers; ``--check`` says whether the
docs hold it as it is now (tests/test_option_table.py runs that check)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dmuon.options.table import FACTORY_KWARGS, GROUP_KWARGS, OnResume, OPTIONS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "optimizer.md"
BEGIN = "<!-- option table: python -m dmuon.tools.option_table writes it -->"
END = "<!-- end of the option table -->"
# How a resume's rule reads in a table cell.
ON_RESUME = {OnResume.APPLIED: "applied", OnResume.CONVERTED: "applied, the momentum converted",
             OnResume.REFUSED: "**refused**", OnResume.NOT_SAVED: "not saved"}
# How TorchTitan 0.3's two places read in a cell.
PLACES_0_3 = {GROUP_KWARGS: "group", FACTORY_KWARGS: "factory"}


def markdown() -> str:
    """The option table: one row an option, in the table's order."""
    rows = ["| option | default | applies to | a change on resume | TorchTitan 0.2 `[optimizer]` field "
            "| 0.3: `group` or `factory` | what it does |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for o in OPTIONS:
        key = "" if o.key == o.name else f" (the group's `{o.key}`)"
        rows.append(f"| `{o.name}`{key} | `{o.default!r}` | {o.scope.value} | {ON_RESUME[o.on_resume]} | "
                    f"{_field(o.titan02)} | {_field(PLACES_0_3.get(o.titan03, o.titan03))} | {o.summary} |")
    return "\n".join(rows)


def _field(name: str | None) -> str:
    return "none (the default)" if name is None else ", ".join(f"`{part.strip()}`" for part in name.split(","))


def in_docs(text: str) -> str | None:
    """The table between the markers of ``text``, or None when they are missing."""
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dmuon.tools.option_table", description=__doc__)
    parser.add_argument("--check", action="store_true", help=f"exit 1 unless {DOCS.name} holds this table")
    parser.add_argument("--write", action="store_true", help=f"write it into {DOCS.name} between its markers")
    args = parser.parse_args(argv)
    table = markdown()
    text = DOCS.read_text()
    if args.check:
        same = in_docs(text) == table
        print("the option table in docs/optimizer.md is up to date" if same else
              "docs/optimizer.md's option table differs: python -m dmuon.tools.option_table --write")
        return 0 if same else 1
    if args.write:
        if in_docs(text) is None:
            print(f"docs/optimizer.md has no markers {BEGIN!r} ... {END!r}", file=sys.stderr)
            return 1
        head, rest = text.split(BEGIN, 1)
        DOCS.write_text(f"{head}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}")
        return 0
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

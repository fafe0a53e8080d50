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
ON_RESUME = {OnResume.APPLIED: "applied", OnResume.CONVERTED: "applied, the state converted",
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


def marked_table(text: str, begin: str, end: str) -> str | None:
    """The table between the markers ``begin`` and ``end`` of ``text``, or None when they are missing."""
    if begin not in text or end not in text:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0].strip()


def in_docs(text: str) -> str | None:
    """The option table between docs/optimizer.md's markers in ``text``, or None when they are missing."""
    return marked_table(text, BEGIN, END)


def docs_table_main(argv: list[str] | None, *, prog: str, description: str | None, docs: Path, begin: str,
                    end: str, table: str, what: str) -> int:
    """The command line of a generated docs table: print it, ``--check`` that ``docs`` holds it
    between its markers (exit 1 if not), or ``--write`` it there."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=description)
    parser.add_argument("--check", action="store_true", help=f"exit 1 unless {docs.name} holds this table")
    parser.add_argument("--write", action="store_true", help=f"write it into {docs.name} between its markers")
    args = parser.parse_args(argv)
    text = docs.read_text()
    if args.check:
        same = marked_table(text, begin, end) == table
        print(f"the {what} in {docs.name} is " + ("up to date" if same else f"stale: python -m {prog} --write"))
        return 0 if same else 1
    if args.write:
        if marked_table(text, begin, end) is None:
            print(f"{docs.name} has no markers {begin!r} ... {end!r}", file=sys.stderr)
            return 1
        head, rest = text.split(begin, 1)
        docs.write_text(f"{head}{begin}\n{table}\n{end}{rest.split(end, 1)[1]}")
        return 0
    print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    return docs_table_main(argv, prog="dmuon.tools.option_table", description=__doc__, docs=DOCS, begin=BEGIN,
                           end=END, table=markdown(), what="option table")


if __name__ == "__main__":
    sys.exit(main())

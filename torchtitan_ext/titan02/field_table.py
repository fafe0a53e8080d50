"""``python -m torchtitan_ext.titan02.field_table``: DMuon's ``[optimizer]`` fields (the
``Optimizer`` dataclass of ``torchtitan_ext.titan02.config``) as the Markdown table
docs/torchtitan.md holds between its markers: each field's name, its default as TOML writes
it, and its docstring. ``--check`` says whether the docs hold it as it is now, ``--write``
writes it (tests/test_option_table.py runs the check), so a new field needs no hand row."""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
from pathlib import Path

from dmuon.tools import docs_table_main, marked_table

from .config import Optimizer

CONFIG = Path(__file__).with_name("config.py")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "torchtitan.md"
BEGIN = "<!-- [optimizer] field table: python -m torchtitan_ext.titan02.field_table writes it -->"
END = "<!-- end of the [optimizer] field table -->"


def docstrings() -> dict[str, str]:
    """Each field's docstring (the string after it in ``config.py``), on one line."""
    body = next(node for node in ast.parse(CONFIG.read_text()).body
                if isinstance(node, ast.ClassDef) and node.name == Optimizer.__name__).body
    found = {}
    for field, doc in zip(body, body[1:]):
        if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
            found[field.target.id] = " ".join(doc.value.value.split()).replace("``", "`")
    return found


def toml(value: object) -> str:
    """A default as TOML writes it (``unset`` for None)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`'{value}'`" if re.search(r"[\\\\\"]", value) else f'`"{value}"`'
    return f"`{value!r}`".replace("(", "[").replace(")", "]")


def markdown() -> str:
    """The table: one row a field of ``Optimizer``, in its order."""
    docs = docstrings()
    rows = ["| field | default | meaning with `name = \"DMuon\"` |", "| --- | --- | --- |"]
    for field in dataclasses.fields(Optimizer):
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        cells = (f"`{field.name}`", toml(default), docs[field.name])
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")  # a | in a cell: \|
    return "\n".join(rows)


def in_docs(text: str) -> str | None:
    """The field table between docs/torchtitan.md's markers in ``text``, or None when they are missing."""
    return marked_table(text, BEGIN, END)


def main(argv: list[str] | None = None) -> int:
    return docs_table_main(argv, prog="torchtitan_ext.titan02.field_table", description=__doc__, docs=DOCS,
                           begin=BEGIN, end=END, table=markdown(), what="[optimizer] field table")


if __name__ == "__main__":
    sys.exit(main())

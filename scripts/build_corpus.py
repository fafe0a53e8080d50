"""Regenerate the embedded training corpus ``torchtitan_ext/data/pydoc_corpus.jsonl.gz``.

The corpus is real English technical prose that every machine with Python already
has, so the demo needs no download:

* the Python Language Reference topics that ``pydoc`` ships (``pydoc_data.topics``),
* the docstrings of a fixed list of standard-library modules (module, classes,
  functions and methods, in source order).

Both are part of CPython and distributed under the PSF License Agreement (see
https://docs.python.org/3/license.html). The shipped file was produced with
CPython 3.11.7; other versions word a few docstrings differently, which is why the
result is committed instead of being regenerated on every machine.

The text is cut into chunks of roughly ``--chunk-chars`` characters at paragraph
boundaries. Each chunk becomes one JSON line ``{"id": ..., "source": ..., "text": ...}``.
``torchtitan_ext.corpus`` decides which chunks are held out for validation.

Usage: python scripts/build_corpus.py [--out PATH] [--chunk-chars 2000]
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import inspect
import json
import sys
from pathlib import Path

# Modules whose docstrings are long, mostly prose and stable across 3.x releases.
STDLIB_MODULES = [
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "cmd",
    "codecs", "collections", "concurrent.futures", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "doctest",
    "email.message", "enum", "fnmatch", "fractions", "ftplib", "functools",
    "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html.parser",
    "http.client", "http.server", "imaplib", "inspect", "io", "ipaddress",
    "itertools", "json", "locale", "logging", "logging.handlers", "mailbox",
    "mimetypes", "multiprocessing.pool", "numbers", "operator", "optparse",
    "os", "pathlib", "pdb", "pickle", "pickletools", "pkgutil", "platform",
    "plistlib", "poplib", "pprint", "queue", "random", "re", "sched", "secrets",
    "selectors", "shelve", "shlex", "shutil", "signal", "smtplib", "socket",
    "socketserver", "sqlite3", "statistics", "string", "struct", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize",
    "trace", "traceback", "turtle", "types", "typing", "unittest", "urllib.parse",
    "urllib.request", "uuid", "warnings", "wave", "weakref", "xml.dom.minidom",
    "xml.etree.ElementTree", "zipfile", "zoneinfo",
]


def _module_docstrings(module_name: str) -> str:
    """All docstrings of one module, in source order, as one text."""
    module = importlib.import_module(module_name)
    parts = [inspect.getdoc(module) or ""]
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            doc = inspect.getdoc(obj)
            if doc:
                parts.append(f"{name}\n\n{doc}")
            if inspect.isclass(obj):
                for attr_name, attr in vars(obj).items():
                    if attr_name.startswith("_") or not inspect.isfunction(attr):
                        continue
                    doc = inspect.getdoc(attr)
                    if doc and len(doc) > 80:  # skip one-liners, they repeat a lot
                        parts.append(f"{name}.{attr_name}\n\n{doc}")
    return "\n\n".join(p for p in parts if p.strip())


def _chunks(text: str, chunk_chars: int) -> list[str]:
    """Cut at paragraph boundaries into pieces of about ``chunk_chars`` characters."""
    chunks, current = [], ""
    for paragraph in text.split("\n\n"):
        if current and len(current) + len(paragraph) > chunk_chars:
            chunks.append(current.strip())
            current = ""
        current += paragraph + "\n\n"
    if current.strip():
        chunks.append(current.strip())
    return [c for c in chunks if len(c) > 200]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_out = Path(__file__).resolve().parents[1] / "torchtitan_ext/data/pydoc_corpus.jsonl.gz"
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--chunk-chars", type=int, default=2000)
    args = parser.parse_args()

    from pydoc_data.topics import topics

    sources = [(f"pydoc:{k}", topics[k]) for k in sorted(topics)]
    sources += [(f"docstrings:{m}", _module_docstrings(m)) for m in STDLIB_MODULES]

    records, seen = [], set()
    for source, text in sources:
        for piece in _chunks(text, args.chunk_chars):
            if piece in seen:  # some reference sections are repeated verbatim
                continue       # across topics; keep one copy so no text is in both splits
            seen.add(piece)
            records.append({"id": len(records), "source": source, "text": piece})

    # No file name and mtime=0 in the gzip header: regenerating gives identical bytes.
    with open(args.out, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f:
        for r in records:
            f.write((json.dumps(r, ensure_ascii=False) + "\n").encode())
    n_chars = sum(len(r["text"]) for r in records)
    print(f"wrote {len(records)} chunks, {n_chars / 1e6:.2f} M characters, "
          f"Python {sys.version.split()[0]} -> {args.out}")


if __name__ == "__main__":
    main()

"""The documentation holds together: every relative link and image in README.md and
docs/**/*.md points at a file that exists and, for a ``#anchor``, at a heading of that
file (GitHub's anchor rule); and README.md stays a short overview (at most 250 lines),
the details living in docs/.

Read from the Markdown text alone: fenced code blocks are skipped (a ``[x](y)`` in a
code sample is not a link), absolute URLs (``https:``, ``mailto:``) are not checked.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from urllib.parse import unquote

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_MAX_LINES = 250
PAGES = [README, *sorted((REPO / "docs").rglob("*.md"))]

# [text](target) and ![alt](target), with an optional "title" after the target.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            lines.append(line)
    return lines


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, every character that
    is not a letter, digit, space, '-' or '_' dropped, spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor GitHub makes for the page's headings (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _prose_lines(page.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        anchor = github_anchor(match.group(2))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        out.add(anchor if count == 0 else f"{anchor}-{count}")
    return out


def links(page: Path) -> list[str]:
    return [m.group(1) for line in _prose_lines(page.read_text()) for m in LINK.finditer(line)]


def _is_external(target: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target)) or target.startswith("//")


def broken_links(page: Path) -> list[str]:
    """``"target: why"`` for every relative link or image of the page that does not resolve."""
    problems = []
    for target in links(page):
        if _is_external(target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = page.parent / unquote(path_part) if path_part else page
        if not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            problems.append(f"{target}: no heading with that anchor in {dest.name}")
    return problems


def test_the_pages_are_there():
    names = {p.relative_to(REPO).as_posix() for p in PAGES}
    for name in ("README.md", "docs/architecture.md", "docs/layouts.md", "docs/scaling.md",
                 "docs/torchtitan.md", "docs/benchmark.md", "docs/reliability.md", "docs/study.md",
                 "docs/optimizer.md", "docs/development.md", "docs/study/report.md"):
        assert name in names, name


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_and_image_resolves(page):
    assert broken_links(page) == []


def test_the_readme_is_at_most_250_lines():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail into docs/"


def test_the_readme_maps_every_docs_page():
    """Every top-level docs page is linked from the README's map."""
    targets = {t.partition("#")[0] for t in links(README)}
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"docs/{page.name}" in targets, page.name


def test_the_checker_sees_links_anchors_and_code_as_github_does(tmp_path):
    """The checker itself: anchors as GitHub makes them, links in code blocks ignored,
    a missing file or heading reported."""
    assert github_anchor("`[optimizer]` fields") == "optimizer-fields"
    assert github_anchor("`ns_dtype`") == "ns_dtype"
    assert github_anchor("HSDP: split Newton-Schulz across replicas or not") == (
        "hsdp-split-newton-schulz-across-replicas-or-not")
    assert github_anchor("CPUs without AVX-512 (`scripts/as_avx2.sh`)") == "cpus-without-avx-512-scriptsas_avx2sh"
    (tmp_path / "b.md").write_text("# Title\n\n## Same\n\n## Same\n")
    page = tmp_path / "a.md"
    page.write_text(
        "# A\n\n[ok](b.md#title) [dup](b.md#same-1) [self](#a) ![img](missing.png)\n"
        "[gone](b.md#nope) [web](https://example.com/x.md)\n\n```\n[in code](nowhere.md)\n```\n"
    )
    assert [p.split(":")[0] for p in broken_links(page)] == ["missing.png", "b.md#nope"]


def test_the_readmes_fsdp2_excerpt_is_the_example_scripts_own_code():
    readme = (REPO / "README.md").read_text()
    (excerpt,) = re.findall(r"```python\n(model = TinyLM\(\).*?)```", readme, re.S)
    example = (REPO / "examples" / "fsdp2_dmuon.py").read_text()
    assert textwrap.indent(excerpt, "    ", lambda line: line.strip() != "") in example

"""Every link of the README and the docs leads somewhere: the file exists, and the heading an anchor names is there.

A reader finds configuration, operations and security from the README's first screen, and each page
sends them on by links; a page renamed or a heading reworded must not leave a link that goes nowhere.
Anchors are resolved as GitHub renders them (the heading's text, lowercased, punctuation dropped, spaces
as hyphens, ``-1``, ``-2`` for repeats).  Links to other sites are not fetched.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: The pages whose links are checked.
PAGES = sorted(
    [ROOT / "README.md", ROOT / "helm" / "README.md", ROOT / "pipelines" / "README.md",
     ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")]
)


FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The page's lines outside fenced code blocks, with their line numbers."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its rendered text, lowercased, without punctuation or symbols."""
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text stays, its target goes
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("**", "").replace("*", "")
    kept = "".join(c for c in text.lower()
                   if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor a link may name in the page: its headings' slugs (repeats numbered) and HTML anchors."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        found.update(HTML_ANCHOR.findall(line))
        heading = HEADING.match(line)
        if not heading:
            continue
        base = slug(heading.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """The link targets of a page's prose (inline, image and reference links), with their line numbers."""
    found = []
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            found.append((number, definition.group(1)))
            continue
        line = CODE_SPAN.sub("", line)
        found += [(number, target) for target in INLINE_LINK.findall(line) + IMAGE_LINK.findall(line)]
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Each link of the page that leads nowhere, as 'line N: target: why' (paths relative to ``root``)."""
    problems = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:: another site
            continue
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if root not in destination.parents and destination != root:
            problems.append(f"line {number}: {target}: outside the repository")
            continue
        name = destination.relative_to(root).as_posix()
        if not destination.exists():
            problems.append(f"line {number}: {target}: no file {name}")
            continue
        if anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            problems.append(f"line {number}: {target}: no heading with anchor #{anchor} in {name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page: Path) -> None:
    """Every relative link of the page names a file of the repository, and an anchor a heading of it."""
    assert broken_links(page) == []


def test_readme_first_screen_leads_to_the_docs() -> None:
    """The README's first screen (40 lines) has the two commands and links to configuration, operations
    and security."""
    first_screen = "\n".join((ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:40])
    assert "make demo\nmake test\n" in first_screen
    for doc in ("docs/configuration.md", "docs/operations.md", "docs/security.md", "bench/README.md",
                "docs/fault-harness.md"):
        assert f"]({doc}" in first_screen, doc


def test_the_checker_finds_a_broken_link_and_a_missing_anchor(tmp_path: Path) -> None:
    """The checker is not vacuous: a missing file and a missing heading are both reported, while a link
    inside a code block or to another site is left alone."""
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## The `sluice region -c FILE` command\n")
    page.write_text(
        "# Page\n\n"
        "[fine](other.md#the-sluice-region--c-file-command) [here](#page) [web](https://example.org/x)\n"
        "[gone](missing.md) [no heading](other.md#nowhere)\n"
        "```\n[in code](missing-too.md)\n```\n"
        "`[in a span](missing-three.md)`\n"
    )
    assert broken_links(page, root=tmp_path) == [
        "line 4: missing.md: no file missing.md",
        "line 4: other.md#nowhere: no heading with anchor #nowhere in other.md",
    ]


@pytest.mark.parametrize("heading, anchor", [
    ("Geode → Sluice", "geode--sluice"),
    ("The region service (`sluice region -c FILE`)", "the-region-service-sluice-region--c-file"),
    ("Where issue 19's aims stand", "where-issue-19s-aims-stand"),
    ("2. The users", "2-the-users"),
    ("`dispatcher.sql.postgres.*`: write-behind", "dispatchersqlpostgres-write-behind"),
])
def test_slug_follows_github(heading: str, anchor: str) -> None:
    """Anchors are GitHub's: punctuation and symbols dropped, code kept as text, spaces as hyphens."""
    assert slug(heading) == anchor

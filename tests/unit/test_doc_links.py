"""The docs' links lead somewhere (issue 58, when docs/operating.md became a page per task): every relative link
of README.md, docs/ and bench/README.md names a file that exists, and its `#anchor` a heading of that file, as
GitHub renders them. Read from the files; links inside code blocks are text, not links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\]\(([^()\s]+)\)")  # [text](target) and ![alt](image)
FENCE = re.compile(r"^ *```.*?^ *```", re.MULTILINE | re.DOTALL)


def prose(path: Path) -> str:
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def anchors(path: Path) -> set[str]:
    """The ids GitHub gives a page's headings (lower case, punctuation dropped, spaces as hyphens, -1, -2 for
    repeats), and those its `<a id="...">` tags give."""
    found = set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", prose(path)))
    for heading in re.findall(r"^#{1,6} +(.+?) *$", prose(path), re.MULTILINE):
        text = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        anchor, repeat = slug, 0
        while anchor in found:
            repeat += 1
            anchor = f"{slug}-{repeat}"
        found.add(anchor)
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(path)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        name, _, anchor = target.partition("#")
        linked = (path.parent / name).resolve() if name else path
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            broken.append(target)
    return broken


def test_anchors_are_made_as_github_makes_them():
    """The check below is only as good as this: the ids of headings the docs link to."""
    assert "several-cores---workers-n" in anchors(ROOT / "docs" / "workers.md")
    assert {"leases", "work-queue-semantics-extensions"} <= anchors(ROOT / "docs" / "protocol.md")
    assert "a-secured-cluster-three-hosts-tls-everywhere-a-nats-user-per-node-scoped-tokens" in anchors(
        ROOT / "docs" / "security.md")


@pytest.mark.parametrize("path", PAGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_of_the_docs_leads_somewhere(path: Path):
    assert broken_links(path) == []

"""The maps a newcomer reads first point at files that exist (issue 58): every `name.py` or `folder/` a module's or a
package's docstring (server/, client/, common/, spark/) names, docs/internals.md's module map, and the paths its prose
gives. Read from the sources."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "client", "common", "spark")
# a module (`relay.py`, `server/journal/log.py`) or a folder (`node/`), not part of a longer word, path or URL
NAMED = re.compile(r"(?<![\w./:@-])((?:[A-Za-z_][\w-]*/)*[A-Za-z_][\w-]*(?:\.py|/))(?![\w/-]|\.\w)")
INTERNALS = ROOT / "docs" / "internals.md"
MAP_HEADING = "## The modules, in the order a line travels"
ABOUT_COLUMN = 30  # a map line indented this far only goes on describing the entry above it


def named(text: str) -> list[str]:
    return NAMED.findall(text)


def found(name: str, folder: Path) -> bool:
    """`name` is in `folder` or in a folder above it, up to the repository's root: a docstring names its own
    package's modules bare (`relay.py`), another package's from their common parent (`journal/records.py` in
    server/core/), and anything from the root (`server/journal/log.py`, `client/stats.py`)."""
    return any((place / name).exists() for place in (folder, *folder.parents) if place.is_relative_to(ROOT))


def modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", modules(), ids=lambda path: str(path.relative_to(ROOT)))
def test_every_module_a_docstring_names_exists(path: Path):
    """Package docstrings (__init__.py) are the maps; a module's docstring names its neighbours the same way."""
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    assert [name for name in named(docstring) if not found(name, path.parent)] == []


def module_map() -> list[tuple[str, Path, bool]]:
    """(name, folder, is_entry) for every name docs/internals.md's module map gives: an entry (the map's left
    column) must be in the folder it is listed under; a name in an entry's description may be in a folder above."""
    block = INTERNALS.read_text(encoding="utf-8").split(MAP_HEADING, 1)[1].split("```")[1]
    names: list[tuple[str, Path, bool]] = []
    folder = ROOT
    folders: list[tuple[int, Path]] = []  # the folder entries above this line, with their indents
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        if indent >= ABOUT_COLUMN:
            names += [(name, folder, False) for name in named(line)]
            continue
        entries, _, about = line.strip().partition("  ")  # the left column ends at the first two spaces
        while folders and folders[-1][0] >= indent:
            folders.pop()
        base = folders[-1][1] if folders else ROOT
        for entry in entries.split(", "):
            names.append((entry, base, True))
        folder = base / entries if entries.endswith("/") else base
        if entries.endswith("/"):
            folders.append((indent, folder))
        names += [(name, folder, False) for name in named(about)]
    return names


def test_the_module_map_has_entries():
    """The parser below reads the map as it is laid out: a change of layout must not make the next test vacuous."""
    entries = [(name, folder) for name, folder, is_entry in module_map() if is_entry]
    assert ("relay.py", ROOT / "server" / "workers") in entries and ("stats.py", ROOT) in entries
    assert ("client.py", ROOT / "client" / "aio") in entries  # a folder's folder
    assert len(entries) > 50


def test_every_module_the_module_map_names_exists():
    missing = [f"{folder.relative_to(ROOT) / name}" for name, folder, is_entry in module_map()
               if not ((folder / name).exists() if is_entry else found(name, folder))]
    assert missing == []


def test_the_module_map_has_a_line_for_every_module():
    """Every module of server/, client/, common/ and spark/ is an entry of the map (its left column), so a module
    added or moved without its line fails here (issue 58: common/slots.py and four Spark modules had none)."""
    entries = {folder / name for name, folder, is_entry in module_map() if is_entry}
    assert [str(path.relative_to(ROOT)) for path in modules()
            if path.name != "__init__.py" and path not in entries] == []


def test_every_path_the_internals_prose_gives_exists():
    """Outside the map the walk-throughs name modules from server/ (`edges/connection.py`) or from the root
    (`server/journal/records.py`, `tests/unit/cluster/test_election.py`); a bare `name.py` there is left to the
    sentence around it."""
    text = INTERNALS.read_text(encoding="utf-8")
    head, _, rest = text.partition(MAP_HEADING)
    prose = head + rest.split("```", 2)[2]
    missing = [name for name in named(prose)
               if "/" in name.rstrip("/") and not any((ROOT / base / name).exists() for base in ("", "server"))]
    assert missing == []

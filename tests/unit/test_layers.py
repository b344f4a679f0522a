"""The layers' imports (issue 40): the clients and the Spark source import nothing of the broker's (what both read
lives in common/), and the storage below the cluster layer imports nothing above it. Read from the sources."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(folder: str, package: str) -> dict[str, set[str]]:
    """Every module each file of `folder` imports, relative imports resolved against `package`."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        parts = [*package.split("."), *path.relative_to(ROOT / folder).with_suffix("").parts]
        here = parts[:-1]  # the package a relative import starts from (an __init__ is its own package)
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = here[:len(here) - node.level + 1] if node.level else []
                module = ".".join([*base, node.module] if node.module else base)
                names.add(module)
                names.update(f"{module}.{alias.name}" for alias in node.names)
        found[str(path.relative_to(ROOT))] = names
    return found


@pytest.mark.parametrize("folder,package", [("client", "mqks.client"), ("spark", "mqks.spark"),
                                            ("common", "mqks.common")])
def test_the_clients_import_nothing_of_the_broker(folder: str, package: str):
    offending = {path: sorted(n for n in names if n.startswith("mqks.server"))
                 for path, names in imported_modules(folder, package).items()}
    assert {path: names for path, names in offending.items() if names} == {}


def test_the_journal_imports_nothing_above_it():
    above = ("mqks.server.cluster", "mqks.server.node", "mqks.server.workers", "mqks.server.dispatch",
             "mqks.server.app")
    offending = {path: sorted(n for n in names if n.startswith(above))
                 for path, names in imported_modules("server/journal", "mqks.server.journal").items()}
    assert {path: names for path, names in offending.items() if names} == {}


def test_relative_imports_resolve_as_python_does():
    """The check above is only as good as its resolution of `from ..x import y`."""
    names = imported_modules("server/cluster", "mqks.server.cluster")["server/cluster/map.py"]
    assert "mqks.server.journal.nats_bridge" in names and "mqks.server.cluster.candidacy" in names
    assert "mqks.common.cluster_names" in imported_modules("server/cluster", "mqks.server.cluster")[
        "server/cluster/candidacy.py"]

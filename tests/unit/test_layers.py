"""The layers' imports (issue 40): the clients and the Spark source import nothing of the broker's (what both read
lives in common/), the storage below the cluster layer imports nothing above it, and no two modules of server/
import each other, however indirectly (issue 58). Read from the sources."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): what it imports is for mypy, never run."""
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name | ast.Attribute) and getattr(test, "id", getattr(test, "attr", "")) == \
        "TYPE_CHECKING"


def run_time_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` but those under an `if TYPE_CHECKING:` (its `else:` runs, so it stays)."""
    found: list[ast.AST] = []
    for child in ast.iter_child_nodes(tree):
        found.append(child)
        if type_checking(child):
            found += [node for branch in child.orelse for node in [branch, *run_time_nodes(branch)]]
        else:
            found += run_time_nodes(child)
    return found


def imported_modules(folder: str, package: str, run_time: bool = False) -> dict[str, set[str]]:
    """Every module each file of `folder` imports, relative imports resolved against `package`; with `run_time`,
    only the imports Python runs (not those under `if TYPE_CHECKING:`)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        parts = [*package.split("."), *path.relative_to(ROOT / folder).with_suffix("").parts]
        here = parts[:-1]  # the package a relative import starts from (an __init__ is its own package)
        names: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in run_time_nodes(tree) if run_time else ast.walk(tree):
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
    above = ("mqks.server.cluster", "mqks.server.edges", "mqks.server.workers", "mqks.server.dispatch",
             "mqks.server.app")
    offending = {path: sorted(n for n in names if n.startswith(above))
                 for path, names in imported_modules("server/journal", "mqks.server.journal").items()}
    assert {path: names for path, names in offending.items() if names} == {}


def test_the_nats_transport_imports_nothing_of_the_broker_above_it():
    """server/nats_io/ sits below the journal and the cluster layer: it knows NATS, not frames or groups."""
    above = ("mqks.server.journal", "mqks.server.cluster", "mqks.server.edges", "mqks.server.workers",
             "mqks.server.dispatch", "mqks.server.core", "mqks.server.app")
    offending = {path: sorted(n for n in names if n.startswith(above))
                 for path, names in imported_modules("server/nats_io", "mqks.server.nats_io").items()}
    assert {path: names for path, names in offending.items() if names} == {}


def test_relative_imports_resolve_as_python_does():
    """The check above is only as good as its resolution of `from ..x import y`."""
    names = imported_modules("server/cluster", "mqks.server.cluster")["server/cluster/map.py"]
    assert "mqks.server.nats_io.nats_bridge" in names and "mqks.server.cluster.candidacy" in names
    assert "mqks.common.cluster_names" in imported_modules("server/cluster", "mqks.server.cluster")[
        "server/cluster/candidacy.py"]


def module_name(path: str) -> str:
    """server/edges/supervisor.py -> mqks.server.edges.supervisor; a package's __init__.py is the package."""
    return ".".join(["mqks", *Path(path).with_suffix("").parts]).removesuffix(".__init__")


def server_imports() -> dict[str, set[str]]:
    """The server modules each server module imports when it runs. An import inside a function counts: it runs on
    the function's first call and ties the two modules as one at the top does; moving an import into a function is
    how a cycle is hidden from Python's import order, not how it is broken."""
    by_path = imported_modules("server", "mqks.server", run_time=True)
    modules = {module_name(path) for path in by_path}
    return {module_name(path): {name for name in names if name in modules} - {module_name(path)}
            for path, names in by_path.items()}


def cycles(imports: dict[str, set[str]]) -> set[frozenset[str]]:
    """Each set of modules that import one another, however indirectly (a strongly connected set of two or more)."""
    reach: dict[str, set[str]] = {}
    for start in imports:
        seen: set[str] = set()
        todo = list(imports[start])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo += imports.get(module, ())
        reach[start] = seen
    return {frozenset({module, *(other for other in reach[module] if module in reach[other])})
            for module in imports if module in reach[module]}


def test_no_import_cycle_in_the_server():
    """A cycle makes two modules one room that reads as two, and its import order a trap. core/state and
    core/dead_letters name each other only under TYPE_CHECKING (types for mypy), which does not count."""
    assert {tuple(sorted(cycle)) for cycle in cycles(server_imports())} == set()


def test_the_cycle_check_reads_imports_as_python_runs_them():
    """Function-level imports are seen; TYPE_CHECKING ones are not: the test above is not vacuous."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}
    imports = server_imports()
    assert "mqks.server.cluster.node_process" in imports["mqks.server.edges.supervisor"]  # inside a method
    assert "mqks.server.core.state" not in imports["mqks.server.core.dead_letters"]  # under TYPE_CHECKING
    assert "mqks.server.core.dead_letters" in imports["mqks.server.core.state"]  # `from . import dead_letters`

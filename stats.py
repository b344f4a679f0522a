#!/usr/bin/env python3
"""Print an MQKS broker's figures: `python stats.py [--host H --port P] [--watch SECONDS] [--json]`.

A thin entry: the logic lives in mqks.client.stats, shared with `mqks stats`. It reads the
figures through `_eval`, so the broker must run with `--eval`; otherwise it says how to enable it.
"""

import sys

from mqks.client.stats import main

if __name__ == "__main__":
    sys.exit(main())

"""Beside the flow: `mqksd --max-memory`, the guard that refuses publishes while the process is past it.

Refusal swaps each session's handler table (`on_change`), so the publish path itself checks
nothing. A broker that holds no message is never refusing, whatever its RSS: only messages
can drain.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from ..core.timers import Timers
from ..dispatch.process import Process

log = logging.getLogger("mqks.server")

CHECK_SECONDS = 0.01  # at 1M msg/s of 100 bytes, ~2 MB of messages come in between two checks
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident set size (Linux)."""
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * PAGE_BYTES


class MemoryGuard:
    """Every CHECK_SECONDS: past `limit` bytes resident, `process.memory_full` and `on_change(True)`;
    back under it, `on_change(False)`."""

    def __init__(self, process: Process, limit: int, timers: Timers, on_change: Callable[[bool], None]) -> None:
        self.process = process
        self.limit = limit
        self.timers = timers
        self.on_change = on_change

    def check(self) -> None:
        process = self.process
        over = resident_bytes() > self.limit and process.holds_messages()
        if over != process.memory_full:
            process.memory_full = over
            log.warning("resident memory %s --max-memory=%d: publishes are %s", "over" if over else "back under",
                        self.limit, "refused until consumers drain the queues" if over else "accepted again")
            self.on_change(over)
        self.timers.call_later(CHECK_SECONDS, self.check)

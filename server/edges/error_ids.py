"""The error ids a broker's error lines carry (`{rid} error {error_id} {reason}`), one source per process.

A client quotes the id; the broker's log has the same id beside the line that failed.
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime


class ErrorIds:
    """24-character error ids, unique over the server's life and sortable by time, as the original's.

    UTC to the microsecond, kept strictly increasing (one id per microsecond at most, and a
    clock stepped back never repeats one), then 4 random hex digits that keep ids of
    separate processes apart.
    """

    __slots__ = ("last_us",)

    def __init__(self) -> None:
        self.last_us = 0

    def __call__(self) -> str:
        now_us = max(time.time_ns() // 1000, self.last_us + 1)
        self.last_us = now_us
        seconds, micros = divmod(now_us, 1_000_000)
        stamp = datetime.fromtimestamp(seconds, UTC).strftime("%Y%m%d%H%M%S")
        return f"{stamp}{micros:06d}{os.urandom(2).hex()}"

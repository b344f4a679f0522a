"""Every timer of a process on one heap: delete-when-unused now, ack timeouts and delays later.

No gevent here: the app runs one greenlet that sleeps until `next_delay()` and calls
`run_due()`; `call_later` tells it through `on_earlier` when a new timer is due sooner
than the one it sleeps for. A cancelled timer stays on the heap, inert, until its time
comes or the heap is compacted, so cancel is O(1) and arming is O(log n).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable

log = logging.getLogger("mqks.timers")

COMPACT_MIN_CANCELLED = 1024  # below this a rebuild costs more than the inert entries


class Timers:
    """Deadlines in one heap, each run once unless cancelled first."""

    __slots__ = ("heap", "order", "cancelled", "clock", "on_earlier")

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 on_earlier: Callable[[], None] | None = None) -> None:
        self.heap: list[list] = []  # [deadline, order, fn or None once cancelled]
        self.order = itertools.count()  # ties run in the order they were armed
        self.cancelled = 0
        self.clock = clock
        self.on_earlier = on_earlier

    def call_later(self, seconds: float, fn: Callable[[], None]) -> Callable[[], None]:
        """Run `fn` after `seconds`; returns a cancel callable (harmless after it ran)."""
        entry = [self.clock() + seconds, next(self.order), fn]
        heap = self.heap
        heapq.heappush(heap, entry)
        if heap[0] is entry and self.on_earlier is not None:
            self.on_earlier()

        def cancel() -> None:
            if entry[2] is not None:
                entry[2] = None
                self.cancelled += 1
                if self.cancelled >= COMPACT_MIN_CANCELLED and self.cancelled * 2 > len(heap):
                    self._compact()

        return cancel

    def next_delay(self) -> float | None:
        """Seconds until the earliest live timer, or None when there is none."""
        heap = self.heap
        while heap and heap[0][2] is None:
            heapq.heappop(heap)
            self.cancelled -= 1
        if not heap:
            return None
        return max(0.0, heap[0][0] - self.clock())

    def run_due(self) -> int:
        """Run every timer whose deadline has passed; returns how many ran.

        One timer that raises is logged and the others still run.
        """
        heap = self.heap
        now = self.clock()
        ran = 0
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            fn = entry[2]
            if fn is None:
                self.cancelled -= 1
                continue
            entry[2] = None  # a cancel after it ran is a no-op
            ran += 1
            try:
                fn()
            except Exception:
                log.exception("timer %r failed", fn)
        return ran

    def __len__(self) -> int:
        """Live timers."""
        return len(self.heap) - self.cancelled

    def _compact(self) -> None:
        self.heap[:] = [entry for entry in self.heap if entry[2] is not None]
        heapq.heapify(self.heap)
        self.cancelled = 0

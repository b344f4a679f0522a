"""Every timer of a process on one heap (delete-when-unused, ack timeouts, requests, schedules), and delay buckets.

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


class Buckets:
    """Items due at a wall-clock millisecond, one list per millisecond, and one timer for the earliest.

    A million delayed items cost a million list slots, not a million timers: items due in the
    same millisecond share a bucket, and only the earliest bucket has a timer on the heap.
    Due times are wall-clock (Unix) milliseconds, so they mean the same after a restart.
    """

    __slots__ = ("by_ms", "keys", "fire", "schedule", "wall", "armed_ms", "cancel", "count")

    def __init__(self, schedule: Callable[[float, Callable[[], None]], Callable[[], None]] | None,
                 fire: Callable[[int, list], None], wall: Callable[[], float] = time.time) -> None:
        self.by_ms: dict[int, list] = {}
        self.keys: list[int] = []  # a heap of the due milliseconds in by_ms
        self.fire = fire  # (due_ms, items) for each bucket that comes due, earliest first
        self.schedule = schedule  # Timers.call_later; None: only fire_due() fires (unit tests)
        self.wall = wall
        self.armed_ms: int | None = None
        self.cancel: Callable[[], None] | None = None
        self.count = 0

    def add(self, due_ms: int, item: object) -> None:
        bucket = self.by_ms.get(due_ms)
        if bucket is None:
            bucket = self.by_ms[due_ms] = []
            heapq.heappush(self.keys, due_ms)
            if self.armed_ms is None or due_ms < self.armed_ms:
                self._arm(due_ms)
        bucket.append(item)
        self.count += 1

    def fire_due(self) -> int:
        """Fire every bucket due by now, earliest first; returns how many items went."""
        keys, by_ms = self.keys, self.by_ms
        now_ms = self.wall() * 1000
        fired = 0
        while keys and keys[0] <= now_ms:
            due_ms = heapq.heappop(keys)
            items = by_ms.pop(due_ms)
            self.count -= len(items)
            fired += len(items)
            self.fire(due_ms, items)
        return fired

    def items(self) -> list[tuple[int, list]]:
        """Every bucket, earliest first (for snapshots)."""
        return sorted(self.by_ms.items())

    def __len__(self) -> int:
        return self.count

    def _arm(self, due_ms: int) -> None:
        if self.schedule is None:
            return
        if self.cancel is not None:
            self.cancel()
        self.armed_ms = due_ms
        # the heap's clock is monotonic, the due time is wall-clock: a timer that wakes a little
        # early finds nothing due and arms again for what is left
        self.cancel = self.schedule(max(0.0, due_ms / 1000 - self.wall()), self._on_timer)

    def _on_timer(self) -> None:
        self.armed_ms = self.cancel = None
        self.fire_due()
        if self.keys:
            self._arm(self.keys[0])

"""The bytes owed to one client until the next flush.

A `Consumer` appends deliveries to its outbox (`deliver`); a handler appends replies through its
session (`write`); a relayed block from another worker comes in whole (`take`). Only this class
counts the bytes owed and registers an outbox for the next flush: the first append of a batch
puts it on the process's `pending` list, and `Process.flush_pending` calls each pending outbox's
`flush` once (the connection sets it to its socket write). Past `high_water_bytes` the outbox is
`paused`: no deliveries until the connection drains it and resumes its consumers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

DEFAULT_HIGH_WATER_BYTES = 4 << 20
# a reply is a fresh bytes object in a list: its header, the list slot and malloc's rounding
# cost about this much beside its length (measured: counting the length alone, a client that
# never reads grew the server by 5.6x --max-output-bytes before it was cut off)
REPLY_OVERHEAD_BYTES: Final = 56
# Final: the compiled build inlines it (a plain module global is a dict lookup by name on every use)
NEWLINE: Final = b"\n"


def _no_flush() -> None:
    """An outbox with no socket behind it (the state's unit tests) keeps what it is owed."""


class Outbox:
    """Bytes owed to one client, gathered until the next flush, and the consumers delivering into it."""

    __slots__ = ("out", "out_bytes", "paused", "flush_pending", "pending", "high_water_bytes", "consumers_by_id",
                 "flush", "line_open")

    is_link = False  # a link between worker processes (server/workers/links.py) is not a client's outbox

    def __init__(self, pending: list[Outbox], high_water_bytes: int = DEFAULT_HIGH_WATER_BYTES,
                 flush: Callable[[], None] = _no_flush) -> None:
        self.out: list[Any] = []  # bytes, or one memoryview of what a partial write left
        self.out_bytes = 0  # whole lines (consumer id, tail, newline), replies with their overhead
        self.paused = False  # over the high-water mark: no deliveries until it drains
        self.flush_pending = False
        self.pending = pending  # shared by every outbox of the process
        self.high_water_bytes = high_water_bytes
        # the consumers whose deliveries come here: a resume pumps their queues, and a
        # consumer id names one of them for ack, reject and delete_consumer
        self.consumers_by_id: dict[bytes, Any] = {}
        self.flush = flush
        # the last delivery's newline is not in `out` yet: the next piece brings it, or `pieces()` adds it
        self.line_open = False

    def deliver(self, consumer_id: bytes, continued_id: bytes, tail: bytes, size: int) -> None:
        """A delivery line, `{consumer_id}{tail}\\n`, of `size` bytes; past the high-water mark, pause.

        Two pieces, not three (a piece costs an append and a buffer in the flush's join, a fifth of a fan-out's
        CPU): the newline that ends a delivery goes out with the next delivery's id (`continued_id` is a newline
        and the id), or alone before any other piece, or in `pieces()`."""
        out = self.out
        if self.line_open:
            out.append(continued_id)
        else:
            out.append(consumer_id)
            self.line_open = True
        out.append(tail)
        self.out_bytes += size
        if self.out_bytes > self.high_water_bytes:
            self.paused = True
        if not self.flush_pending:
            self.flush_pending = True
            self.pending.append(self)

    def write(self, data: bytes) -> None:
        """A reply line (or lines), counted with the overhead of the object that holds it."""
        self.pieces().append(data)  # after an open delivery line is closed
        self.out_bytes += len(data) + REPLY_OVERHEAD_BYTES
        if not self.flush_pending:
            self.flush_pending = True
            self.pending.append(self)

    def take(self, data: bytes) -> None:
        """A block of output another worker relayed (answers, deliveries), counted as its bytes alone:
        past the high-water mark the outbox pauses, as if its own consumers had filled it."""
        self.pieces().append(data)
        self.out_bytes += len(data)
        if not self.flush_pending:
            self.flush_pending = True
            self.pending.append(self)
        if self.out_bytes > self.high_water_bytes:
            self.paused = True

    def pieces(self) -> list[Any]:
        """What is owed, every line whole: the list to join and send (whoever reads `out` takes it from here)."""
        if self.line_open:
            self.out.append(NEWLINE)
            self.line_open = False
        return self.out

    def discard(self) -> None:
        """Forget what is owed (the client is gone)."""
        self.out.clear()
        self.line_open = False

"""Step 5 of the flow, its front door: which worker owns a queue, and the flush after a batch.

A queue belongs to worker `crc32(queue) % workers` (crc32 is stable across processes,
unlike `hash()` of a str, so the placement survives restarts and, later, worker
processes). An event is routed by every worker, since any worker may hold a queue bound
to it. After a batch of lines, `flush_pending` hands every outbox that got bytes to its
flush, once. No sockets here: an outbox's flush is whatever its owner set.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

from .durable import DurableBroker, Journal
from .outbox import Outbox
from .state import Broker, Schedule


class Workers:
    """Every worker of this process, the placement of queues on them, and the outboxes owed a flush."""

    __slots__ = ("brokers", "count", "pending", "clients", "journal")

    def __init__(self, count: int = 1, schedule: Schedule | None = None, journal: Journal | None = None) -> None:
        self.count = count
        self.pending: list[Outbox] = []
        self.clients = 0  # live connections, for stats
        self.journal = journal  # None: in memory only
        if journal is None:
            self.brokers = [Broker(worker, count, schedule, self.count_clients) for worker in range(count)]
        else:
            self.brokers = [DurableBroker(worker, count, schedule, self.count_clients, journal=journal)
                            for worker in range(count)]

    def count_clients(self) -> int:
        return self.clients

    def worker_for(self, queue: bytes) -> Broker:
        """The worker that owns `queue`."""
        brokers = self.brokers
        return brokers[zlib.crc32(queue) % self.count] if self.count > 1 else brokers[0]

    def flush_pending(self) -> None:
        """Commit the batch's records (durable mode), then flush every outbox that has output."""
        journal = self.journal
        if journal is not None:
            journal.commit()
            if journal.wants_snapshot():
                journal.snapshot(self.brokers)
        pending = self.pending
        for outbox in pending:
            outbox.flush_pending = False
            outbox.flush()
        pending.clear()

    def resume(self, outbox: Outbox) -> None:
        """A paused outbox drained: hand its consumers the messages that waited."""
        for consumer in list(outbox.consumers_by_id.values()):
            self.worker_for(consumer.queue.name).pump(consumer.queue)
        self.flush_pending()

    def detach(self, outbox: Outbox, on_failure: Callable[[Any, BaseException], None]) -> None:
        """Remove every consumer delivering into `outbox` (a client left); their un-acked messages go back.

        Runs to the end whatever one consumer's removal raises: `on_failure` hears of it, and
        the consumer is still taken off its queue, so nothing keeps delivering into a dead outbox.
        """
        for consumer in list(outbox.consumers_by_id.values()):
            try:
                self.worker_for(consumer.queue.name).remove_consumer(consumer)
            except Exception as e:
                on_failure(consumer, e)
                consumers = getattr(getattr(consumer, "queue", None), "consumers", None)
                if isinstance(consumers, list) and consumer in consumers:
                    consumers.remove(consumer)
        outbox.consumers_by_id.clear()

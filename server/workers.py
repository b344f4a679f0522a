"""Step 5 of the flow, its front door: which worker owns a queue, and the flush after a batch.

A queue belongs to worker `slots.owner_of(queue, workers)` (its crc32 slot's range: stable
across processes, restarts and the log's re-sharding, see slots.py). An event is routed
by every worker, since any worker may hold a queue bound to it. After a batch of lines,
`flush_pending` hands every outbox that got bytes to its flush, once. No sockets here: an
outbox's flush is whatever its owner set.

The process's figures for `stats`, `queues` and `/metrics` are read here, from the
workers' state at the moment they are asked for: nothing is counted per message for them.
The connections add their byte and error counts to `bytes_in`, `bytes_out` and `errors`
once per read, per write and per error line.
"""

from __future__ import annotations

import heapq
import importlib.metadata
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from . import records
from .journal import Journal
from .leases import Leases
from .outbox import Outbox
from .protocol import event_of, msg_id_of
from .requests import Requests
from .routing import compile_mask
from .schedules import Schedules
from .slots import owner_of
from .state import Broker, Queue
from .timers import Buckets, Timers

if TYPE_CHECKING:
    from .recovery import Recovery

TOP_QUEUES = 10  # as many as Broker.stats() ranks per worker
# per worker these count what reached *that* worker; every worker sees every publish and the
# one process's clients, so the process's figure is any worker's, not the sum
PROCESS_WIDE = frozenset({"published", "clients"})
NOT_SUMMED = frozenset({"worker", "workers", "top_queues", "top_leased_queues", "log", "events"})


def package_version() -> str:
    """The installed `mqks` distribution's version, or "unknown" (a checkout run without pip install)."""
    try:
        return importlib.metadata.version("mqks")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


VERSION = package_version()


def queue_flags(queue: Queue) -> list[str]:
    """The queue's own flags, as `--update` lines show them (a consumer's flags are not the queue's)."""
    return [flag.decode() for flag in queue.flags()]


class Workers:
    """Every worker of this process, the placement of queues on them, and the outboxes owed a flush."""

    __slots__ = ("brokers", "publishers", "peers", "forwarder", "draining", "topology_extra", "count", "pending",
                 "clients", "journal", "timers", "delayed", "requests", "schedules", "error_line", "max_memory_bytes",
                 "max_memory_share", "memory_full", "dropped_by_memory", "started", "bytes_in", "bytes_out", "errors")

    def __init__(self, count: int = 1, timers: Timers | None = None, journal: Journal | None = None) -> None:
        self.count = count
        self.pending: list[Outbox] = []
        self.clients = 0  # live connections, for stats
        self.started = time.monotonic()
        self.bytes_in = 0  # added once per read by the connections
        self.bytes_out = 0  # added once per write by the connections
        self.errors = 0  # error lines sent
        self.journal = journal  # None: in memory only
        self.timers = timers if timers is not None else Timers()
        schedule, clock = self.timers.call_later, self.timers.clock
        self.brokers = [Broker(worker, count, schedule, self.count_clients, clock=clock) for worker in range(count)]
        if journal is not None:
            for broker in self.brokers:
                broker.record = journal.append  # every change of durable state, as a record
        # what a publish calls: these brokers, and with worker processes the Forwarder to the others
        self.publishers: list[Any] = list(self.brokers)
        self.peers: Any = None  # server/peers.py's Peers, with worker processes
        self.forwarder: Any = None
        self.draining = False
        # what `hello` says of the workers beside how many: the slot map, their direct addresses (set by the app)
        self.topology_extra: Callable[[], dict[str, Any]] = dict
        for broker in self.brokers:
            broker.broker_for = self.worker_for
            broker.leases = Leases(broker)  # fetch/settle: messages held under a lease, in the queue's worker
        # publishes with --delay/--at: routed when due, as if published then (extension)
        self.delayed = Buckets(self.timers.call_later, self._publish_due)
        # (rid, reason) -> an error line with a fresh error id; the app sets its own
        self.error_line: Callable[[bytes, str], bytes] = lambda rid, reason: b"%b error - %b\n" % (rid, reason.encode())
        self.requests = Requests(self.timers.call_later, lambda rid, reason: self.error_line(rid, reason))
        self.schedules = Schedules(self.timers.call_later, self.publish)
        self.max_memory_bytes: int | None = None  # mqksd --max-memory; the app checks it
        self.max_memory_share: int | None = None  # with N worker processes, each holds itself to 1/N of it
        self.memory_full = False  # past max_memory_bytes: publishes are refused
        self.dropped_by_memory = 0
        if journal is not None:
            self.schedules.record = journal.append

    def count_clients(self) -> int:
        return self.clients

    def link(self, peers: Any) -> None:
        """Become one worker process of several: `peers` reaches the others."""
        self.peers = peers
        self.forwarder = peers.forwarder
        assert len(self.brokers) == 1, "a worker process holds one broker"
        self.publishers = [peers.forwarder]  # it publishes into this worker's broker, then on to the others

    def topology(self) -> dict[str, Any]:
        """`hello`'s fields about the workers: how many, which one answers, the slot map, their direct addresses."""
        return {"workers": self.peers.count if self.peers is not None else self.count, **self.topology_extra()}

    def worker_for(self, queue: bytes) -> Broker:
        """The worker that owns `queue`."""
        brokers = self.brokers
        return brokers[owner_of(queue, self.count)] if self.count > 1 else brokers[0]

    def publish_later(self, due_ms: int, tail: bytes) -> None:
        """Publish `tail` (its msg id and event inside) at wall-clock millisecond `due_ms`."""
        self.delayed.add(due_ms, tail)
        if self.journal is not None:
            self.journal.append(records.delayed(due_ms, tail))

    def _publish_due(self, due_ms: int, tails: list[bytes]) -> None:
        if self.journal is not None:
            self.journal.append(records.delayed_fired(due_ms))  # with the P records below, in the same commit
        for tail in tails:
            msg_id, event = msg_id_of(tail), event_of(tail)
            for broker in self.publishers:
                broker.publish(msg_id, event, tail)

    def memory_reason(self) -> str:
        """Why a publish is refused past --max-memory."""
        share = f"; this worker's share is {self.max_memory_share} bytes" if self.max_memory_share else ""
        return (f"memory limit reached (--max-memory={self.max_memory_bytes} bytes{share}): publishes are refused "
                "until consumers drain the queues")

    def holds_messages(self) -> bool:
        """True if any queue holds a message, waiting or un-acked."""
        return any(queue.messages or any(consumer.unacked for consumer in queue.consumers)
                   for broker in self.brokers for queue in broker.queues.values())

    def publish(self, msg_id: bytes, event: bytes, tail: bytes) -> None:
        """Put a copy into every queue of every worker bound to `event`."""
        for broker in self.publishers:
            broker.publish(msg_id, event, tail)

    def restore(self, recovery: Recovery) -> None:
        """Take back what replay found above the queues: delayed publishes and schedules (overdue: at once)."""
        for due_ms, tails in sorted(recovery.delayed.items()):
            for tail in tails:
                self.delayed.add(due_ms, tail)
        self.schedules.restore(recovery.schedules.values())

    def snapshot_lines(self) -> Iterator[bytes]:
        """The state kept above the workers as records, for the journal's snapshot."""
        for due_ms, tails in self.delayed.items():
            for tail in tails:
                yield records.delayed(due_ms, tail)
        yield from self.schedules.snapshot_lines()

    def flush_pending(self) -> None:
        """Commit the batch's records (durable mode), then flush every outbox that has output."""
        journal = self.journal
        if journal is not None:
            journal.commit()
            if journal.wants_snapshot():
                journal.snapshot(self.brokers, self.snapshot_lines())
        pending = self.pending
        peers = self.peers
        if peers is not None and (peers.acked_epoch != peers.epoch or peers.holds):
            # bindings changed here and some worker has not applied them yet: no client may see
            # anything from now on (an answer, a delivery, an --update) until every worker has,
            # or a client told of it could publish through a worker that does not know the binding
            kept = []
            for outbox in pending:
                if outbox.is_link:
                    outbox.flush_pending = False
                    outbox.flush()
                else:
                    kept.append(outbox)
            pending[:] = kept
            return
        for outbox in pending:
            outbox.flush_pending = False
            outbox.flush()
        pending.clear()

    def resume(self, outbox: Outbox) -> None:
        """A paused outbox drained: hand its consumers the messages that waited."""
        for consumer in list(outbox.consumers_by_id.values()):
            if not consumer.relayed:  # a relayed one's owner hears of the resume from the connection
                self.worker_for(consumer.queue.name).pump(consumer.queue)
        self.flush_pending()

    def detach(self, outbox: Outbox, on_failure: Callable[[Any, BaseException], None]) -> None:
        """Remove every consumer delivering into `outbox` (a client left); their un-acked messages go back.

        Runs to the end whatever one consumer's removal raises: `on_failure` hears of it, and
        the consumer is still taken off its queue, so nothing keeps delivering into a dead outbox.
        """
        for consumer in list(outbox.consumers_by_id.values()):
            if consumer.relayed:
                continue  # its owner drops it when the connection's session there ends
            try:
                self.worker_for(consumer.queue.name).remove_consumer(consumer)
            except Exception as e:
                on_failure(consumer, e)
                consumers = getattr(getattr(consumer, "queue", None), "consumers", None)
                if isinstance(consumers, list) and consumer in consumers:
                    consumers.remove(consumer)
        outbox.consumers_by_id.clear()
        self.requests.forget(outbox)

    def stats(self, worker: int | None = None) -> dict[str, Any]:
        """The `stats` answer: one worker's figures, or all workers' summed, with the process's own.

        `worker` must be in range (the caller checks it). Summed: counts and sizes; `published`
        and `clients` are the process's (see PROCESS_WIDE); `events` counts each event or mask
        once however many workers' queues bind it; `top_queues` is re-ranked over every worker.
        """
        figures: dict[str, Any] = {"version": VERSION, "uptime_seconds": round(time.monotonic() - self.started, 3),
                                   "workers": self.count}
        if worker is not None:
            figures["worker"] = worker
            figures.update((key, value) for key, value in self.brokers[worker].stats().items()
                           if key not in ("worker", "workers", "log"))
        else:
            per_worker = [broker.stats() for broker in self.brokers]
            for key, value in per_worker[0].items():
                if key in NOT_SUMMED:
                    continue
                if key in PROCESS_WIDE or isinstance(value, bool) or not isinstance(value, int | float):
                    figures[key] = value
                else:
                    figures[key] = sum(one[key] for one in per_worker)
            if self.count == 1:
                figures["events"] = per_worker[0]["events"]
            else:
                events: set[bytes] = set()
                for broker in self.brokers:
                    for queue in broker.queues.values():
                        events.update(queue.events)
                figures["events"] = len(events)
            ranked = heapq.nlargest(TOP_QUEUES, ((depth, name) for one in per_worker
                                                 for name, depth in one["top_queues"]))
            figures["top_queues"] = [(name, depth) for depth, name in ranked]
        for key in ("leases", "messages_leased"):
            figures[key] = sum(broker.leases.stats()[key] for broker in
                               (self.brokers if worker is None else [self.brokers[worker]]))
        leased = heapq.nlargest(TOP_QUEUES, ((count, name) for name, count in self.leased_by_queue().items()))
        figures["top_leased_queues"] = [(name.decode(errors="replace"), count) for count, name in leased]
        figures["connections"] = self.clients
        figures["bytes_in"] = self.bytes_in
        figures["bytes_out"] = self.bytes_out
        figures["errors"] = self.errors
        figures["delayed"] = len(self.delayed)
        figures["dropped"] = figures.get("dropped", 0) + self.dropped_by_memory
        figures["memory_full"] = self.memory_full
        figures.update(self.requests.stats())
        figures.update(self.schedules.stats())
        if self.journal is not None:
            figures["log"] = self.journal.stats()
        if self.peers is not None:
            figures["workers"] = self.peers.count
            figures["worker"] = self.peers.worker
            figures["pid"] = os.getpid()
            figures.update(self.peers.stats())
        return figures

    def queue_rows(self, mask: bytes | None = None) -> list[dict[str, Any]]:
        """Every queue of every worker whose name matches `mask` (the events' mask rule), sorted by name."""
        if mask is None:
            matches: Callable[[bytes], Any] = lambda name: True
        elif b"*" in mask:
            matches = compile_mask(mask).fullmatch
        else:
            matches = mask.__eq__
        found = sorted(((name, queue) for broker in self.brokers for name, queue in broker.queues.items()
                        if matches(name)), key=lambda row: row[0])
        leased = self.leased_by_queue()
        return [{"queue": name.decode(errors="replace"), "depth": queue.depth(),
                 "unacked": sum(len(consumer.unacked) for consumer in queue.consumers),
                 "leased": leased.get(name, 0),
                 "consumers": len(queue.consumers), "bindings": len(queue.events), "flags": queue_flags(queue)}
                for name, queue in found]

    def leased_by_queue(self) -> dict[bytes, int]:
        """Messages held under `fetch --lease`, by queue: out of the queue, like un-acked ones."""
        counts: dict[bytes, int] = {}
        for broker in self.brokers:
            if broker.leases is not None:
                for name, held in broker.leases.held_by_queue().items():
                    counts[name] = counts.get(name, 0) + len(held)
        return counts

    def deepest_queues(self, limit: int) -> list[tuple[str, int, int, int]]:
        """The `limit` deepest queues of every worker as (name, depth, unacked, leased), deepest first."""
        deepest = heapq.nlargest(limit, ((queue.depth(), name, queue) for broker in self.brokers
                                         for name, queue in broker.queues.items()), key=lambda row: row[:2])
        leased = self.leased_by_queue()
        return [(name.decode(errors="replace"), depth, sum(len(consumer.unacked) for consumer in queue.consumers),
                 leased.get(name, 0)) for depth, name, queue in deepest]

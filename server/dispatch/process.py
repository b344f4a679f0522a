"""The one broker of this process, and what the process keeps beside it.

A process runs exactly one broker: worker `worker` of `worker_count`, owning the queues of its
slot range (slots.py; stable across processes, restarts and the log's re-sharding). With worker
processes, the relay (workers/relay.py) runs each line where its queue lives, so a handler here always
works on `Process.broker`. After a batch of lines, `flush_pending` commits the journal and hands
every outbox that got bytes to its flush, once. No sockets here: an outbox's flush is whatever
its owner set.

The process's figures for `stats`, `queues` and `/metrics` are read here, from the broker at
the moment they are asked for: nothing is counted per message for them. The connections add
their byte and error counts to `bytes_in`, `bytes_out` and `errors` once per read, per write
and per error line.
"""

from __future__ import annotations

import heapq
import importlib.metadata
import os
import time
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from ...common.figures import ranked
from ..core.leases import Leases
from ..core.messages import Message as StoredMessage
from ..core.messages import Packed, unpack
from ..core.requests import Requests
from ..core.routing import compile_mask
from ..core.schedules import Schedules
from ..core.snapshot import snapshot_lines
from ..core.state import Broker, Queue
from ..core.timers import Buckets, Timers
from ..journal import records
from ..journal.journal import Journal
from ..wire.outbox import Outbox
from ..wire.protocol import event_of, format_ok, msg_id_of, text

if TYPE_CHECKING:
    from ..journal.recovery import Recovery


class Answerable(Protocol):
    """Where a confirmed publish's answer goes: a client's outbox, a fan-in, a link's confirms."""

    def write(self, data: bytes) -> None: ...


class Peering(Protocol):
    """What this process asks of the other workers when it is one of several (server/workers/peers.py's Peers)."""

    unlinked: int  # other workers with no link from here
    unit: str  # "worker", or "group" on a cluster's node

    def routing_unknown(self) -> bool: ...

    def holds_output(self) -> bool: ...

    def unlinked_reason(self) -> str: ...

    def answers_owed_to(self, outbox: Outbox) -> bool: ...

    def stats(self) -> dict[str, Any]: ...

    def cluster_stats(self, workers: Collection[int] | None = None) -> dict[str, Any]: ...

    def cluster_deepest_queues(self, limit: int, workers: Collection[int] | None = None
                               ) -> list[tuple[str, int, int, int]]: ...


class Forwarding(Protocol):
    """A confirmed publish that other workers' queues share (server/workers/forwarding.py's Forwarder)."""

    def routes_elsewhere(self, event: bytes) -> bool: ...

    def publish_confirmed(self, session: Any, rid: bytes, event: bytes, tail: bytes) -> None: ...

    def publish_quiet(self, session: Any, rid: bytes, event: bytes, tail: bytes) -> None: ...


def full_queues_reason(full: list[Queue]) -> str:
    """Why a confirmed publish is answered with an error when some bound queue was at its --max-length."""
    names = ", ".join(f"queue {text(queue.name)} is full (--max-length={queue.max_length})" for queue in full)
    return f"{names}: the message was not put there (every other bound queue has it)"


def package_version() -> str:
    """The installed `mqks` distribution's version, or "unknown" (a checkout run without pip install)."""
    try:
        return importlib.metadata.version("mqks")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


VERSION = package_version()


NEWEST_SHOWN = 10  # messages `queues --detail` lists per queue
PEEK_DATA_BYTES = 200  # of each one's data: enough to recognise it, never a whole large message


def queue_detail(queue: Queue) -> dict[str, Any]:
    """The bindings, consumers and newest messages of `queue`, as `queues --detail` adds them to its row."""
    return {"events": sorted(event.decode(errors="replace") for event in queue.events),
            "consumer_list": [{"consumer": consumer.consumer_id.decode(errors="replace"),
                               "manual_ack": consumer.manual_ack, "prefetch": consumer.prefetch,
                               "unacked": len(consumer.unacked),
                               "ack_timeout": getattr(consumer, "ack_timeout_seconds", None)}
                              for consumer in queue.consumers],
            "newest": [peek(tail, retry) for tail, retry in newest_messages(queue, NEWEST_SHOWN)]}


def peek(tail: bytes, retry: int) -> dict[str, Any]:
    """A waiting message as an operator looks at it: msg id, event, retry and the start of its data."""
    msg_id_end = tail.index(b" ", 4)
    header_end = tail.find(b" ", msg_id_end + 1)
    header = tail[msg_id_end + 7 : header_end if header_end >= 0 else len(tail)]  # after " event="
    data = tail[header_end + 1 :] if header_end >= 0 else b""
    return {"msg_id": tail[4:msg_id_end].decode(errors="replace"),
            "event": header.partition(b",reply=")[0].decode(errors="replace"), "retry": retry,
            "data": data[:PEEK_DATA_BYTES].decode(errors="replace") + ("…" if len(data) > PEEK_DATA_BYTES else "")}


def newest_messages(queue: Queue, count: int) -> list[tuple[bytes, int]]:
    """The tail and retry of the `count` newest messages waiting in `queue`, newest first (no copy of the queue)."""
    found: list[tuple[bytes, int]] = []
    for item in reversed(queue.items()):
        if type(item) is StoredMessage:
            runs = [(item.tail, item.retry)]
        elif type(item) is Packed:
            runs = [(tail, 0) for tail in reversed(unpack(item)[-count:])]
        else:
            runs = [(item, 0)]
        for tail, retry in runs:
            found.append((tail, retry))
            if len(found) == count:
                return found
    return found


def queue_flags(queue: Queue) -> list[str]:
    """The queue's own flags, as `--update` lines show them (a consumer's flags are not the queue's)."""
    return [flag.decode() for flag in queue.flags()]


class Process:
    """This process's broker and its place among the workers (worker i of n: its slot range), its peers, timers
    and journal, what it keeps above the broker (delayed publishes, requests, schedules), and the outboxes owed
    a flush."""

    __slots__ = ("worker", "worker_count", "broker", "publisher", "peers", "forwarder", "draining", "topology_extra",
                 "pending", "clients", "journal", "timers", "delayed", "requests", "schedules", "error_line",
                 "max_memory_bytes", "max_memory_share", "memory_full", "dropped_by_memory", "started", "bytes_in",
                 "bytes_out", "errors", "refused_by_scope")

    def __init__(self, timers: Timers | None = None, journal: Journal | None = None, worker: int = 0,
                 worker_count: int = 1) -> None:
        self.worker = worker  # the one owner of "which worker am I, of how many"
        self.worker_count = worker_count
        self.pending: list[Outbox] = []
        self.clients = 0  # live connections, for stats
        self.started = time.monotonic()
        self.bytes_in = 0  # added once per read by the connections
        self.bytes_out = 0  # added once per write by the connections
        self.errors = 0  # error lines sent
        self.refused_by_scope = 0  # lines a token's scope refused (dispatch/scopes.py)
        self.journal = journal  # None: in memory only
        self.timers = timers if timers is not None else Timers()
        self.broker = Broker(self.timers.call_later, self.count_clients, clock=self.timers.clock)
        if journal is not None:
            self.broker.record = journal.append  # every change of durable state, as a record
        self.broker.leases = Leases(self.broker)  # fetch/settle: messages held under a lease
        # what a publish calls: the broker, or with worker processes the Forwarder, which also sends to the others
        self.publisher: Any = self.broker
        self.peers: Peering | None = None  # with worker processes
        self.forwarder: Forwarding | None = None
        self.draining = False
        # what `hello` says of the workers beside how many: the slot map, their direct addresses (set by the app)
        self.topology_extra: Callable[[], dict[str, Any]] = dict
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

    def link(self, peers: Any) -> None:  # workers/peers.py's Peers: the layer above, so not named here
        """Become one worker process of several: `peers` reaches the others."""
        self.peers = peers
        self.forwarder = peers.forwarder
        self.publisher = peers.forwarder  # it publishes into this worker's broker, then on to the others

    def topology(self) -> dict[str, Any]:
        """`hello`'s fields about the workers: how many, which one answers, the slot map, their direct addresses."""
        return {"workers": self.worker_count, **self.topology_extra()}

    def publish_later(self, due_ms: int, tail: bytes) -> None:
        """Publish `tail` (its msg id and event inside) at wall-clock millisecond `due_ms`."""
        self.delayed.add(due_ms, tail)
        if self.journal is not None:
            self.journal.append(records.delayed(due_ms, tail))

    def _publish_due(self, due_ms: int, tails: list[bytes]) -> None:
        if self.journal is not None:
            self.journal.append(records.delayed_fired(due_ms))  # with the P records below, in the same commit
        for tail in tails:
            self.publisher.publish(msg_id_of(tail), event_of(tail), tail)

    def memory_reason(self) -> str:
        """Why a publish is refused past --max-memory."""
        share = f"; this worker's share is {self.max_memory_share} bytes" if self.max_memory_share else ""
        return (f"memory limit reached (--max-memory={self.max_memory_bytes} bytes{share}): publishes are refused "
                "until consumers drain the queues")

    def holds_messages(self) -> bool:
        """True if any queue holds a message, waiting or un-acked."""
        return any(queue.messages or any(consumer.unacked for consumer in queue.consumers)
                   for queue in self.broker.queues.values())

    def publish(self, msg_id: bytes, event: bytes, tail: bytes) -> None:
        """Put a copy into every queue of every worker bound to `event`."""
        self.publisher.publish(msg_id, event, tail)

    def publish_confirmed_here(self, publisher: Any, target: Answerable, rid: bytes, msg_id: bytes, event: bytes,
                               tail: bytes, answer_now: Answerable | None = None) -> str | None:
        """The one confirmed publish into this worker's queues (a client's, a forwarded part, a fan-in's local part).

        None once published: `rid ok` goes to `target` once the log has it, or at once in memory (to `answer_now` if
        given: a client's connection, which bounds its own output). Else why it must be answered with an error: the
        log takes no writes (nothing was published), or a bound queue is at its --max-length (every other bound
        queue has it)."""
        journal = self.journal
        if journal is not None and journal.blocked:
            return journal.refusal()
        full = publisher.full_queues(event)
        publisher.publish(msg_id, event, tail)
        if full:
            return full_queues_reason(full)
        if journal is None:
            (target if answer_now is None else answer_now).write(format_ok(rid))
        else:
            journal.confirm_later(target, rid)
        return None

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

    def snapshot(self) -> None:
        """Rewrite the live state into the journal, so the log before it can go."""
        assert self.journal is not None
        self.journal.snapshot(snapshot_lines([self.broker], self.snapshot_lines()))

    def flush_pending(self) -> None:
        """Commit the batch's records (durable mode), then flush every outbox that has output."""
        journal = self.journal
        if journal is not None:
            journal.commit()
            if journal.wants_snapshot():
                self.snapshot()
        pending = self.pending
        peers = self.peers
        if peers is not None and peers.holds_output():
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
                self.broker.pump(consumer.queue)
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
                self.broker.remove_consumer(consumer)
            except Exception as e:
                on_failure(consumer, e)
                consumers = getattr(getattr(consumer, "queue", None), "consumers", None)
                if isinstance(consumers, list) and consumer in consumers:
                    consumers.remove(consumer)
        outbox.consumers_by_id.clear()
        self.requests.forget(outbox)

    def stats(self) -> dict[str, Any]:
        """The `stats` answer of this process: its broker's figures and its own (figures.py names each key)."""
        broker = self.broker
        figures: dict[str, Any] = {"version": VERSION, "uptime_seconds": round(time.monotonic() - self.started, 3),
                                   "workers": self.worker_count}
        if self.peers is not None:
            figures["worker"] = self.worker
        figures.update(broker.stats())
        figures.update(broker.leases.stats())
        figures["top_leased_queues"] = ranked((name.decode(errors="replace"), count)
                                              for name, count in self.leased_by_queue().items())
        figures["connections"] = self.clients
        figures["bytes_in"] = self.bytes_in
        figures["bytes_out"] = self.bytes_out
        figures["errors"] = self.errors
        figures["refused_by_scope"] = self.refused_by_scope
        figures["delayed"] = len(self.delayed)
        figures["dropped"] += self.dropped_by_memory
        figures["memory_full"] = self.memory_full
        figures.update(self.requests.stats())
        figures.update(self.schedules.stats())
        if self.journal is not None:
            figures["log"] = self.journal.stats()
        if self.peers is not None:
            figures["pid"] = os.getpid()
            figures.update(self.peers.stats())
        return figures

    def queue_rows(self, mask: bytes | None = None, detail: bool = False) -> list[dict[str, Any]]:
        """Every queue of this worker whose name matches `mask` (the events' mask rule), sorted by name.

        With `detail` (`queues --detail`), each row also lists its bindings (`events`), its consumers
        (`consumer_list`: id, manual_ack, prefetch, unacked, ack_timeout) and its newest messages (`newest`: msg id
        and retry, newest first, at most NEWEST_SHOWN): for a person looking at one queue, not for the flow.
        """
        if mask is None:
            matches: Callable[[bytes], Any] = lambda name: True
        elif b"*" in mask:
            matches = compile_mask(mask).fullmatch
        else:
            matches = mask.__eq__
        found = sorted(((name, queue) for name, queue in self.broker.queues.items() if matches(name)),
                       key=lambda row: row[0])
        leased = self.leased_by_queue()
        rows = [{"queue": name.decode(errors="replace"), "depth": queue.depth(),
                 "unacked": sum(len(consumer.unacked) for consumer in queue.consumers),
                 "leased": leased.get(name, 0),
                 "consumers": len(queue.consumers), "bindings": len(queue.events), "flags": queue_flags(queue)}
                for name, queue in found]
        if detail:
            for row, (_, queue) in zip(rows, found, strict=True):
                row.update(queue_detail(queue))
        return rows

    def leased_by_queue(self) -> dict[bytes, int]:
        """Messages held under `fetch --lease`, by queue: out of the queue, like un-acked ones."""
        return self.broker.leases.count_by_queue()

    def deepest_queues(self, limit: int) -> list[tuple[str, int, int, int]]:
        """The `limit` deepest queues of every worker as (name, depth, unacked, leased), deepest first."""
        deepest = heapq.nlargest(limit, ((queue.depth(), name, queue) for name, queue in self.broker.queues.items()),
                                 key=lambda row: row[:2])
        leased = self.leased_by_queue()
        return [(name.decode(errors="replace"), depth, sum(len(consumer.unacked) for consumer in queue.consumers),
                 leased.get(name, 0)) for depth, name, queue in deepest]

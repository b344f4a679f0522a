"""Step 5 of the flow: the broker core of one shard. No sockets, no gevent.

A message is stored and delivered as its *tail*, the bytes between the consumer id and
the newline: `b" ok {msg_id} event={event}[,retry={n}] {data}"`. The tail is built once
per publish and shared by every queue that gets a copy; a delivery only adds the
consumer id before it and a newline after. A deep queue packs runs of tails into one
`Packed` bytes object (tails never hold a newline), which saves the ~45 bytes of object
and deque overhead each message would cost on its own. Deliveries are appended to the consumer's `Outbox`; the connection layer
flushes every outbox in `Outbox.pending` once per batch.

Ordering: a queue hands out messages in the order they were put; a rejected or
requeued message goes back to the front, with its retry counter raised.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from .routing import Routing, compile_mask

Schedule = Callable[[float, Callable[[], None]], Callable[[], None]]  # (seconds, fn) -> cancel
DEFAULT_HIGH_WATER_BYTES = 4 << 20
# tails per Packed run: ~128 KiB of 100-byte messages, past glibc's mmap threshold, so a run
# gets pages of its own instead of pinning holes in the heap (measured, 1M queued messages:
# 256-tail runs gave 134 or 183 bytes/msg from run to run, 1024-tail runs 128 every time)
PACK_TAILS = 1024
PACK_MIN_DEPTH = 4096  # shallower queues are left alone: they drain soon anyway
NEWLINE = b"\n"


class Packed(bytes):
    """Tails joined by newlines: one queue item standing for several messages."""

    __slots__ = ()


class Outbox:
    """Bytes owed to one client, gathered until the next flush."""

    __slots__ = ("out", "out_bytes", "paused", "flush_pending", "pending", "high_water_bytes", "consumers_by_id")

    def __init__(self, pending: list, high_water_bytes: int = DEFAULT_HIGH_WATER_BYTES) -> None:
        self.out: list[bytes] = []
        self.out_bytes = 0
        self.paused = False  # over the high-water mark: no deliveries until it drains
        self.flush_pending = False
        self.pending = pending  # shared by every outbox of the process
        self.high_water_bytes = high_water_bytes
        self.consumers_by_id: dict[bytes, Consumer] = {}

    def write(self, data: bytes) -> None:
        self.out.append(data)
        self.out_bytes += len(data)
        if not self.flush_pending:
            self.flush_pending = True
            self.pending.append(self)


class Consumer:
    """One `consume` of one connection: a queue, flags, and its un-acked messages."""

    __slots__ = ("consumer_id", "queue", "outbox", "manual_ack", "prefetch", "unacked", "duplicates",
                 "delete_when_unused_seconds")

    def __init__(self, consumer_id: bytes, queue: Queue, outbox: Outbox, manual_ack: bool = False,
                 prefetch: int = 0, delete_when_unused_seconds: float | None = None) -> None:
        self.consumer_id = consumer_id
        self.queue = queue
        self.outbox = outbox
        self.manual_ack = manual_ack
        self.prefetch = prefetch  # 0: no limit
        # msg_id -> tail, in delivery order; a duplicate msg_id is kept under (msg_id, n)
        self.unacked: dict[Any, bytes] = {}
        self.duplicates = 0
        self.delete_when_unused_seconds = delete_when_unused_seconds

    def ready(self) -> bool:
        return not self.outbox.paused and (not self.prefetch or len(self.unacked) < self.prefetch)

    def deliver(self, tail: bytes, msg_id: bytes) -> None:
        outbox = self.outbox
        out = outbox.out
        out.append(self.consumer_id)
        out.append(tail)
        out.append(NEWLINE)
        outbox.out_bytes += len(tail)
        if outbox.out_bytes > outbox.high_water_bytes:
            outbox.paused = True
        if not outbox.flush_pending:
            outbox.flush_pending = True
            outbox.pending.append(outbox)
        if self.manual_ack:
            unacked = self.unacked
            if msg_id in unacked:
                self.duplicates += 1
                unacked[(msg_id, self.duplicates)] = tail
            else:
                unacked[msg_id] = tail

    def take_unacked(self, msg_id: bytes) -> bytes | None:
        """Remove and return one un-acked message by id, or None."""
        tail = self.unacked.pop(msg_id, None)
        if tail is not None and self.duplicates:
            # promote the oldest duplicate so the next ack of this id finds it
            for key in self.unacked:
                if type(key) is tuple and key[0] == msg_id:
                    self.unacked[msg_id] = self.unacked.pop(key)
                    break
        return tail

    def flags(self) -> list[bytes]:
        """The consume flags, as `--update` lines repeat them."""
        flags = []
        if self.delete_when_unused_seconds is not None:
            seconds = self.delete_when_unused_seconds
            flags.append(b"--delete-queue-when-unused=%r" % seconds if seconds else b"--delete-queue-when-unused")
        if self.manual_ack:
            flags.append(b"--manual-ack")
        if self.prefetch:
            flags.append(b"--prefetch=%d" % self.prefetch)
        return flags


def update_line(consumer: Consumer) -> bytes:
    """`{consumer_id} ok --update {queue} {events...} [flags]`: all a client needs to replay it."""
    queue = consumer.queue
    return b" ".join([consumer.consumer_id, b"ok --update", queue.name, *queue.events, *consumer.flags()]) + NEWLINE


def msg_id_of(tail: bytes) -> bytes:
    return tail[4 : tail.index(b" ", 4)]


def with_retry_raised(tail: bytes) -> bytes:
    """The same message with `retry=n+1` in its header."""
    id_end = tail.index(b" ", 4)
    header_end = tail.index(b" ", id_end + 1)
    event_part, found, retry = tail[id_end + 1 : header_end].rpartition(b",retry=")
    if not found:
        event_part, retry = tail[id_end + 1 : header_end], b"0"
    return b"%b%b,retry=%d%b" % (tail[: id_end + 1], event_part, int(retry) + 1, tail[header_end:])


class Queue:
    """Messages waiting for consumers, the consumers competing for them, and the queue's events."""

    __slots__ = ("name", "messages", "packed_extra", "appended_since_pack", "consumers", "next_consumer", "events",
                 "delete_when_unused_seconds", "cancel_delete")

    def __init__(self, name: bytes) -> None:
        self.name = name
        self.messages: deque[bytes] = deque()  # tails, and Packed runs of tails
        self.packed_extra = 0  # messages inside Packed items beyond one per item
        self.appended_since_pack = 0
        self.consumers: list[Consumer] = []
        self.next_consumer = 0  # round-robin position
        self.events: dict[bytes, None] = {}  # an ordered set: `--update` lists them in bind order
        self.delete_when_unused_seconds: float | None = None
        self.cancel_delete: Callable[[], None] | None = None

    def ready_consumer(self) -> Consumer | None:
        """The next consumer in round-robin order that may take a message now."""
        consumers = self.consumers
        count = len(consumers)
        if count == 1:
            consumer = consumers[0]
            return consumer if consumer.ready() else None
        for _ in range(count):
            self.next_consumer = (self.next_consumer + 1) % count
            consumer = consumers[self.next_consumer]
            if consumer.ready():
                return consumer
        return None

    def put(self, tail: bytes, msg_id: bytes) -> bool:
        """Deliver now if a consumer is ready and nothing waits ahead; else keep. True if delivered."""
        if not self.messages:
            consumers = self.consumers
            if len(consumers) == 1:
                # the common case, inlined: a call less per message is measurable here
                consumer = consumers[0]
                if not consumer.outbox.paused and (not consumer.prefetch or len(consumer.unacked) < consumer.prefetch):
                    consumer.deliver(tail, msg_id)
                    return True
            elif consumers:
                consumer = self.ready_consumer()
                if consumer is not None:
                    consumer.deliver(tail, msg_id)
                    return True
        messages = self.messages
        messages.append(tail)
        self.appended_since_pack += 1
        if self.appended_since_pack >= PACK_TAILS and len(messages) >= PACK_MIN_DEPTH:
            self._pack_newest()
        return False

    def _pack_newest(self) -> None:
        # the newest PACK_TAILS items were all appended since the last pack, at the back,
        # and a deep queue is popped only at the front: they are plain tails
        messages = self.messages
        run = [messages.pop() for _ in range(PACK_TAILS)]
        run.reverse()
        messages.append(Packed(NEWLINE.join(run)))
        self.packed_extra += PACK_TAILS - 1
        self.appended_since_pack = 0

    def _unpack_front(self) -> None:
        tails = self.messages.popleft().split(NEWLINE)
        self.packed_extra -= len(tails) - 1
        self.messages.extendleft(reversed(tails))

    def depth(self) -> int:
        """Messages waiting in the queue."""
        return len(self.messages) + self.packed_extra

    def pump(self) -> int:
        """Hand waiting messages to ready consumers; returns how many were delivered."""
        messages = self.messages
        delivered = 0
        if len(self.consumers) == 1:
            # one consumer: no round-robin, and the message id is parsed only if it will be acked
            consumer = self.consumers[0]
            outbox, prefetch, unacked = consumer.outbox, consumer.prefetch, consumer.unacked
            manual_ack = consumer.manual_ack
            while messages and not outbox.paused and (not prefetch or len(unacked) < prefetch):
                if type(messages[0]) is Packed:
                    self._unpack_front()
                tail = messages.popleft()
                consumer.deliver(tail, msg_id_of(tail) if manual_ack else b"")
                delivered += 1
            return delivered
        while messages:
            consumer = self.ready_consumer()
            if consumer is None:
                break
            if type(messages[0]) is Packed:
                self._unpack_front()
            tail = messages.popleft()
            consumer.deliver(tail, msg_id_of(tail))
            delivered += 1
        return delivered

    def requeue(self, tails: Iterable[bytes]) -> None:
        """Put messages back at the front, in their original order, with retry raised."""
        self.messages.extendleft(reversed([with_retry_raised(tail) for tail in tails]))


class Broker:
    """The queues, bindings and consumers of one shard, and its counters."""

    def __init__(self, worker: int = 0, workers: int = 1, schedule: Schedule | None = None,
                 connections: Any = (), cache_routes: bool = True) -> None:
        self.worker = worker
        self.workers = workers
        self.schedule = schedule
        self.connections = connections  # the process's live connections, for stats only
        self.queues: dict[bytes, Queue] = {}
        self.routing = Routing(cache_enabled=cache_routes)
        self.route_cache = self.routing.cache
        self.published = 0
        self.queued = 0
        self.consumed = 0
        self.acked = 0
        self.rejected = 0

    def publish(self, msg_id: bytes, event: bytes, tail: bytes) -> None:
        """Put a copy of the message into every queue bound to `event`."""
        self.published += 1
        queues = self.route_cache.get(event)
        if queues is None:
            queues = self.routing.route(event)
        for queue in queues:
            if queue.put(tail, msg_id):
                self.consumed += 1
        self.queued += len(queues)

    def queue(self, name: bytes) -> Queue:
        """The queue called `name`, created if missing."""
        queue = self.queues.get(name)
        if queue is None:
            queue = self.queues[name] = Queue(name)
        return queue

    def rebind(self, queue: Queue, replace: list[bytes] | None = None, add: Iterable[bytes] = (),
               remove: Iterable[bytes] = (), remove_masks: Iterable[bytes] = ()) -> bool:
        """Change a queue's events; True if they changed (its consumers then get `--update`)."""
        before = list(queue.events)
        wanted = dict(queue.events) if replace is None else dict.fromkeys(replace)
        for event in remove:
            wanted.pop(event, None)
        for mask in remove_masks:
            pattern = compile_mask(mask)
            for event in list(wanted):
                if event == mask or pattern.fullmatch(event):
                    del wanted[event]
        wanted.update(dict.fromkeys(add))
        if list(wanted) == before:
            return False
        for event in before:
            if event not in wanted:
                self.routing.unbind(queue, event)
        for event in wanted:
            if event not in queue.events:
                self.routing.bind(queue, event)
        queue.events = wanted
        return True

    def updates(self, queue: Queue) -> None:
        """Tell every consumer of `queue` its current events and flags (`--update`)."""
        for consumer in queue.consumers:
            consumer.outbox.write(update_line(consumer))

    def add_consumer(self, consumer: Consumer) -> None:
        queue = consumer.queue
        if queue.cancel_delete is not None:
            queue.cancel_delete()
            queue.cancel_delete = None
        queue.delete_when_unused_seconds = consumer.delete_when_unused_seconds
        queue.consumers.append(consumer)
        consumer.outbox.consumers_by_id[consumer.consumer_id] = consumer

    def pump(self, queue: Queue) -> None:
        self.consumed += queue.pump()

    def remove_consumer(self, consumer: Consumer) -> None:
        """Stop a consumer: its un-acked messages go back to the queue with retry+1."""
        consumer.outbox.consumers_by_id.pop(consumer.consumer_id, None)
        queue = consumer.queue
        if consumer in queue.consumers:
            queue.consumers.remove(consumer)
        if consumer.unacked:
            self.rejected += len(consumer.unacked)
            queue.requeue(consumer.unacked.values())
            consumer.unacked.clear()
        if self.queues.get(queue.name) is not queue:
            return  # the queue was deleted under it
        if queue.consumers:
            self.pump(queue)
        elif queue.delete_when_unused_seconds is not None:
            self._delete_when_unused(queue)

    def _delete_when_unused(self, queue: Queue) -> None:
        seconds = queue.delete_when_unused_seconds
        if not seconds or self.schedule is None:
            self.delete_queue(queue.name)
            return

        def delete_if_still_unused() -> None:
            queue.cancel_delete = None
            if not queue.consumers and self.queues.get(queue.name) is queue:
                self.delete_queue(queue.name)

        queue.cancel_delete = self.schedule(seconds, delete_if_still_unused)

    def ack(self, consumer: Consumer, msg_ids: list[bytes]) -> list[bytes]:
        """Forget acked messages; returns the ids that were not in flight."""
        unknown = []
        if consumer.duplicates:
            for msg_id in msg_ids:
                if consumer.take_unacked(msg_id) is None:
                    unknown.append(msg_id)
        else:
            pop = consumer.unacked.pop
            for msg_id in msg_ids:
                if pop(msg_id, None) is None:
                    unknown.append(msg_id)
        self.acked += len(msg_ids) - len(unknown)
        if consumer.prefetch:
            self.pump(consumer.queue)
        return unknown

    def ack_all(self, consumer: Consumer) -> None:
        self.acked += len(consumer.unacked)
        consumer.unacked.clear()
        self.pump(consumer.queue)

    def reject(self, consumer: Consumer, msg_ids: list[bytes]) -> list[bytes]:
        """Return messages to the front of the queue with retry+1; returns the unknown ids."""
        unknown, tails = [], []
        for msg_id in msg_ids:
            tail = consumer.take_unacked(msg_id)
            if tail is None:
                unknown.append(msg_id)
            else:
                tails.append(tail)
        self._requeue(consumer, tails)
        return unknown

    def reject_all(self, consumer: Consumer) -> None:
        tails = list(consumer.unacked.values())
        consumer.unacked.clear()
        self._requeue(consumer, tails)

    def _requeue(self, consumer: Consumer, tails: list[bytes]) -> None:
        self.rejected += len(tails)
        if tails and self.queues.get(consumer.queue.name) is consumer.queue:
            consumer.queue.requeue(tails)
            self.pump(consumer.queue)

    def delete_queue(self, name: bytes) -> bool:
        """Drop a queue with its bindings, messages and consumers; False if there was none."""
        queue = self.queues.pop(name, None)
        if queue is None:
            return False
        for event in queue.events:
            self.routing.unbind(queue, event)
        if queue.cancel_delete is not None:
            queue.cancel_delete()
            queue.cancel_delete = None
        for consumer in queue.consumers:
            consumer.outbox.consumers_by_id.pop(consumer.consumer_id, None)
            consumer.unacked.clear()
        queue.consumers.clear()
        queue.messages.clear()
        queue.packed_extra = 0
        return True

    def stats(self) -> dict[str, Any]:
        """Counters and sizes of this shard, for `stats.py` (through `_eval`)."""
        queues = self.queues.values()
        depths = heapq.nlargest(10, ((q.depth(), q.name) for q in queues))
        return {
            "worker": self.worker,
            "workers": self.workers,
            "published": self.published,
            "queued": self.queued,
            "consumed": self.consumed,
            "acked": self.acked,
            "rejected": self.rejected,
            "queues": len(self.queues),
            "consumers": sum(len(q.consumers) for q in queues),
            "messages_waiting": sum(q.depth() for q in queues),
            "messages_unacked": sum(len(c.unacked) for q in queues for c in q.consumers),
            "clients": len(self.connections),
            "events": self.routing.subscription_count(),
            "top_queues": [(name.decode(errors="replace"), depth) for depth, name in depths],
        }


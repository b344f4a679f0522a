"""The broker core of one worker. No sockets, no gevent.

A message is stored and delivered as its *tail*, the bytes between the consumer id and
the newline: `b" ok {msg_id} event={event} {data}"`, built once per publish and shared
by every queue that gets a copy; a delivery only adds the consumer id before it and a
newline after. A deep queue packs runs of tails into one `Packed` bytes object, which
saves the ~45 bytes of object and deque overhead each message would cost on its own,
and keeps the header they share once (messages.py). Deliveries are appended to the
consumer's `Outbox`; the connection layer flushes every outbox in `Outbox.pending`
once per batch.

Every copy put into a queue gets the queue's next sequence number (`seq`). A message
never delivered is a bare tail whose seq is implicit (waiting tails hold consecutive
seqs, oldest first); a requeued one is a `Message` record that carries its seq and its
retry counter as fields, so the counter is never parsed back out of client text.
Un-acked messages are keyed by seq; `ack {msg_id}` finds the seq in O(1) however
publishers repeat their ids.

Ordering: a queue hands out messages in the order they were put; a rejected or
requeued message goes back to the front, with its retry counter raised.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from ..journal import records
from ..wire.outbox import Outbox
from ..wire.protocol import ProtocolError, msg_id_of, with_field
from . import dead_letters
from .messages import NEWLINE, Item, Message, MessageStore, Packed, retry_of, unpack
from .routing import Routing, compile_mask
from .timers import Buckets

Schedule = Callable[[float, Callable[[], None]], Callable[[], None]]  # (seconds, fn) -> cancel


class Consumer:
    """One `consume` of one connection: a queue, flags, and its un-acked messages."""

    __slots__ = ("consumer_id", "continued_id", "line_overhead", "queue", "outbox", "manual_ack", "wants_seq",
                 "prefetch", "unacked", "seq_by_msg_id", "later_seqs_by_msg_id", "delete_when_unused_seconds")

    shows_seq = False  # SeqConsumer's deliveries show it
    relayed = False  # a stand-in for a consumer another worker process holds (server/workers/relay.py) says True

    def __init__(self, consumer_id: bytes, queue: Queue, outbox: Outbox, manual_ack: bool = False,
                 prefetch: int = 0, delete_when_unused_seconds: float | None = None) -> None:
        self.consumer_id = consumer_id
        self.continued_id = b"\n" + consumer_id  # after another delivery in the outbox: its newline, then this id
        self.line_overhead = len(consumer_id) + 1  # a delivery line is consumer id + tail + newline
        self.queue = queue
        self.outbox = outbox
        self.manual_ack = manual_ack
        self.wants_seq = manual_ack or self.shows_seq  # held messages are keyed by seq; SeqConsumer shows it
        self.prefetch = prefetch  # 0: no limit
        self.unacked: dict[int, Item] = {}  # seq -> message, in delivery order
        self.seq_by_msg_id: dict[bytes, int] = {}  # the oldest un-acked seq of each msg_id
        # the younger seqs of a msg_id delivered again before its first copy was settled
        # (two publishers counting from 1); empty unless that happens
        self.later_seqs_by_msg_id: dict[bytes, deque[int]] = {}
        self.delete_when_unused_seconds = delete_when_unused_seconds

    def ready(self) -> bool:
        return not self.outbox.paused and (not self.prefetch or len(self.unacked) < self.prefetch)

    def deliver(self, tail: bytes, seq: int, msg_id: bytes, held: Item | None = None) -> None:
        """Owe the client this tail; with manual ack, hold the message (`held`, else the tail) under `seq`."""
        self.outbox.deliver(self.consumer_id, self.continued_id, tail, len(tail) + self.line_overhead)
        if self.manual_ack:
            self.unacked[seq] = tail if held is None else held
            # one lookup (setdefault is native when compiled): the id's first copy in flight, or this one
            if self.seq_by_msg_id.setdefault(msg_id, seq) != seq:
                later = self.later_seqs_by_msg_id.get(msg_id)
                if later is None:
                    later = self.later_seqs_by_msg_id[msg_id] = deque()
                later.append(seq)

    def take_unacked(self, msg_id: bytes) -> tuple[int, Item] | None:
        """Remove the oldest un-acked copy of `msg_id`: (seq, message), or None. O(1)."""
        seq = self.seq_by_msg_id.pop(msg_id, None)
        if seq is None:
            return None
        if self.later_seqs_by_msg_id:
            later = self.later_seqs_by_msg_id.get(msg_id)
            if later is not None:
                self.seq_by_msg_id[msg_id] = later.popleft()
                if not later:
                    del self.later_seqs_by_msg_id[msg_id]
        return seq, self.unacked.pop(seq)

    def take_seq(self, seq: int) -> Item:
        """Remove un-acked copy `seq` (it must be in flight), whichever copy of its msg_id it is."""
        item = self.unacked.pop(seq)
        msg_id = msg_id_of(item.tail if isinstance(item, Message) else item)
        if self.seq_by_msg_id.get(msg_id) == seq:
            del self.seq_by_msg_id[msg_id]
            later = self.later_seqs_by_msg_id.get(msg_id)
            if later is not None:
                self.seq_by_msg_id[msg_id] = later.popleft()
                if not later:
                    del self.later_seqs_by_msg_id[msg_id]
        else:
            later = self.later_seqs_by_msg_id[msg_id]
            later.remove(seq)
            if not later:
                del self.later_seqs_by_msg_id[msg_id]
        return item

    def take_acked(self, msg_ids: list[bytes], unknown: list[bytes]) -> list[int]:
        """Remove the oldest un-acked copy of each id; returns their seqs, appends ids not in flight to `unknown`."""
        seqs: list[int] = []
        if self.later_seqs_by_msg_id:
            take = self.take_unacked
            for msg_id in msg_ids:
                found = take(msg_id)
                if found is None:
                    unknown.append(msg_id)
                else:
                    seqs.append(found[0])
            return seqs
        # no repeated ids in flight (the usual case), inlined: a call per ack is measurable
        seq_by_msg_id, unacked = self.seq_by_msg_id, self.unacked
        for msg_id in msg_ids:
            seq = seq_by_msg_id.get(msg_id, -1)  # as take_acked_one
            if seq < 0:
                unknown.append(msg_id)
            else:
                del seq_by_msg_id[msg_id]
                del unacked[seq]
                seqs.append(seq)
        return seqs

    def take_acked_one(self, msg_id: bytes) -> int:
        """take_acked of one id, with no lists: its seq, or -1 if it is not in flight."""
        if self.later_seqs_by_msg_id:
            found = self.take_unacked(msg_id)
            return -1 if found is None else found[0]
        seq_by_msg_id = self.seq_by_msg_id
        seq = seq_by_msg_id.get(msg_id, -1)  # get and del are native when compiled; pop is a call by name
        if seq >= 0:
            del seq_by_msg_id[msg_id]
            del self.unacked[seq]
        return seq

    def take_all_unacked(self) -> list[tuple[int, Item]]:
        """Remove every un-acked message, oldest delivery first."""
        taken = list(self.unacked.items())
        self.unacked.clear()
        self.seq_by_msg_id.clear()
        self.later_seqs_by_msg_id.clear()
        return taken

    def flags(self) -> list[bytes]:
        """The consume flags, as `--update` lines repeat them: the queue's setting, then this consumer's."""
        flags = self.queue.flags()
        if self.manual_ack:
            flags.append(b"--manual-ack")
        if self.prefetch:
            flags.append(b"--prefetch=%d" % self.prefetch)
        return flags


class TimedConsumer(Consumer):
    """A `consume --manual-ack --ack-timeout=S` (extension): a copy not settled within S seconds goes back.

    Deadlines are kept in delivery order (a `touch` moves its copy to the end), so the
    earliest is always first and one timer per consumer serves them all.
    """

    __slots__ = ("ack_timeout_seconds", "deadline_by_seq", "clock", "arm", "cancel_timer")

    def __init__(self, consumer_id: bytes, queue: Queue, outbox: Outbox, manual_ack: bool = False,
                 prefetch: int = 0, delete_when_unused_seconds: float | None = None, *, ack_timeout_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(consumer_id, queue, outbox, manual_ack, prefetch, delete_when_unused_seconds)
        self.ack_timeout_seconds = ack_timeout_seconds
        self.deadline_by_seq: dict[int, float] = {}  # seq -> monotonic deadline, earliest first
        self.clock = clock
        self.arm: Callable[[float], Callable[[], None]] | None = None  # (seconds) -> cancel; set by the Broker
        self.cancel_timer: Callable[[], None] | None = None

    def deliver(self, tail: bytes, seq: int, msg_id: bytes, held: Item | None = None) -> None:
        super().deliver(tail, seq, msg_id, held)
        self.deadline_by_seq[seq] = self.clock() + self.ack_timeout_seconds
        if self.cancel_timer is None and self.arm is not None:
            self.cancel_timer = self.arm(self.ack_timeout_seconds)

    def take_unacked(self, msg_id: bytes) -> tuple[int, Item] | None:
        found = super().take_unacked(msg_id)
        if found is not None:
            self.deadline_by_seq.pop(found[0], None)
        return found

    def take_seq(self, seq: int) -> Item:
        self.deadline_by_seq.pop(seq, None)
        return super().take_seq(seq)

    def take_acked(self, msg_ids: list[bytes], unknown: list[bytes]) -> list[int]:
        seqs = super().take_acked(msg_ids, unknown)
        pop = self.deadline_by_seq.pop
        for seq in seqs:
            pop(seq, None)
        return seqs

    def take_acked_one(self, msg_id: bytes) -> int:
        seq = super().take_acked_one(msg_id)
        if seq >= 0:
            self.deadline_by_seq.pop(seq, None)
        return seq

    def take_all_unacked(self) -> list[tuple[int, Item]]:
        self.deadline_by_seq.clear()
        if self.cancel_timer is not None:
            self.cancel_timer()
            self.cancel_timer = None
        return super().take_all_unacked()

    def touch(self, seq: int) -> None:
        """Restart the clock of copy `seq`: it moves to the end of the deadline order."""
        self.deadline_by_seq.pop(seq, None)
        self.deadline_by_seq[seq] = self.clock() + self.ack_timeout_seconds

    def take_expired(self) -> list[tuple[int, Item]]:
        """Remove every copy past its deadline, oldest delivery first, and re-arm for the next one."""
        self.cancel_timer = None
        now = self.clock()
        expired = []
        for seq, deadline in self.deadline_by_seq.items():
            if deadline > now:
                break
            expired.append(seq)
        taken = [(seq, self.take_seq(seq)) for seq in expired]
        if self.deadline_by_seq and self.arm is not None:
            self.cancel_timer = self.arm(max(0.0, next(iter(self.deadline_by_seq.values())) - now))
        return taken

    def flags(self) -> list[bytes]:
        return [*Consumer.flags(self), b"--ack-timeout=%r" % self.ack_timeout_seconds]


class SeqConsumer(Consumer):
    """A `consume --seq` (extension): every delivery shows `,seq={n}` after the event and retry.

    A subclass, so consumers that did not ask pay nothing for the option.
    """

    __slots__ = ()
    shows_seq = True

    def deliver(self, tail: bytes, seq: int, msg_id: bytes, held: Item | None = None) -> None:
        super().deliver(with_seq(tail, seq), seq, msg_id, tail if held is None else held)

    def flags(self) -> list[bytes]:
        return [*super().flags(), b"--seq"]


class TimedSeqConsumer(TimedConsumer):
    """`--seq` and `--ack-timeout` together (SeqConsumer's two methods again: the compiled build takes no
    multiple inheritance)."""

    __slots__ = ()
    shows_seq = True

    def deliver(self, tail: bytes, seq: int, msg_id: bytes, held: Item | None = None) -> None:
        super().deliver(with_seq(tail, seq), seq, msg_id, tail if held is None else held)

    def flags(self) -> list[bytes]:
        return [*super().flags(), b"--seq"]


def with_seq(tail: bytes, seq: int) -> bytes:
    return with_field(tail, b",seq=%d" % seq)


def update_line(consumer: Consumer) -> bytes:
    """`{consumer_id} ok --update {queue} {events...} [flags]`: all a client needs to replay it.

    Events are sorted, as the original MQKS sent them.
    """
    queue = consumer.queue
    return b" ".join([consumer.consumer_id, b"ok --update", queue.name, *sorted(queue.events),
                      *consumer.flags()]) + NEWLINE


class Queue(MessageStore):
    """A queue: its messages (MessageStore), the consumers competing for them, its events and settings."""

    __slots__ = ("consumers", "next_consumer", "events", "delete_when_unused_seconds", "cancel_delete", "max_retries",
                 "max_length", "dropped")

    def __init__(self, name: bytes) -> None:
        super().__init__(name)
        self.consumers: list[Consumer] = []
        self.next_consumer = 0  # round-robin position
        self.events: dict[bytes, None] = {}  # an ordered set
        self.delete_when_unused_seconds: float | None = None
        self.cancel_delete: Callable[[], None] | None = None
        self.max_retries: int | None = None  # past it a message goes to `{queue}.dead` (extension)
        self.max_length: int | None = None  # a put that would make the queue longer is refused (extension)
        self.dropped = 0  # puts refused by max_length

    def flags(self) -> list[bytes]:
        """The queue's own settings as consume flags, in the order `--update` lines show them."""
        flags = []
        seconds = self.delete_when_unused_seconds
        if seconds is not None:
            flags.append(b"--delete-queue-when-unused=%r" % seconds if seconds else b"--delete-queue-when-unused")
        if self.max_retries is not None:
            flags.append(b"--max-retries=%d" % self.max_retries)
        if self.max_length is not None:
            flags.append(b"--max-length=%d" % self.max_length)
        return flags

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

    def put(self, tail: bytes, msg_id: bytes) -> bool | None:
        """Deliver now if a consumer is ready and nothing waits ahead; else keep. True if delivered.

        A copy that waits or is held for an ack takes the queue's next seq; one delivered at
        once to an auto-ack consumer that did not ask for `--seq` is gone at once and needs none.
        None: refused, the queue is at its `max_length` (counted in `dropped`).
        """
        if not self.newest and not self.messages:  # the list first: newest tails are never alone, and it is native
            consumers = self.consumers
            if len(consumers) == 1:
                # the common case, inlined: a call less per message is measurable here
                consumer = consumers[0]
                if not consumer.outbox.paused and (not consumer.prefetch or len(consumer.unacked) < consumer.prefetch):
                    if consumer.wants_seq:
                        seq = self.next_seq
                        self.next_seq = seq + 1
                        consumer.deliver(tail, seq, msg_id)
                    else:
                        consumer.deliver(tail, 0, msg_id)
                    return True
            elif consumers:
                ready = self.ready_consumer()
                if ready is not None:
                    seq = self.next_seq
                    self.next_seq = seq + 1
                    ready.deliver(tail, seq, msg_id)
                    return True
        if self.max_length is not None and self.depth() >= self.max_length:
            self.dropped += 1
            return None
        # only an empty queue delivers directly, so no seq is skipped between waiting tails
        self.append(tail, msg_id)
        return False

    def pump(self) -> int:
        """Hand waiting messages to ready consumers; returns how many were delivered."""
        messages = self.messages
        delivered = 0
        if len(self.consumers) == 1 and self.record is None:  # recorded: each delivery is a record of its own
            # one consumer, inlined: no round-robin, and the seq and message id are worked
            # out only if the message will be held for an ack
            consumer = self.consumers[0]
            outbox, prefetch, unacked = consumer.outbox, consumer.prefetch, consumer.unacked
            wants_seq = consumer.wants_seq
            seq, msg_id = 0, b""
            while not outbox.paused and (not prefetch or len(unacked) < prefetch):
                if not messages:
                    if not self.newest:
                        break
                    self.spill()
                item = messages.popleft()
                if type(item) is Packed:
                    delivered += self.pump_run(consumer, unpack(item))
                    continue
                if type(item) is Message:
                    self.requeued -= 1
                    if wants_seq:
                        seq, msg_id = item.seq, msg_id_of(item.tail)
                    consumer.deliver(item.delivery_tail(), seq, msg_id, item)
                else:
                    if wants_seq:
                        seq = self.next_seq - (len(messages) + self.packed_extra + len(self.newest) + 1 - self.requeued)
                        msg_id = msg_id_of(item)
                    consumer.deliver(item, seq, msg_id)
                delivered += 1
            if not messages:
                self.spill()  # the newest tails wait in `messages` whenever it is empty
            return delivered
        return self.pump_each()

    def pump_run(self, consumer: Consumer, tails: list[bytes]) -> int:
        """Deliver the tails of the run taken off the front to the queue's one consumer while it is ready, from the
        list (the deque's popleft is a call by name when compiled); the rest go back to the front. How many went."""
        self.packed_extra -= len(tails) - 1
        # a run is never behind a record: its first tail's seq follows from every message waiting
        first = self.next_seq - (len(self.messages) + self.packed_extra + len(self.newest) + len(tails))
        outbox, prefetch, unacked = consumer.outbox, consumer.prefetch, consumer.unacked
        wants_seq = consumer.wants_seq
        count = len(tails)
        i = 0
        while i < count and not outbox.paused and (not prefetch or len(unacked) < prefetch):
            tail = tails[i]
            if wants_seq:
                consumer.deliver(tail, first + i, msg_id_of(tail))
            else:
                consumer.deliver(tail, 0, b"")
            i += 1
        if i < count:
            self.messages.extendleft(reversed(tails[i:]))
        return i

    def pump_each(self) -> int:
        """Round robin, one message at a time, until no consumer is ready; returns how many went."""
        messages = self.messages
        delivered = 0
        while messages:  # pop() moves the newest tails here when it takes the last item
            ready = self.ready_consumer()
            if ready is None:
                break
            self.deliver_front(ready)
            delivered += 1
        return delivered

    def deliver_front(self, consumer: Consumer) -> int:
        """Hand the front message to `consumer`; returns its seq."""
        seq, item = self.pop()
        if isinstance(item, Message):
            consumer.deliver(item.delivery_tail(), seq, msg_id_of(item.tail), item)
        else:
            consumer.deliver(item, seq, msg_id_of(item))
        if self.record is not None:
            self.record(records.delivered_one(self.name, seq, consumer.manual_ack))
        return seq



class Broker:
    """The queues, bindings and consumers of one worker, and its counters."""

    def __init__(self, schedule: Schedule | None = None, count_clients: Callable[[], int] = lambda: 0,
                 cache_routes: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.schedule = schedule
        self.clock = clock  # the schedule's clock: ack-timeout deadlines are on it
        # the broker that owns a queue name (dead letters may belong to another worker's); workers/peers.py sets it
        self.broker_for: Callable[[bytes], Broker] = lambda name: self
        # copies rejected with --delay, waiting to go back to the front of their queue: (queue, records)
        self.parked = Buckets(schedule, self._unpark)
        self.count_clients = count_clients  # for stats only: a worker knows no connections
        self.queues: dict[bytes, Queue] = {}
        self.routing = Routing(cache_enabled=cache_routes)
        self.route_cache = self.routing.cache
        self.published = 0
        self.queued = 0
        self.consumed = 0
        self.acked = 0
        self.rejected = 0
        self.ack_timeouts = 0
        self.touched = 0
        self.dead_lettered = 0
        self.purged = 0
        self.unrouted = 0  # publishes to an event no queue is bound to
        self.dead_requeued = 0
        self.dropped_by_deleted_queues = 0
        self.leases: Any = None  # server/core/leases.py's Leases, set by Process (fetch and settle)
        # with worker processes, every other worker's replica of the bindings must learn each change
        self.bindings_changed: Callable[[Queue], None] | None = None
        # ... and a cluster's group refuses to add one while another group may route by what it had of them
        # (server/workers/bindings_trust.py): the reason, or None
        self.binding_refusal: Callable[[], str | None] | None = None
        # the journal's append with --data-dir: every change of durable state is a record (records.py)
        self.record: Callable[[bytes], None] | None = None

    def publish(self, msg_id: bytes, event: bytes, tail: bytes) -> None:
        """Put a copy of the message into every queue bound to `event`."""
        self.published += 1
        # typed: the compiled build calls Queue.put natively (the cache's tuples hold Any: a lookup by name per call)
        queues: tuple[Queue, ...] | None = self.route_cache.get(event)
        if queues is None:
            queues = self.routing.route(event)
        if not queues:  # no queue is bound: counted, so an operator sees where messages went
            self.unrouted += 1
            return
        record = self.record
        if record is not None:
            self.publish_recorded(record, queues, msg_id, tail)
            return
        for queue in queues:
            if queue.put(tail, msg_id):
                self.consumed += 1
        self.queued += len(queues)

    def publish_recorded(self, record: Callable[[bytes], None], queues: tuple[Queue, ...], msg_id: bytes,
                         tail: bytes) -> None:
        """`publish` with a journal: one P record for every copy that waits or is held for an ack.

        A copy delivered at once to an auto-ack consumer is gone at once and never written
        (measured: a D record of its own per message was a third of the durable path's CPU).
        """
        self.queued += len(queues)
        if len(queues) == 1:  # the common case: no list, one format (measured: -0.4 us per durable publish)
            queue = queues[0]
            seq = queue.next_seq
            delivered = queue.put(tail, msg_id)
            if not delivered:
                if delivered is not None:  # None: refused, the queue is at its --max-length
                    record(records.published_one(queue.name, seq, False, tail))
                return
            self.consumed += 1
            if queue.next_seq != seq:  # else delivered to an auto-ack consumer at once: gone, never written
                consumers = queue.consumers
                if consumers[0].manual_ack if len(consumers) == 1 else holds(queue, seq):
                    record(records.published_one(queue.name, seq, True, tail))
            return
        refs: list[bytes] = []
        for queue in queues:
            seq = queue.next_seq
            delivered = queue.put(tail, msg_id)
            if delivered is None:
                continue  # refused: the queue is at its --max-length
            if delivered:
                self.consumed += 1
                if queue.next_seq == seq:
                    continue  # delivered to an auto-ack consumer at once: gone, never written
                consumers = queue.consumers
                # one consumer took it: held if it acks (else a --seq auto-ack consumer: gone)
                if not (consumers[0].manual_ack if len(consumers) == 1 else holds(queue, seq)):
                    continue
                refs.append(records.ref(queue.name, seq, True))
            else:
                refs.append(records.ref(queue.name, seq, False))
        if refs:
            record(records.published(refs, tail))

    def routes(self, event: bytes) -> bool:
        """True if a queue of this worker is bound to `event`."""
        queues = self.route_cache.get(event)
        if queues is None:
            queues = self.routing.route(event)
        return bool(queues)

    def permits(self, event: bytes) -> bool:
        """Any event: a scoped session's publisher (dispatch/scopes.py) is the one that refuses."""
        return True

    def full_queues(self, event: bytes) -> list[Queue]:
        """The queues bound to `event` that would refuse a copy now (at their `max_length`)."""
        queues = self.route_cache.get(event)
        if queues is None:
            queues = self.routing.route(event)
        return [queue for queue in queues
                if queue.max_length is not None and queue.depth() >= queue.max_length]

    def queue(self, name: bytes) -> Queue:
        """The queue called `name`, created if missing."""
        queue = self.queues.get(name)
        if queue is None:
            queue = self.queues[name] = self.new_queue(name)
        return queue

    def new_queue(self, name: bytes) -> Queue:
        queue = Queue(name)
        queue.record = self.record
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
                if b"." in event and pattern.fullmatch(event):  # spec: masks work only for events with dots
                    del wanted[event]
        wanted.update(dict.fromkeys(add))
        if list(wanted) == before:
            return False
        if self.binding_refusal is not None and any(event not in queue.events for event in wanted):
            refusal = self.binding_refusal()
            if refusal is not None:
                raise ProtocolError(refusal)
        for event in before:
            if event not in wanted:
                self.routing.unbind(queue, event)
        for event in wanted:
            if event not in queue.events:
                self.routing.bind(queue, event)
        queue.events = wanted
        if self.bindings_changed is not None:
            self.bindings_changed(queue)
        if self.record is not None:
            self.record(queue_record(queue))
        return True

    def consume(self, consumer: Consumer, replace: list[bytes], add: list[bytes] | None,
                limits: dict[str, int | None] | None = None) -> None:
        """Bind, set the queue's delete-when-unused and the `limits` given, attach the consumer, tell the others.

        A change of events or setting sends `--update` to every consumer of the queue but
        the new one, unless it used `--add` (`add` is not None): only the server knows the
        merged list. Nothing changed: no `--update` to anyone (the original MQKS's rule).
        """
        queue = consumer.queue
        changed = self.rebind(queue, replace=replace or None, add=add or ())
        if queue.delete_when_unused_seconds != consumer.delete_when_unused_seconds:
            queue.delete_when_unused_seconds = consumer.delete_when_unused_seconds
            changed = True
            if self.record is not None:
                self.record(queue_record(queue))
        if limits and self.set_limits(queue, limits):
            changed = True
        self.add_consumer(consumer)
        if isinstance(consumer, TimedConsumer) and self.schedule is not None:
            schedule = self.schedule
            consumer.arm = lambda seconds: schedule(seconds, lambda: self.expire(consumer))
        if changed:
            self.updates(queue, skip=None if add is not None else consumer)

    def set_limits(self, queue: Queue, limits: dict[str, int | None]) -> bool:
        """Set `max_retries` and/or `max_length` (None clears one); True if one changed.

        A lowered `max_retries` moves the waiting copies already past it to the dead letters.
        """
        changed = False
        for name, value in limits.items():
            if getattr(queue, name) != value:
                setattr(queue, name, value)
                changed = True
        if changed:
            self.limits_changed(queue)
        return changed

    def limits_changed(self, queue: Queue) -> None:
        if self.record is not None:
            self.record(queue_record(queue))  # before the dead letters it may cause, as replay needs
        if queue.max_retries is not None and queue.requeued:
            dead = queue.take_front_over(queue.max_retries)
            if dead:
                dead_letters.move(self, queue, [(record.seq, record) for record in dead], raise_retry=False)

    def updates(self, queue: Queue, skip: Consumer | None = None) -> None:
        """Tell every consumer of `queue` (but `skip`) its current events and flags (`--update`)."""
        for consumer in queue.consumers:
            if consumer is not skip:
                consumer.outbox.write(update_line(consumer))

    def add_consumer(self, consumer: Consumer) -> None:
        queue = consumer.queue
        if queue.cancel_delete is not None:
            queue.cancel_delete()
            queue.cancel_delete = None
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
        taken = consumer.take_all_unacked()
        if self.queues.get(queue.name) is not queue:
            return  # the queue was deleted under it
        if taken:
            self.rejected += len(taken)
            self.requeue(queue, taken)
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

        if queue.cancel_delete is not None:
            queue.cancel_delete()
        queue.cancel_delete = self.schedule(seconds, delete_if_still_unused)

    def ack(self, consumer: Consumer, msg_ids: list[bytes]) -> list[bytes]:
        """Forget acked messages; returns the ids that were not in flight. O(1) per id."""
        unknown: list[bytes] = []
        seqs = consumer.take_acked(msg_ids, unknown)
        if seqs and self.record is not None:
            self.record(records.gone(consumer.queue.name, seqs))
        self.acked += len(seqs)
        if consumer.prefetch:
            self.pump(consumer.queue)
        return unknown

    def ack_one(self, consumer: Consumer, msg_id: bytes) -> bool:
        """`ack` of one id, the line msg.ack() and nc users send; False if it is not in flight."""
        seq = consumer.take_acked_one(msg_id)
        if seq < 0:
            return False
        if self.record is not None:
            self.record(records.gone(consumer.queue.name, [seq]))
        self.acked += 1
        if consumer.prefetch:
            self.pump(consumer.queue)
        return True

    def ack_all(self, consumer: Consumer) -> None:
        taken = consumer.take_all_unacked()
        if taken and self.record is not None:
            self.record(records.gone(consumer.queue.name, [seq for seq, _ in taken]))
        self.acked += len(taken)
        self.pump(consumer.queue)

    def reject(self, consumer: Consumer, msg_ids: list[bytes]) -> list[bytes]:
        """Return messages to the front of the queue with retry+1; returns the unknown ids."""
        taken, unknown = self._take(consumer, msg_ids)
        self._requeue(consumer, taken)
        return unknown

    def _take(self, consumer: Consumer, msg_ids: list[bytes]) -> tuple[list[tuple[int, Item]], list[bytes]]:
        """Take the oldest un-acked copy of each id from the consumer: (taken, ids not in flight)."""
        unknown, taken = [], []
        for msg_id in msg_ids:
            found = consumer.take_unacked(msg_id)
            if found is None:
                unknown.append(msg_id)
            else:
                taken.append(found)
        return taken, unknown

    def reject_later(self, consumer: Consumer, msg_ids: list[bytes] | None, due_ms: int) -> list[bytes]:
        """`reject --delay`: the copies go back to the front of the queue at `due_ms`, retry raised now."""
        unknown: list[bytes] = []
        if msg_ids is None:
            taken = consumer.take_all_unacked()
        else:
            taken, unknown = self._take(consumer, msg_ids)
        self.rejected += len(taken)
        queue = consumer.queue
        if taken and self.queues.get(queue.name) is queue:
            taken = dead_letters.divert(self, queue, taken)
            if taken:
                self.park(queue, due_ms, [Message(seq, retry_of(item) + 1, item.tail if isinstance(item, Message)
                                                  else item) for seq, item in taken])
            if consumer.prefetch:
                self.pump(queue)
        return unknown

    def park(self, queue: Queue, due_ms: int, parked: list[Message]) -> None:
        if self.record is not None:
            self.record(records.parked(queue.name, due_ms, parked))
        self.parked.add(due_ms, (queue, parked))

    def _unpark(self, due_ms: int, entries: list[tuple[Queue, list[Message]]]) -> None:
        for queue, parked in entries:
            if self.queues.get(queue.name) is queue:  # else the queue was deleted meanwhile
                queue.put_front(parked)
                self.pump(queue)

    def reject_all(self, consumer: Consumer) -> None:
        self._requeue(consumer, consumer.take_all_unacked())

    def _requeue(self, consumer: Consumer, taken: list[tuple[int, Item]]) -> None:
        self.rejected += len(taken)
        if taken and self.queues.get(consumer.queue.name) is consumer.queue:
            self.requeue(consumer.queue, taken)
            self.pump(consumer.queue)

    def requeue(self, queue: Queue, taken: list[tuple[int, Item]]) -> None:
        """Copies taken from consumers go back to the front with retry+1; past `max_retries`, to the dead letters."""
        taken = dead_letters.divert(self, queue, taken)
        if taken:
            queue.requeue(taken)

    def expire(self, consumer: TimedConsumer) -> None:
        """The consumer's ack timeout: copies past their deadline go back as if rejected."""
        taken = consumer.take_expired()
        if taken:
            self.ack_timeouts += len(taken)
            self._requeue(consumer, taken)

    def touch(self, consumer: Consumer, msg_ids: list[bytes]) -> list[bytes]:
        """Restart the ack-timeout clock of in-flight copies; returns the ids not in flight."""
        unknown = []
        for msg_id in msg_ids:
            seq = consumer.seq_by_msg_id.get(msg_id)
            if seq is None:
                unknown.append(msg_id)
            elif isinstance(consumer, TimedConsumer):
                consumer.touch(seq)
        self.touched += len(msg_ids) - len(unknown)
        return unknown

    def delete_queue(self, name: bytes) -> bool:
        """Drop a queue with its bindings, messages and consumers; False if there was none.

        Its consumers first get `--update {queue}` with no events (the original MQKS
        unbinds everything before it deletes), then get nothing more.
        """
        queue = self.queues.pop(name, None)
        if queue is None:
            return False
        for event in queue.events:
            self.routing.unbind(queue, event)
        had_events = bool(queue.events)
        queue.events = {}
        if had_events and self.bindings_changed is not None:
            self.bindings_changed(queue)
        if queue.cancel_delete is not None:
            queue.cancel_delete()
            queue.cancel_delete = None
        for consumer in queue.consumers:
            consumer.outbox.write(update_line(consumer))
            consumer.outbox.consumers_by_id.pop(consumer.consumer_id, None)
            consumer.take_all_unacked()
        queue.consumers.clear()
        queue.clear()
        self.dropped_by_deleted_queues += queue.dropped
        if self.record is not None:
            self.record(records.queue_deleted(name))
        return True

    def purge_queue(self, name: bytes) -> int:
        """Drop every message waiting in a queue (the copies its consumers hold stay theirs); how many went."""
        queue = self.queues.get(name)
        if queue is None:
            return 0
        taken = queue.take_waiting()
        if taken and self.record is not None:
            self.record(records.gone(name, [seq for seq, _ in taken]))
        self.purged += len(taken)
        return len(taken)

    def requeue_dead(self, name: bytes, limit: int | None = None, msg_ids: set[bytes] | None = None) -> int:
        """Move dead letters waiting in `{name}.dead` back to `name` (all, the oldest `limit`, or `msg_ids`), their
        retry counters at 0: the operator fixed what killed them. How many moved."""
        dead_queue = self.queues.get(name + b".dead")
        if dead_queue is None:
            return 0
        taken = dead_queue.take_waiting(limit, msg_ids)
        if taken:
            dead_letters.move(self, dead_queue, taken, to=name)
            self.dead_requeued += len(taken)
        return len(taken)

    def stats(self) -> dict[str, Any]:
        """Counters and sizes of this broker, for the `stats` action (Process.stats adds the process's)."""
        queues = self.queues.values()
        depths = heapq.nlargest(10, ((q.depth(), q.name) for q in queues))
        return {
            "published": self.published,
            "queued": self.queued,
            "consumed": self.consumed,
            "acked": self.acked,
            "rejected": self.rejected,
            "ack_timeouts": self.ack_timeouts,
            "touched": self.touched,
            "dead_lettered": self.dead_lettered,
            "purged": self.purged,
            "unrouted": self.unrouted,
            "dead_requeued": self.dead_requeued,
            "dropped": self.dropped_by_deleted_queues + sum(q.dropped for q in queues),
            "queues": len(self.queues),
            "consumers": sum(len(q.consumers) for q in queues),
            "messages_waiting": sum(q.depth() for q in queues),
            "messages_unacked": sum(len(c.unacked) for q in queues for c in q.consumers),
            "clients": self.count_clients(),
            "events": self.routing.subscription_count(),
            "top_queues": [(name.decode(errors="replace"), depth) for depth, name in depths],
        }



def holds(queue: Queue, seq: int) -> bool:
    """True if a consumer of `queue` holds copy `seq` for an ack."""
    return any(seq in consumer.unacked for consumer in queue.consumers)


def queue_record(queue: Queue) -> bytes:
    """The queue's Q record: its events and settings."""
    return records.queue(queue.name, queue.delete_when_unused_seconds, queue.events, queue.max_retries,
                         queue.max_length)

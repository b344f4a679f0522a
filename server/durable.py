"""Step 5 of the flow, on disk: every change of durable state as a record in the write-ahead log.

Only with `mqksd --data-dir`: then each worker is a `DurableBroker` whose queues are
`DurableQueue`s, and every change goes through the process's `Journal` as one text line
(a tail never holds a newline). Records, by their first byte:

    Q {queue} {seconds|-} {event}... [--max-retries=N] [--max-length=N]
                                          the queue's events and settings (full state)
    X {queue}                             the queue was deleted
    P {k} {queue} [-]{seq}...{tail}       a message put into k queues (its body written once);
                                          "-": delivered at once and held for an ack
    D {queue} {seq}...                    delivered and held for an ack
    A {queue} {seq}...                    gone: acked, or delivered to an auto-ack consumer
    R {queue} {seq} {retry}...            back at the front of the queue with this retry count
    Y {queue} {due_ms} {seq} {retry}...   rejected with --delay: back at the front at due_ms (Unix ms)
    T {due_ms}{tail}                      a publish delayed until due_ms (Unix ms), routed then
    F {due_ms}                            the publishes delayed until due_ms went out (P records follow)
    K {name} {json}                       a schedule's whole state (set, or after each firing)
    U {name}                              the schedule was removed (unscheduled, or its count reached)
    E {queue} {seq} {retry}{tail}         a dead letter put into this queue, keeping its retry count
    S                                     a snapshot follows: forget everything before it (older logs)
    SB / SE                               a snapshot begins / ends, over several frames: its records
                                          replace everything before it only once SE is read
    N {queue} {next_seq}                  (snapshot) the queue's next seq
    M {queue} {seq} {retry} {0|1}{tail}   (snapshot) a live message; 1: it was held for an ack

A copy delivered at once to an auto-ack consumer is never written. Un-acked messages are
not lost on a crash: replay finds them delivered and not acked, and puts them back at the
front with their retry raised, as a disconnect would. Retry counts are absolute, so a replay
never counts twice. Acks do not wait for the disk: a lost ack is one redelivery.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import chain, groupby
from operator import itemgetter
from typing import Any, Protocol

from .outbox import Outbox
from .state import PACK_MIN_DEPTH, PACK_TAILS, Broker, Consumer, Item, Message, Packed, Queue

log = logging.getLogger("mqks.durable")

SNAPSHOT_MIN_GROWTH_BYTES = 128 << 20  # never rewrite the live state for less churn than this
SNAPSHOT_GROWTH = 0.5  # rewrite once the log grew by half the last snapshot: disk <= ~1.5x live + slack
MAX_UNSYNCED_BYTES = 64 << 20  # past this, publishers stop being read until the disk catches up
# a snapshot goes out in frames of this size, each written before the next is built, so it never
# holds a second copy of the live state (one frame of 1.2M messages doubled the peak: 264 -> 535 MiB)
SNAPSHOT_CHUNK_BYTES = 4 << 20
SNAPSHOT_WAIT_SECONDS = 0.001  # how often a snapshot looks whether the writer took its last frame


class Log(Protocol):
    """What the journal needs of `server.log.Log` (the storage layer)."""

    unsynced_bytes: int
    disk_full: bool
    blocked: str | None

    @property
    def handed_bytes(self) -> int: ...

    @property
    def frames_waiting(self) -> bool: ...

    def append(self, record: bytes) -> None: ...

    def commit(self, new_segment: bool = False, completes: bool | None = None) -> int | None: ...

    def poll(self) -> tuple[int, list[int]]: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self, timeout_seconds: float | None = None) -> None: ...

    def replay(self, repair: bool = False) -> Iterator[bytes]: ...


class Journal:
    """The process's records and the confirms that wait for them to be durable."""

    def __init__(self, log_: Log, error_line: Callable[[bytes, str], bytes],
                 snapshot_min_growth_bytes: int = SNAPSHOT_MIN_GROWTH_BYTES) -> None:
        self.log = log_
        self.append = log_.append
        self.error_line = error_line  # (rid, reason) -> the error line, with a fresh error id
        self.last_commit = 0  # the newest commit handed to the log
        self.durable = 0  # the newest commit the log reported durable
        self.waiting: deque[tuple[int, list[tuple[Outbox, bytes]]]] = deque()  # (commit, its confirms)
        # confirms of the batch not yet committed: a handler appends (outbox, rid), and the
        # client gets `{rid} ok` once everything recorded so far is durable under the policy
        self.unconfirmed: list[tuple[Outbox, bytes]] = []
        self.snapshot_mark = 0  # the log's handed_bytes when the last snapshot was committed
        self.last_snapshot_bytes = 0
        self.snapshot_min_growth_bytes = snapshot_min_growth_bytes
        self.snapshots = 0

    @property
    def backlogged(self) -> bool:
        return self.log.unsynced_bytes > MAX_UNSYNCED_BYTES

    @property
    def disk_full(self) -> bool:
        return self.log.disk_full

    def refusal(self) -> str:
        """Why a confirmed publish is refused while the log cannot write."""
        if self.log.disk_full:
            return "disk full: confirmed publishes are refused until the data dir has room again"
        return f"{self.log.blocked}: confirmed publishes are refused until the log can write again"

    def commit(self) -> None:
        """Close the batch into one frame (a no-op without records) and queue its confirms."""
        number = self.log.commit()
        if number is not None:
            self.last_commit = number
        if self.unconfirmed:
            # a confirm whose publish wrote nothing (every copy went to auto-ack consumers at
            # once) still waits for what came before it: confirms keep their order
            if self.last_commit <= self.durable:
                answer_ok(self.unconfirmed)
            else:
                self.waiting.append((self.last_commit, self.unconfirmed))
            self.unconfirmed = []

    def settle(self) -> None:
        """After the log woke us: answer the confirms that became durable, or failed."""
        durable, failed = self.log.poll()
        self.durable = max(self.durable, durable)
        waiting = self.waiting
        if failed:
            failed_commits = set(failed)
            kept: deque[tuple[int, list[tuple[Outbox, bytes]]]] = deque()
            for commit, confirms in waiting:
                if commit in failed_commits:
                    reason = f"{self.log.blocked or 'disk full'}: the message is kept in memory but is not on disk"
                    for outbox, rid in confirms:
                        outbox.write(self.error_line(rid, reason))
                else:
                    kept.append((commit, confirms))
            self.waiting = waiting = kept
        while waiting and waiting[0][0] <= self.durable:
            answer_ok(waiting.popleft()[1])

    def count_as_churn(self, size: int) -> None:
        """Count `size` bytes (a log replayed at start) as written since the last snapshot."""
        self.snapshot_mark -= size

    def wants_snapshot(self) -> bool:
        growth = max(self.snapshot_min_growth_bytes, int(self.last_snapshot_bytes * SNAPSHOT_GROWTH))
        return self.log.handed_bytes - self.snapshot_mark > growth

    def snapshot(self, brokers: Iterable[Broker], process_lines: Iterable[bytes] = ()) -> None:
        """Write the whole live state as one frame in a new segment; the log then drops older ones.

        `process_lines`: the state kept above the workers (delayed publishes, schedules) as records.
        """
        self.commit()  # what came before stays before
        started = time.monotonic()
        size = chunk = 0
        log_ = self.log
        append = log_.append
        append(b"SB")
        first = True
        brokers = list(brokers)
        for line in chain(self._state_lines(brokers), *map(parked_lines, brokers), process_lines):
            size += len(line) + 1
            chunk += len(line) + 1
            append(line)
            if chunk >= SNAPSHOT_CHUNK_BYTES:
                # no other greenlet runs until the snapshot ends (nothing yields here): the frames
                # hold one point in time, and no record of a later change comes between them
                self.last_commit = log_.commit(new_segment=first, completes=False) or self.last_commit
                first, chunk = False, 0
                self._wait_for_the_writer()
        append(b"SE")
        number = log_.commit(new_segment=first, completes=True)
        if number is not None:
            self.last_commit = number
        self.last_snapshot_bytes = size
        self.snapshot_mark = self.log.handed_bytes
        self.snapshots += 1
        log.info("snapshot of the live state: %d bytes in %.3f s", size, time.monotonic() - started)

    @staticmethod
    def _state_lines(brokers: list[Broker]) -> Iterator[bytes]:
        for broker in brokers:
            leased = broker.leases.held_by_queue() if broker.leases is not None else {}
            for queue in broker.queues.values():
                assert isinstance(queue, DurableQueue)  # a journal's brokers make only these
                yield from queue.snapshot_lines(leased.get(queue.name, ()))

    def _wait_for_the_writer(self) -> None:
        """Block (the whole loop) until the writer thread has taken the last chunk, so at most two exist:
        the one it writes and the one being built. Not on a log that cannot write: then the chunks wait
        in memory, as any commit's do on a full disk."""
        log_ = self.log
        while log_.frames_waiting and not log_.blocked:
            time.sleep(SNAPSHOT_WAIT_SECONDS)

    def close(self, timeout_seconds: float | None = None) -> None:
        self.commit()
        self.log.close(timeout_seconds)
        self.settle()

    def stats(self) -> dict[str, Any]:
        waiting = sum(len(confirms) for _, confirms in self.waiting)
        return {**self.log.stats(), "snapshots": self.snapshots, "confirms_waiting": waiting}


def answer_ok(confirms: list[tuple[Outbox, bytes]]) -> None:
    """`{rid} ok` to each, one write per run of confirms owed to the same client."""
    for outbox, run in groupby(confirms, key=itemgetter(0)):
        outbox.write(b"".join([b"%b ok \n" % rid for _, rid in run]))


def parked_lines(broker: Broker) -> Iterator[bytes]:
    """The copies rejected with --delay, as snapshot records: each message, then when it comes back."""
    for due_ms, entries in broker.parked.items():
        for queue, records in entries:
            name: bytes = queue.name
            if broker.queues.get(name) is not queue:
                continue
            fields = [b"Y", name, b"%d" % due_ms]
            for record in records:
                yield b"M %b %d %d 0%b" % (name, record.seq, record.retry, record.tail)
                fields += [b"%d" % record.seq, b"%d" % record.retry]
            yield b" ".join(fields)


def holds(queue: Queue, seq: int) -> bool:
    """True if a consumer of `queue` holds copy `seq` for an ack."""
    return any(seq in consumer.unacked for consumer in queue.consumers)


def queue_line(queue: Queue) -> bytes:
    seconds = queue.delete_when_unused_seconds
    fields = [b"Q", queue.name, b"-" if seconds is None else repr(seconds).encode(), *queue.events]
    # events never start with "--" (the parser reads those as flags), so settings follow them unambiguously
    if queue.max_retries is not None:
        fields.append(b"--max-retries=%d" % queue.max_retries)
    if queue.max_length is not None:
        fields.append(b"--max-length=%d" % queue.max_length)
    return b" ".join(fields)


class DurableQueue(Queue):
    """A queue whose deliveries and requeues are recorded."""

    __slots__ = ("journal",)

    def __init__(self, name: bytes, journal: Journal) -> None:
        super().__init__(name)
        self.journal = journal

    def pump(self) -> int:
        # one at a time (no inlined fast path): each delivery is a record, and the disk costs more
        return self.pump_each()

    def deliver_front(self, consumer: Consumer) -> int:
        seq = Queue.deliver_front(self, consumer)
        self.journal.append(b"%b %b %d" % (b"D" if consumer.manual_ack else b"A", self.name, seq))
        return seq

    def put_front(self, records: list[Message]) -> None:
        Queue.put_front(self, records)
        if records:
            fields = [b"R", self.name]
            for record in records:
                fields += [b"%d" % record.seq, b"%d" % record.retry]
            self.journal.append(b" ".join(fields))

    def put_record(self, tail: bytes, retry: int) -> Message:
        record = Queue.put_record(self, tail, retry)
        self.journal.append(b"E %b %d %d%b" % (self.name, record.seq, retry, tail))
        return record

    def snapshot_lines(self, leased: Iterable[tuple[int, Item]] = ()) -> Iterator[bytes]:
        """This queue's live state as snapshot records: held messages (by consumers or leases) first,
        then waiting ones."""
        yield queue_line(self)
        yield b"N %b %d" % (self.name, self.next_seq)
        name = self.name
        held = sorted([*((seq, item) for consumer in self.consumers for seq, item in consumer.unacked.items()),
                       *leased], key=itemgetter(0))
        for seq, item in held:
            message = item if isinstance(item, Message) else Message(seq, 0, item)
            yield b"M %b %d %d 1%b" % (name, seq, message.retry, message.tail)
        first_plain = self.next_seq - (self.depth() - self.requeued)
        for item in self.messages:
            if isinstance(item, Message):
                yield b"M %b %d %d 0%b" % (name, item.seq, item.retry, item.tail)
            else:
                for tail in (item.split(b"\n") if type(item) is Packed else (item,)):
                    yield b"M %b %d 0 0%b" % (name, first_plain, tail)
                    first_plain += 1


class DurableBroker(Broker):
    """A worker whose every durable change is also a record in the journal."""

    def __init__(self, *args: Any, journal: Journal, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.journal = journal

    def new_queue(self, name: bytes) -> Queue:
        return DurableQueue(name, self.journal)

    def publish(self, msg_id: bytes, event: bytes, tail: bytes) -> None:
        self.published += 1
        queues = self.route_cache.get(event)
        if queues is None:
            queues = self.routing.route(event)
        if len(queues) == 1:
            self.publish_one(queues[0], msg_id, tail)
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
                refs.append(b"%b -%d" % (queue.name, seq))  # "-": delivered at once and held
            else:
                refs.append(b"%b %d" % (queue.name, seq))
        self.queued += len(queues)
        if refs:
            # one record per publish, held or not (measured: a D record of its own per message
            # was a third of the durable path's extra CPU in w5)
            if len(refs) == 1:
                self.journal.append(b"P 1 %b%b" % (refs[0], tail))
            else:
                self.journal.append(b"P %d %b%b" % (len(refs), b" ".join(refs), tail))

    def publish_one(self, queue: Queue, msg_id: bytes, tail: bytes) -> None:
        """`publish` for an event bound to one queue, the common case: no list, one format."""
        self.queued += 1
        seq = queue.next_seq
        delivered = queue.put(tail, msg_id)
        if not delivered:
            if delivered is not None:  # None: refused, the queue is at its --max-length
                self.journal.append(b"P 1 %b %d%b" % (queue.name, seq, tail))
            return
        self.consumed += 1
        if queue.next_seq == seq:
            return  # delivered to an auto-ack consumer at once: gone, never written
        consumers = queue.consumers
        if consumers[0].manual_ack if len(consumers) == 1 else holds(queue, seq):
            self.journal.append(b"P 1 %b -%d%b" % (queue.name, seq, tail))

    def rebind(self, queue: Queue, *args: Any, **kwargs: Any) -> bool:
        changed = super().rebind(queue, *args, **kwargs)
        if changed:
            self.journal.append(queue_line(queue))
        return changed

    def consume(self, consumer: Consumer, replace: list[bytes], add: list[bytes] | None,
                limits: dict[str, int | None] | None = None) -> None:
        queue = consumer.queue
        setting = queue.delete_when_unused_seconds
        super().consume(consumer, replace, add, limits)
        if queue.delete_when_unused_seconds != setting:
            self.journal.append(queue_line(queue))

    def limits_changed(self, queue: Queue) -> None:
        self.journal.append(queue_line(queue))  # before the dead letters it may cause, as replay needs
        super().limits_changed(queue)

    def park(self, queue: Queue, due_ms: int, records: list[Message]) -> None:
        fields = [b"Y", queue.name, b"%d" % due_ms]
        for record in records:
            fields += [b"%d" % record.seq, b"%d" % record.retry]
        self.journal.append(b" ".join(fields))
        super().park(queue, due_ms, records)

    def dead_letters_moved(self, queue: Queue, taken: list[tuple[int, Item]]) -> None:
        # after their E records (a crash between the two repeats a dead letter, never loses one); a queue
        # deleted while another worker took them was logged whole (X)
        if self.queues.get(queue.name) is queue:
            self.journal.append(b" ".join([b"A", queue.name, *(b"%d" % seq for seq, _ in taken)]))

    def ack(self, consumer: Consumer, msg_ids: list[bytes]) -> list[bytes]:
        unknown: list[bytes] = []
        seqs = consumer.take_acked(msg_ids, unknown)
        if seqs:
            self.journal.append(b"A %b %b" % (consumer.queue.name, b" ".join([b"%d" % seq for seq in seqs])))
        self.acked += len(seqs)
        if consumer.prefetch:
            self.pump(consumer.queue)
        return unknown

    def ack_all(self, consumer: Consumer) -> None:
        taken = consumer.take_all_unacked()
        if taken:
            self.journal.append(b" ".join([b"A", consumer.queue.name, *(b"%d" % seq for seq, _ in taken)]))
        self.acked += len(taken)
        self.pump(consumer.queue)

    def delete_queue(self, name: bytes) -> bool:
        deleted = super().delete_queue(name)
        if deleted:
            self.journal.append(b"X " + name)
        return deleted

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "log": self.journal.stats()}


class Recovered:
    """One queue as replay rebuilds it."""

    __slots__ = ("events", "seconds", "limits", "messages", "front", "parked", "next_seq")

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.seconds: float | None = None
        self.limits: dict[str, int | None] = {"max_retries": None, "max_length": None}
        self.messages: dict[int, list] = {}  # seq -> [tail, retry, held]
        self.front: list[int] = []  # requeued seqs, front first (may hold stale entries)
        self.parked: dict[int, int] = {}  # seq -> the Unix ms it comes back (rejected with --delay)
        self.next_seq = 0


class Recovery:
    """The whole state as replay rebuilds it: the queues, and what the process keeps above them."""

    __slots__ = ("queues", "delayed", "schedules")

    def __init__(self) -> None:
        self.queues: dict[bytes, Recovered] = {}
        self.delayed: dict[int, list[bytes]] = {}  # due Unix ms -> the tails published then
        self.schedules: dict[bytes, bytes] = {}  # name -> its last K record


def recover(records: Iterable[bytes]) -> Recovery:
    """Replay records into queue states; a record about an unknown seq or queue is skipped."""
    recovery = Recovery()
    queues = recovery.queues
    delayed = recovery.delayed
    before_snapshot: Recovery | None = None  # the state an unfinished snapshot (SB, no SE yet) would replace

    def queue(name: bytes) -> Recovered:
        found = queues.get(name)
        if found is None:
            found = queues[name] = Recovered()
        return found

    for line in records:
        kind = line[:1]
        if kind == b"P":
            _, count, rest = line.split(b" ", 2)
            parts = rest.split(b" ", 2 * int(count))
            tail = b" " + parts[-1]
            for i in range(0, len(parts) - 1, 2):
                q, seq_text = queue(parts[i]), parts[i + 1]
                held = seq_text[:1] == b"-"  # delivered at once to a consumer that acks
                seq = int(seq_text[1:] if held else seq_text)
                q.messages[seq] = [tail, 0, held]
                q.next_seq = max(q.next_seq, seq + 1)
        elif kind in (b"D", b"A"):
            fields = line.split(b" ")
            found = queues.get(fields[1])
            if found is None:
                continue
            for seq_text in fields[2:]:
                seq = int(seq_text)
                if kind == b"A":
                    found.messages.pop(seq, None)
                elif seq in found.messages:
                    found.messages[seq][2] = True
        elif kind == b"R":
            fields = line.split(b" ")
            found = queues.get(fields[1])
            if found is None:
                continue
            requeued = []
            for i in range(2, len(fields), 2):
                seq, retry = int(fields[i]), int(fields[i + 1])
                message = found.messages.get(seq)
                if message is not None:
                    message[1], message[2] = retry, False
                    found.parked.pop(seq, None)
                    requeued.append(seq)
            found.front[:0] = requeued
        elif kind == b"Y":
            fields = line.split(b" ")
            found = queues.get(fields[1])
            if found is None:
                continue
            due_ms = int(fields[2])
            for i in range(3, len(fields), 2):
                seq, retry = int(fields[i]), int(fields[i + 1])
                message = found.messages.get(seq)
                if message is not None:
                    message[1], message[2] = retry, False
                    found.parked[seq] = due_ms
        elif kind == b"T":
            due_text, space, tail = line[2:].partition(b" ")
            delayed.setdefault(int(due_text), []).append(space + tail)
        elif kind == b"F":
            delayed.pop(int(line[2:]), None)
        elif kind == b"K":
            recovery.schedules[line[2:].partition(b" ")[0]] = line
        elif kind == b"U":
            recovery.schedules.pop(line[2:], None)
        elif kind == b"Q":
            fields = line.split(b" ")
            q = queue(fields[1])
            q.seconds = None if fields[2] == b"-" else float(fields[2])
            q.events = [event for event in fields[3:] if not event.startswith(b"--")]
            q.limits = {"max_retries": None, "max_length": None}
            for setting in fields[3:]:
                if setting.startswith(b"--"):
                    name, _, value = setting[2:].partition(b"=")
                    q.limits[name.decode().replace("-", "_")] = int(value)
        elif kind == b"E":
            _, name, seq_text, rest = line.split(b" ", 3)
            retry_text, space, tail = rest.partition(b" ")
            q, seq = queue(name), int(seq_text)
            q.messages[seq] = [space + tail, int(retry_text), False]
            q.next_seq = max(q.next_seq, seq + 1)
        elif kind == b"X":
            queues.pop(line[2:], None)
        elif kind == b"S":
            if line == b"SB":  # rebuilt apart: a crash before SE leaves the state before it whole
                before_snapshot, recovery = recovery, Recovery()
                queues, delayed = recovery.queues, recovery.delayed
            elif line == b"SE":
                before_snapshot = None
            else:
                queues.clear()
                delayed.clear()
                recovery.schedules.clear()
        elif kind == b"N":
            _, name, seq_text = line.split(b" ")
            queue(name).next_seq = int(seq_text)
        elif kind == b"M":
            _, name, seq_text, retry_text, rest = line.split(b" ", 4)
            q, seq, retry = queue(name), int(seq_text), int(retry_text)
            q.messages[seq] = [rest[1:], retry, rest[:1] == b"1"]
            q.next_seq = max(q.next_seq, seq + 1)
            if retry and rest[:1] == b"0":
                q.front.append(seq)  # a requeued one: the snapshot lists them front first
        else:
            raise ValueError(f"unknown record {line[:40]!r}")
    if before_snapshot is not None:
        # the log's older segments go only once a snapshot is whole, so they are all still here
        log.warning("the log ends inside a snapshot (a crash while it was written): it is ignored, and the "
                    "state is rebuilt from the records before it")
        return before_snapshot
    return recovery


def rebuild(recovered: dict[bytes, Recovered], broker_for: Callable[[bytes], Broker]) -> tuple[int, int]:
    """Put recovered queues into their workers; returns (queues, messages).

    Order at the front of each queue: messages that were held un-acked (retry raised, as a
    disconnect would), then requeued ones in the order they went back, then the rest by seq.
    """
    total = 0
    for name, state in recovered.items():
        broker = broker_for(name)
        queue = broker.queue(name)
        Broker.rebind(broker, queue, replace=state.events or None)  # already in the log: not again
        queue.delete_when_unused_seconds = state.seconds
        queue.max_retries = state.limits["max_retries"]
        queue.max_length = state.limits["max_length"]
        messages = state.messages
        held = sorted(seq for seq, m in messages.items() if m[2])
        seen: set[int] = set(held) | state.parked.keys()
        parked_by_due: dict[int, list[Message]] = {}
        for seq, due_ms in sorted(state.parked.items()):
            tail, retry, _ = messages[seq]
            parked_by_due.setdefault(due_ms, []).append(Message(seq, retry, tail))
        for due_ms, parked in parked_by_due.items():
            Broker.park(broker, queue, due_ms, parked)  # already in the log: not again
        front = []
        for seq in state.front:
            if seq in messages and seq not in seen:
                seen.add(seq)
                front.append(seq)
        rest = sorted(seq for seq in messages if seq not in seen)
        # the newest never-delivered messages with consecutive seqs and nothing live above them
        # go back as plain tails, packed as a deep queue packs them (records cost ~2.5x the
        # memory); their seq stays implicit, so the queue's next seq follows the last of them
        plain_from = len(rest)
        while plain_from and messages[rest[plain_from - 1]][1] == 0 and (
                plain_from == len(rest) or rest[plain_from - 1] == rest[plain_from] - 1):
            plain_from -= 1
        if rest and max(held[-1:] + front + list(state.parked), default=-1) > rest[-1]:
            plain_from = len(rest)  # a live record above them: keep every seq explicit
        records = []
        for seq in held:
            tail, retry, _ = messages[seq]
            records.append(Message(seq, retry + 1, tail))
        for seq in front + rest[:plain_from]:
            tail, retry, _ = messages[seq]
            records.append(Message(seq, retry, tail))
        queue.messages.extend(records)
        queue.requeued = len(records)
        plain = [messages[seq][0] for seq in rest[plain_from:]]
        runs = len(plain) // PACK_TAILS if len(plain) >= PACK_MIN_DEPTH else 0
        for i in range(runs):
            queue.messages.append(Packed(b"\n".join(plain[i * PACK_TAILS : (i + 1) * PACK_TAILS])))
        queue.packed_extra += runs * (PACK_TAILS - 1)
        queue.messages.extend(plain[runs * PACK_TAILS :])
        queue.appended_since_pack = len(plain) - runs * PACK_TAILS
        if plain:
            queue.next_seq = rest[-1] + 1
        else:
            queue.next_seq = max(state.next_seq, queue.next_seq)
        total += len(records) + len(plain)
    for name in recovered:
        # a copy held at the crash came back with retry raised: past max_retries it is a dead letter,
        # moved only now that every queue, its dead-letter queue included, is rebuilt
        broker = broker_for(name)
        queue = broker.queues[name]
        if queue.max_retries is not None:
            broker.limits_changed(queue)
    return len(recovered), total

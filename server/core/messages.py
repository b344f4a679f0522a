"""A queue's storage: the messages waiting in it, in order, with the fewest objects and bytes.

A message is stored as its *tail*, the bytes after the consumer id of a delivery:
`b" ok {msg_id} event={event} {data}"`, built once per publish and shared by every queue that
gets a copy. A deep queue packs runs of tails into one `Packed` bytes object, which saves the ~45
bytes of object and deque overhead each message would cost on its own, and stores the header its
tails repeat once: `{header}\n{msg_id}\xff{data}\n...` (see `pack`). Every copy put into a queue
gets the queue's next sequence number (`seq`): a message never delivered is a bare tail whose seq
is implicit (waiting tails hold consecutive seqs, oldest first); one that came back (requeued, a
dead letter) is a `Message` record carrying its seq and retry counter, always at the front. No
sockets, no consumers: state.py's Queue adds those.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Final, TypeAlias

from mypy_extensions import mypyc_attr

from ..journal import records
from ..wire.protocol import msg_id_of, with_field

# tails per Packed run: ~128 KiB of 100-byte messages, past glibc's mmap threshold, so a run
# gets pages of its own instead of pinning holes in the heap (measured, 1M queued messages:
# 256-tail runs gave 134 or 183 bytes/msg from run to run, 1024-tail runs 128 every time)
PACK_TAILS: Final = 1024
PACK_MIN_DEPTH: Final = 4096  # shallower queues are left alone: they drain soon anyway
NEWLINE: Final = b"\n"
OK: Final = b" ok "
NEWLINE_OK: Final = b"\n ok "
SPACE: Final = 32  # b" "[0]
EQUALS: Final = 61  # b"="[0]
# stands for ` event={header} ` in a packed run: UTF-8 never holds a 0xff byte, and every line was checked as UTF-8
HEADER_MARK: Final = b"\xff"


@mypyc_attr(native_class=False)  # the compiled build (setup.py) cannot make a bytes subclass a native class
class Packed(bytes):
    """A run of tails in one queue item standing for several messages (made by `pack`, read by `unpack`)."""

    __slots__ = ()


def pack(tails: list[bytes], msg_ids: list[bytes]) -> Packed:
    """The tails (oldest first; `msg_ids` are theirs) as one run: the header they share, then per tail
    `{msg_id}\\xff{data}`, the ` ok ` and ` event={header} ` around the id left out (`unpack` puts them back);
    newlines between them.

    The tails joined by newlines as they are if they do not share one header, or one holds a 0xff byte (no
    line from a client can). Per tail one slice of its data and native byte compares: no search through
    its data (a `bytes.replace` of the header cost 200 ns a message, 30 times a join's share).
    """
    # `in` is a memchr over a join: 8 ns a message, where the run's `count` of its marks took 41
    if HEADER_MARK in NEWLINE.join(tails):
        return _joined(tails)
    first = tails[0]
    start = len(msg_ids[0]) + 11  # ` ok {msg_id} event=`
    end = start
    while end < len(first) and first[end] != SPACE:
        end += 1
    header = first[start:end]
    header_bytes = len(header)
    parts: list[bytes] = [header]
    for i, tail in enumerate(tails):
        msg_id = msg_ids[i]
        at = len(msg_id) + 11
        data = at + header_bytes + 1
        # ` ok {msg_id} event=` is how every tail starts (Queue.put's contract): its last byte is checked
        if len(tail) < data or tail[data - 1] != SPACE or tail[at - 1] != EQUALS:
            return _joined(tails)
        j = 0
        while j < header_bytes and tail[at + j] == header[j]:
            j += 1
        if j != header_bytes:
            return _joined(tails)
        parts.append(NEWLINE)
        parts.append(msg_id)
        parts.append(HEADER_MARK)
        parts.append(tail[data:])
    return Packed(b"".join(parts))


def _joined(tails: list[bytes]) -> Packed:
    return Packed(NEWLINE.join(tails))


def unpack(run: bytes) -> list[bytes]:
    """The tails of a `pack`ed run, oldest first, as they were given."""
    if run.startswith(OK):
        return run.split(NEWLINE)  # packed as they were
    header = run[: run.index(NEWLINE)]
    tails = run.replace(NEWLINE, NEWLINE_OK).replace(HEADER_MARK, b" event=%b " % header).split(NEWLINE)
    del tails[0]  # the header's line
    return tails


class Message:
    """A message copy that came back to its queue: the tail as published, its seq, its retry counter."""

    __slots__ = ("seq", "retry", "tail")

    def __init__(self, seq: int, retry: int, tail: bytes) -> None:
        self.seq = seq
        self.retry = retry
        self.tail = tail  # as published: never holds a retry field

    def delivery_tail(self) -> bytes:
        """The tail with `,retry={n}` after the event, built from the fields (none while retry is 0)."""
        tail = self.tail
        if not self.retry:
            return tail  # a message recovered from the log that was never delivered
        return with_field(tail, b",retry=%d" % self.retry)


Item: TypeAlias = "bytes | Message"  # what a queue holds and un-acked maps keep


def retry_of(item: Item) -> int:
    return item.retry if type(item) is Message else 0


class MessageStore:
    """The messages of one queue: requeued `Message` records first, then tails and `Packed` runs of tails.

    With --data-dir, `record` (the journal's append) hears of every requeue and dead letter.
    """

    __slots__ = ("name", "messages", "packed_extra", "newest", "newest_ids", "next_seq", "requeued", "record")

    def __init__(self, name: bytes) -> None:
        self.name = name
        self.messages: deque[Any] = deque()  # requeued Messages first, then tails and Packed runs of tails
        self.packed_extra = 0  # messages inside Packed items beyond one per item
        # a deep queue's newest tails, behind `messages`, until PACK_TAILS of them make a run: a list, not the
        # deque, whose append and pop are calls by name when compiled. Never held while `messages` is empty
        self.newest: list[bytes] = []
        self.newest_ids: list[bytes] = []  # their msg ids
        self.next_seq = 0  # the seq the next copy put into this queue gets
        self.requeued = 0  # Message records waiting (all at the front)
        # the journal's append with --data-dir (deliveries, requeues and dead letters are records); None: in memory
        self.record: Callable[[bytes], None] | None = None

    def append(self, tail: bytes, msg_id: bytes) -> None:
        """Keep a tail (` ok {msg_id} ...`) at the back with the next seq (waiting tails hold consecutive seqs
        ending at next_seq - 1)."""
        self.next_seq += 1
        newest = self.newest
        if newest or len(self.messages) + self.packed_extra >= PACK_MIN_DEPTH:
            newest.append(tail)
            self.newest_ids.append(msg_id)
            if len(newest) >= PACK_TAILS:
                self.messages.append(pack(newest, self.newest_ids))  # a pack that raises keeps them all
                self.packed_extra += len(newest) - 1
                newest.clear()  # kept, with the room it grew to
                self.newest_ids.clear()
        else:
            self.messages.append(tail)

    def spill(self) -> None:
        """The newest tails into `messages` as they are, for whoever reads every waiting item there in order."""
        if self.newest:
            self.messages.extend(self.newest)
            self.newest = []
            self.newest_ids = []

    def items(self) -> deque[Any]:
        """Every waiting item in order: requeued `Message` records, tails and `Packed` runs of tails."""
        self.spill()
        return self.messages

    def _unpack_front(self) -> None:
        tails = unpack(self.messages.popleft())
        self.packed_extra -= len(tails) - 1
        self.messages.extendleft(reversed(tails))

    def front_size(self) -> int:
        """The size of the front message's tail as published; 0 if the store is empty."""
        messages = self.messages
        if not messages:
            return 0
        if type(messages[0]) is Packed:
            self._unpack_front()
        front = messages[0]
        return len(front.tail) if type(front) is Message else len(front)

    def depth(self) -> int:
        """Messages waiting in the queue."""
        return len(self.messages) + self.packed_extra + len(self.newest)

    def pop(self) -> tuple[int, Item]:
        """The front message with its seq (the queue must not be empty)."""
        messages = self.messages
        if type(messages[0]) is Packed:
            self._unpack_front()
        item = messages.popleft()
        if not messages and self.newest:
            self.spill()
        if type(item) is Message:
            self.requeued -= 1
            return item.seq, item
        # the waiting tails, this one included, end at next_seq - 1
        return self.next_seq - (len(messages) + self.packed_extra + len(self.newest) + 1 - self.requeued), item

    def take_tails(self, max_count: int, max_bytes: int, first_goes: bool) -> tuple[int, list[bytes], int]:
        """Never-delivered tails off the front, whole Packed runs at a time: (the first one's seq, the tails, their
        bytes); none while a record is in front. At most `max_count` and `max_bytes` (the first one whatever its
        size when `first_goes`); the tails taken hold consecutive seqs."""
        messages = self.messages
        first = self.next_seq - (len(messages) + self.packed_extra + len(self.newest))
        taken: list[bytes] = []
        size = 0
        if self.requeued:
            return first, taken, size
        while len(taken) < max_count:
            if not messages:
                if not self.newest:
                    break
                self.spill()
            item = messages.popleft()
            if type(item) is Packed:
                tails = unpack(item)
                self.packed_extra -= len(tails) - 1
                run_bytes = 0
                for tail in tails:
                    run_bytes += len(tail)
                if len(taken) + len(tails) <= max_count and size + run_bytes <= max_bytes:
                    taken += tails
                    size += run_bytes
                    continue
                messages.extendleft(reversed(tails))  # the run does not fit whole: tail by tail
                item = messages.popleft()
            length = len(item)
            if size + length > max_bytes and (taken or not first_goes):
                messages.appendleft(item)
                break
            taken.append(item)
            size += length
        if not messages:
            self.spill()
        return first, taken, size

    def requeue(self, taken: list[tuple[int, Item]]) -> None:
        """Put messages back at the front, in the order given, with retry raised."""
        self.put_front([Message(seq, item.retry + 1, item.tail) if isinstance(item, Message) else Message(seq, 1, item)
                        for seq, item in taken])

    def put_front(self, returned: list[Message]) -> None:
        """Put records at the front as they are, in the order given."""
        self.messages.extendleft(reversed(returned))
        self.requeued += len(returned)
        if self.record is not None and returned:
            self.record(records.requeued(self.name, returned))

    def put_record(self, tail: bytes, retry: int) -> Message:
        """Put a message that keeps its retry counter (a dead letter) at the back, with the next seq.

        Records sit in front of plain tails (whose seqs are implicit), so plain tails waiting
        here are first made records too: each tail is converted at most once, and a queue
        that only ever gets records, as a dead-letter queue does, converts nothing.
        """
        if self.depth() > self.requeued:
            self._make_explicit()
        record = Message(self.next_seq, retry, tail)
        self.next_seq += 1
        self.messages.append(record)
        self.requeued += 1
        if self.record is not None:
            self.record(records.dead_letter(self.name, record.seq, retry, tail))
        return record

    def _make_explicit(self) -> None:
        self.spill()
        messages = self.messages
        records = [messages.popleft() for _ in range(self.requeued)]
        seq = self.next_seq - (len(messages) + self.packed_extra)
        for item in messages:
            for tail in (unpack(item) if type(item) is Packed else (item,)):
                records.append(Message(seq, 0, tail))
                seq += 1
        messages.clear()
        messages.extend(records)
        self.requeued = len(records)
        self.packed_extra = 0

    def take_front_over(self, max_retries: int) -> list[Message]:
        """Remove the records at the front whose retry is past `max_retries` (a lowered setting)."""
        messages = self.messages
        front = [messages.popleft() for _ in range(self.requeued)]
        self.requeued = 0
        if not messages:
            self.spill()
        self.put_front([record for record in front if record.retry <= max_retries])
        return [record for record in front if record.retry > max_retries]

    def take_waiting(self, limit: int | None = None, msg_ids: set[bytes] | None = None) -> list[tuple[int, Item]]:
        """Remove waiting messages, oldest first, with their seqs: all, the first `limit`, or those with `msg_ids`
        (an operator's purge or requeue of dead letters; the copies consumers hold stay theirs)."""
        if msg_ids is not None:
            if self.depth() > self.requeued:
                self._make_explicit()
            kept: list[Message] = []
            taken: list[tuple[int, Item]] = []
            for record in self.messages:  # every one a record now: one pass sorts them
                if msg_id_of(record.tail) in msg_ids:
                    taken.append((record.seq, record))
                else:
                    kept.append(record)
            self.messages.clear()
            self.messages.extend(kept)
            self.requeued = len(kept)
            return taken
        count = self.depth() if limit is None else min(limit, self.depth())
        if count == self.depth():
            taken = [self.pop() for _ in range(count)]
            self.clear()
            return taken
        return [self.pop() for _ in range(count)]

    def restore(self, front: list[Message], plain: list[bytes], next_seq: int) -> None:
        """Refill an empty store as recovery found it: `front` records (held, requeued, explicit seqs) first, then
        `plain` never-delivered tails with consecutive seqs ending at `next_seq - 1`, packed as a deep queue packs."""
        messages = self.messages
        messages.extend(front)
        self.requeued = len(front)
        runs = len(plain) // PACK_TAILS if len(plain) >= PACK_MIN_DEPTH else 0
        for i in range(runs):
            run = plain[i * PACK_TAILS : (i + 1) * PACK_TAILS]
            messages.append(pack(run, [msg_id_of(tail) for tail in run]))
        self.packed_extra += runs * (PACK_TAILS - 1)
        messages.extend(plain[runs * PACK_TAILS :])
        self.next_seq = next_seq

    def clear(self) -> None:
        """Forget every message (the queue was deleted)."""
        self.messages.clear()
        self.packed_extra = 0
        self.newest = []
        self.newest_ids = []
        self.requeued = 0

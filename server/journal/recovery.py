"""The log's records replayed into queue states (core/restore.py puts them into the
broker).

`recover` applies each record through `APPLY`, a table from its kind to one small function
over the records' decoders (records.py). A record about an unknown seq or queue is skipped.
`recover_batches` takes the records as they come off a replicated log, a list per read (a standby applies every
frame its owner stores): each list in one pass, with no generator resumed per record, and a one-copy publish (nearly
every record a standby applies) read in its loop, with no call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from . import records

log = logging.getLogger("mqks.durable")


class Recovered:
    """One queue as replay rebuilds it."""

    __slots__ = ("events", "seconds", "limits", "messages", "front", "parked", "next_seq")

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.seconds: float | None = None
        self.limits: dict[str, int | None] = {"max_retries": None, "max_length": None}
        # seq -> its tail while it is as published (retry 0, not held: most messages, and a standby applies every
        # publish its owner stores), else [tail, retry, held]
        self.messages: dict[int, bytes | list] = {}
        self.front: list[int] = []  # requeued seqs, front first (may hold stale entries)
        self.parked: dict[int, int] = {}  # seq -> the Unix ms it comes back (rejected with --delay)
        self.next_seq = 0


class Recovery:
    """The whole state as replay rebuilds it: the queues, and what the process keeps above them."""

    __slots__ = ("queues", "delayed", "schedules", "before_snapshot")

    def __init__(self) -> None:
        self.queues: dict[bytes, Recovered] = {}
        self.delayed: dict[int, list[bytes]] = {}  # due Unix ms -> the tails published then
        self.schedules: dict[bytes, bytes] = {}  # name -> its last K record
        # the state an unfinished snapshot (SB, no SE yet) would replace
        self.before_snapshot: Recovery | None = None

    def queue(self, name: bytes) -> Recovered:
        found = self.queues.get(name)
        if found is None:
            found = self.queues[name] = Recovered()
        return found

    def forget_all(self) -> None:
        self.queues = {}
        self.delayed = {}
        self.schedules = {}


def fields(message: bytes | list) -> tuple[bytes, int, bool]:
    """(tail, retry, held) of a Recovered.messages entry."""
    if isinstance(message, bytes):
        return message, 0, False
    return message[0], message[1], message[2]


def _changing(messages: dict[int, bytes | list], seq: int) -> list | None:
    """The entry of `seq` as [tail, retry, held], to be changed in place; None if there is none."""
    found = messages.get(seq)
    if isinstance(found, bytes):
        found = messages[seq] = [found, 0, False]
    return found


def apply_published(state: Recovery, line: bytes) -> None:
    """A P record of several copies (recover_batches reads a one-copy record in place, in its loop)."""
    copies, tail = records.decode_published(line)
    for name, seq, held in copies:  # held: delivered at once to a consumer that acks
        q = state.queue(name)
        q.messages[seq] = [tail, 0, True] if held else tail
        q.next_seq = max(q.next_seq, seq + 1)


def apply_delivered(state: Recovery, line: bytes) -> None:
    name, seqs = records.decode_seqs(line)
    found = state.queues.get(name)
    if found is not None:
        messages = found.messages
        for seq in seqs:
            message = _changing(messages, seq)
            if message is not None:
                message[2] = True


def apply_gone(state: Recovery, line: bytes) -> None:
    name, seqs = records.decode_seqs(line)
    found = state.queues.get(name)
    if found is not None:
        for seq in seqs:
            found.messages.pop(seq, None)


def apply_requeued(state: Recovery, line: bytes) -> None:
    name, pairs = records.decode_requeued(line)
    found = state.queues.get(name)
    if found is None:
        return
    requeued = []
    for seq, retry in pairs:
        message = _changing(found.messages, seq)
        if message is not None:
            message[1], message[2] = retry, False
            found.parked.pop(seq, None)
            requeued.append(seq)
    found.front[:0] = requeued


def apply_parked(state: Recovery, line: bytes) -> None:
    name, due_ms, pairs = records.decode_parked(line)
    found = state.queues.get(name)
    if found is None:
        return
    for seq, retry in pairs:
        message = _changing(found.messages, seq)
        if message is not None:
            message[1], message[2] = retry, False
            found.parked[seq] = due_ms


def apply_delayed(state: Recovery, line: bytes) -> None:
    due_ms, tail = records.decode_delayed(line)
    state.delayed.setdefault(due_ms, []).append(tail)


def apply_delayed_fired(state: Recovery, line: bytes) -> None:
    state.delayed.pop(records.decode_delayed_fired(line), None)


def apply_schedule(state: Recovery, line: bytes) -> None:
    state.schedules[records.decode_schedule(line)[0]] = line  # its last K record is its whole state


def apply_schedule_removed(state: Recovery, line: bytes) -> None:
    state.schedules.pop(records.decode_schedule_removed(line), None)


def apply_queue(state: Recovery, line: bytes) -> None:
    name, seconds, events, limits = records.decode_queue(line)
    q = state.queue(name)
    q.seconds, q.events, q.limits = seconds, events, limits


def apply_dead_letter(state: Recovery, line: bytes) -> None:
    name, seq, retry, tail = records.decode_dead_letter(line)
    q = state.queue(name)
    q.messages[seq] = [tail, retry, False]
    q.next_seq = max(q.next_seq, seq + 1)


def apply_queue_deleted(state: Recovery, line: bytes) -> None:
    state.queues.pop(records.decode_queue_deleted(line), None)


def apply_snapshot(state: Recovery, line: bytes) -> None:
    if line == records.SNAPSHOT_BEGIN:  # rebuilt apart: a crash before SE leaves the state before it whole
        before = Recovery()
        before.queues, before.delayed, before.schedules = state.queues, state.delayed, state.schedules
        state.before_snapshot = before
        state.forget_all()
    elif line == records.SNAPSHOT_END:
        state.before_snapshot = None
    else:
        state.forget_all()


def apply_next_seq(state: Recovery, line: bytes) -> None:
    name, seq = records.decode_next_seq(line)
    state.queue(name).next_seq = seq


def apply_live(state: Recovery, line: bytes) -> None:
    name, seq, retry, held, tail = records.decode_live(line)
    q = state.queue(name)
    q.messages[seq] = [tail, retry, held] if retry or held else tail
    q.next_seq = max(q.next_seq, seq + 1)
    if retry and not held:
        q.front.append(seq)  # a requeued one: the snapshot lists them front first


def apply_writer(state: Recovery, line: bytes) -> None:
    before = state.before_snapshot
    if before is not None:  # the writer that began it was taken over: nothing of it after SB counts
        log.warning("a snapshot was cut short by a takeover of the log: it is ignored")
        state.queues, state.delayed, state.schedules = before.queues, before.delayed, before.schedules
        state.before_snapshot = None


APPLY: dict[bytes, Callable[[Recovery, bytes], None]] = {
    records.PUBLISHED: apply_published,
    records.DELIVERED: apply_delivered,
    records.GONE: apply_gone,
    records.REQUEUED: apply_requeued,
    records.PARKED: apply_parked,
    records.DELAYED: apply_delayed,
    records.DELAYED_FIRED: apply_delayed_fired,
    records.SCHEDULE: apply_schedule,
    records.SCHEDULE_REMOVED: apply_schedule_removed,
    records.QUEUE: apply_queue,
    records.DEAD_LETTER: apply_dead_letter,
    records.QUEUE_DELETED: apply_queue_deleted,
    records.SNAPSHOT: apply_snapshot,
    records.NEXT_SEQ: apply_next_seq,
    records.LIVE: apply_live,
    records.WRITER: apply_writer,
}


def recover(lines: Iterable[bytes]) -> Recovery:
    """Replay records into queue states; a record about an unknown seq or queue is skipped."""
    return recover_batches((lines,))


def recover_batches(batches: Iterable[Iterable[bytes]]) -> Recovery:
    """Replay batches of records, in order, into queue states: `recover` of their records one after the other."""
    state = Recovery()
    get_handler = APPLY.get
    queues = state.queues
    for batch in batches:
        for line in batch:
            if line[:1] == b"P":
                # one copy, `P 1 {queue} [-]{seq}{tail}`, nearly every record a standby applies: read in place
                # here, with no call (1.6 -> 0.8 us a record read in place, and less again without the calls), cut
                # by one split (two index calls and a slice before: 660 -> 530 ns a record, 300,000 in batches of
                # 100 under the bench lock)
                parts = line.split(b" ", 4)
                if len(parts) == 5 and parts[1] == b"1":
                    name, seq_text = parts[2], parts[3]
                    q = queues.get(name)
                    if q is None:
                        q = queues[name] = Recovered()
                    tail = line[5 + len(name) + len(seq_text):]  # from the space before the tail's first field
                    if seq_text[0] == 45:  # b"-": delivered at once to a consumer that acks, held
                        seq = -int(seq_text)
                        q.messages[seq] = [tail, 0, True]
                    else:
                        seq = int(seq_text)
                        q.messages[seq] = tail
                    if seq >= q.next_seq:
                        q.next_seq = seq + 1
                    continue
            handler = get_handler(line[:1])
            if handler is None:
                raise ValueError(f"unknown record {line[:40]!r}")
            handler(state, line)
            queues = state.queues  # a snapshot's start puts a new table in
    before = state.before_snapshot
    if before is not None:
        # the log's older segments go only once a snapshot is whole, so they are all still here
        log.warning("the log ends inside a snapshot (a crash while it was written): it is ignored, and the "
                    "state is rebuilt from the records before it")
        return before
    return state

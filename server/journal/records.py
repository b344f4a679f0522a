"""Every record kind of the write-ahead log, an encode beside
its decode.

A record is one text line (a tail never holds a newline), its kind the first byte:

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
    W {epoch} {owner}                     (replicated log) a broker took the log over: a snapshot begun
                                          before it and never ended is dropped

Retry counts are absolute, so a replay never counts twice. recovery.py applies them; the
journal (journal.py) frames and stores them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

QUEUE: Final[bytes] = b"Q"
QUEUE_DELETED: Final[bytes] = b"X"
PUBLISHED: Final[bytes] = b"P"
DELIVERED: Final[bytes] = b"D"
GONE: Final[bytes] = b"A"
REQUEUED: Final[bytes] = b"R"
PARKED: Final[bytes] = b"Y"
DELAYED: Final[bytes] = b"T"
DELAYED_FIRED: Final[bytes] = b"F"
SCHEDULE: Final[bytes] = b"K"
SCHEDULE_REMOVED: Final[bytes] = b"U"
DEAD_LETTER: Final[bytes] = b"E"
SNAPSHOT: Final[bytes] = b"S"  # S alone (older logs), SB and SE share the kind
SNAPSHOT_BEGIN: Final[bytes] = b"SB"
SNAPSHOT_END: Final[bytes] = b"SE"
NEXT_SEQ: Final[bytes] = b"N"
LIVE: Final[bytes] = b"M"
WRITER: Final[bytes] = b"W"


def seq_list(seqs: Iterable[int]) -> bytes:
    return b" ".join([b"%d" % seq for seq in seqs])


def seq_retry_pairs(records: Iterable[Any]) -> list[bytes]:
    """`{seq} {retry}` fields of Message records."""
    fields: list[bytes] = []
    for record in records:
        fields += [b"%d" % record.seq, b"%d" % record.retry]
    return fields


def decode_pairs(fields: list[bytes]) -> list[tuple[int, int]]:
    return [(int(fields[i]), int(fields[i + 1])) for i in range(0, len(fields) - 1, 2)]


# -- Q, X: a queue's settings, its deletion -------------------------------------------------------

def queue(name: bytes, seconds: float | None, events: Iterable[bytes], max_retries: int | None,
          max_length: int | None) -> bytes:
    fields = [QUEUE, name, b"-" if seconds is None else repr(seconds).encode(), *events]
    # events never start with "--" (the parser reads those as flags), so settings follow them unambiguously
    if max_retries is not None:
        fields.append(b"--max-retries=%d" % max_retries)
    if max_length is not None:
        fields.append(b"--max-length=%d" % max_length)
    return b" ".join(fields)


def decode_queue(line: bytes) -> tuple[bytes, float | None, list[bytes], dict[str, int | None]]:
    """-> (name, delete-when-unused seconds, events, limits)."""
    fields = line.split(b" ")
    events = [event for event in fields[3:] if not event.startswith(b"--")]
    limits: dict[str, int | None] = {"max_retries": None, "max_length": None}
    for setting in fields[3:]:
        if setting.startswith(b"--"):
            key, _, value = setting[2:].partition(b"=")
            limits[key.decode().replace("-", "_")] = int(value)
    return fields[1], None if fields[2] == b"-" else float(fields[2]), events, limits


def queue_deleted(name: bytes) -> bytes:
    return QUEUE_DELETED + b" " + name


def decode_queue_deleted(line: bytes) -> bytes:
    return line[2:]


# -- P: a publish, once for all its copies --------------------------------------------------------

def ref(name: bytes, seq: int, held: bool) -> bytes:
    """One copy of a P record: `{queue} {seq}`, or `{queue} -{seq}` if it was delivered at once and held."""
    return b"%b -%d" % (name, seq) if held else b"%b %d" % (name, seq)


def published_one(name: bytes, seq: int, held: bool, tail: bytes) -> bytes:
    """`published` of a message with one copy: `P 1 {queue} [-]{seq}{tail}`, in one format."""
    return b"P 1 %b -%d%b" % (name, seq, tail) if held else b"P 1 %b %d%b" % (name, seq, tail)


def published(refs: list[bytes], tail: bytes) -> bytes:
    if len(refs) == 1:
        return b"P 1 %b%b" % (refs[0], tail)
    return b"P %d %b%b" % (len(refs), b" ".join(refs), tail)


def decode_published(line: bytes) -> tuple[list[tuple[bytes, int, bool]], bytes]:
    """-> ([(queue, seq, held)], tail)."""
    _, count, rest = line.split(b" ", 2)
    parts = rest.split(b" ", 2 * int(count))
    copies = []
    for i in range(0, len(parts) - 1, 2):
        seq_text = parts[i + 1]
        held = seq_text[:1] == b"-"
        copies.append((parts[i], int(seq_text[1:] if held else seq_text), held))
    return copies, b" " + parts[-1]


# -- D, A: held for an ack; gone ------------------------------------------------------------------

def delivered(name: bytes, seqs: Iterable[int]) -> bytes:
    return b"D %b %b" % (name, seq_list(seqs))


def gone(name: bytes, seqs: Iterable[int]) -> bytes:
    return b"A %b %b" % (name, b" ".join([b"%d" % seq for seq in seqs]))  # seq_list, inlined: once per ack


def delivered_one(name: bytes, seq: int, held: bool) -> bytes:
    """D (held for an ack) or A (delivered to an auto-ack consumer) of one copy."""
    return b"%b %b %d" % (DELIVERED if held else GONE, name, seq)


def decode_seqs(line: bytes) -> tuple[bytes, list[int]]:
    """D or A -> (queue, seqs)."""
    fields = line.split(b" ")
    return fields[1], [int(seq) for seq in fields[2:]]


# -- R, Y: back at the front, now or at a due time -----------------------------------------------

def requeued(name: bytes, records: Iterable[Any]) -> bytes:
    return b" ".join([REQUEUED, name, *seq_retry_pairs(records)])


def decode_requeued(line: bytes) -> tuple[bytes, list[tuple[int, int]]]:
    """-> (queue, [(seq, retry)])."""
    fields = line.split(b" ")
    return fields[1], decode_pairs(fields[2:])


def parked(name: bytes, due_ms: int, records: Iterable[Any]) -> bytes:
    return b" ".join([PARKED, name, b"%d" % due_ms, *seq_retry_pairs(records)])


def decode_parked(line: bytes) -> tuple[bytes, int, list[tuple[int, int]]]:
    """-> (queue, due Unix ms, [(seq, retry)])."""
    fields = line.split(b" ")
    return fields[1], int(fields[2]), decode_pairs(fields[3:])


# -- T, F: publishes delayed until a due time ---------------------------------------------------

def delayed(due_ms: int, tail: bytes) -> bytes:
    return b"T %d%b" % (due_ms, tail)


def decode_delayed(line: bytes) -> tuple[int, bytes]:
    """-> (due Unix ms, tail)."""
    due_text, space, tail = line[2:].partition(b" ")
    return int(due_text), space + tail


def delayed_fired(due_ms: int) -> bytes:
    return b"F %d" % due_ms


def decode_delayed_fired(line: bytes) -> int:
    return int(line[2:])


# -- K, U: schedules -------------------------------------------------------------------------------

def schedule(name: bytes, state_json: bytes) -> bytes:
    return b"K %b %b" % (name, state_json)


def decode_schedule(line: bytes) -> tuple[bytes, bytes]:
    """-> (name, its state as JSON)."""
    name, _, state_json = line[2:].partition(b" ")
    return name, state_json


def schedule_removed(name: bytes) -> bytes:
    return SCHEDULE_REMOVED + b" " + name


def decode_schedule_removed(line: bytes) -> bytes:
    return line[2:]


# -- E: a dead letter -------------------------------------------------------------------------------

def dead_letter(name: bytes, seq: int, retry: int, tail: bytes) -> bytes:
    return b"E %b %d %d%b" % (name, seq, retry, tail)


def decode_dead_letter(line: bytes) -> tuple[bytes, int, int, bytes]:
    """-> (queue, seq, retry, tail)."""
    _, name, seq_text, rest = line.split(b" ", 3)
    retry_text, space, tail = rest.partition(b" ")
    return name, int(seq_text), int(retry_text), space + tail


# -- N, M: a snapshot's queues ------------------------------------------------------------------------

def next_seq(name: bytes, seq: int) -> bytes:
    return b"N %b %d" % (name, seq)


def decode_next_seq(line: bytes) -> tuple[bytes, int]:
    _, name, seq_text = line.split(b" ")
    return name, int(seq_text)


def live(name: bytes, seq: int, retry: int, held: bool, tail: bytes) -> bytes:
    return b"M %b %d %d %c%b" % (name, seq, retry, 49 if held else 48, tail)


def decode_live(line: bytes) -> tuple[bytes, int, int, bool, bytes]:
    """-> (queue, seq, retry, held, tail)."""
    _, name, seq_text, retry_text, rest = line.split(b" ", 4)
    return name, int(seq_text), int(retry_text), rest[:1] == b"1", rest[1:]


# -- W: a takeover of the replicated log --------------------------------------------------------------

def takeover(epoch: int, owner: bytes) -> bytes:
    """The record a new writer's takeover message carries (journal/jetstream_log.py `take_over`)."""
    return b"W %d %b" % (epoch, owner)


def decode_takeover(line: bytes) -> tuple[int, bytes]:
    """-> (epoch, owner); an owner may hold spaces (`host:port pid N`)."""
    _, epoch_text, owner = line.split(b" ", 2)
    return int(epoch_text), owner

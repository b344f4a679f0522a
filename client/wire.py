"""Client side of the line protocol: requests to bytes, answer lines to parts. Pure, no I/O.

Step in the flow: both clients (the gevent `Client` and the Spark data source) build request lines
here, and split every answer line here. Invariants: a token (queue, event, id) never holds
whitespace, nor, from `Client`, a leading `--`; a data field never holds a newline, carriage return
or tab, so one request is always exactly one line. No gevent: Spark workers import this.
"""

from __future__ import annotations

import itertools
import re
import secrets
from collections.abc import Callable
from typing import Any

from .errors import MqksError

# whitespace would split a token; a leading "--" would make the server read it as a flag
_BAD_TOKEN = re.compile(r"\s|^--")
_WHITESPACE = re.compile(r"\s")
_FORBIDDEN_IN_DATA = ("\n", "\r", "\t")


def rid_maker() -> Callable[[], bytes]:
    """A source of request and msg ids: `{random prefix}{counter in hex}`.

    The prefix makes them unique across clients: the broker keys un-acked messages by msg id.
    """
    prefix = secrets.token_hex(6)
    counter = itertools.count(1)

    def new_rid() -> bytes:
        return f"{prefix}{next(counter):x}".encode()

    return new_rid


def encode_token(value: Any, kind: str, dashes_ok: bool = False) -> bytes:
    """`value` as UTF-8, or ValueError when it cannot be one protocol token.

    `dashes_ok` lets a leading `--` through: the Spark side leaves that verdict to the broker.
    """
    if not isinstance(value, str) or not value or (_WHITESPACE if dashes_ok else _BAD_TOKEN).search(value):
        rule = "without whitespace" if dashes_ok else "without whitespace or a leading '--'"
        raise ValueError(f"bad {kind} {value!r}: it must be a non-empty string {rule}")
    return value.encode()


def encode_tokens(values: list[str] | tuple[str, ...] | None, kind: str) -> list[bytes]:
    """Every value of `values` as a token (an empty list for None)."""
    if values is None:
        return []
    if isinstance(values, str):
        # a bare str would be iterated per character: a classic mistake worth a clear error
        raise TypeError(f"{kind}s must be a list of strings, not the string {values!r}")
    return [encode_token(value, kind) for value in values]


def encode_data(value: str | bytes, kind: str = "data") -> bytes:
    """`value` as the free-text tail of a line, or ValueError when it holds a line break or tab."""
    if isinstance(value, str):
        for char in _FORBIDDEN_IN_DATA:
            if char in value:
                raise ValueError(
                    f"{kind} holds {char!r}, which the protocol forbids; use json=True to escape it")
        return value.encode()
    if isinstance(value, (bytes, bytearray)):
        for byte in (b"\n", b"\r", b"\t"):
            if byte in value:
                raise ValueError(f"{kind} holds {byte!r}, which the protocol forbids")
        return bytes(value)
    raise TypeError(f"{kind} must be str or bytes, not {type(value).__name__}; use json=True for other types")


def split_answer(line: bytes) -> tuple[bytes, bytes, bytes]:
    """`{rid} ok {data}` or `{rid} error {error_id} {reason}` -> (rid, status, rest)."""
    rid, _, rest = line.partition(b" ")
    status, _, data = rest.partition(b" ")
    return rid, status, data


def split_error(rest: bytes) -> tuple[str, str]:
    """The tail of an error answer -> (error_id, human reason, maybe empty)."""
    error_id, _, reason = rest.partition(b" ")
    return error_id.decode(errors="replace"), reason.decode(errors="replace")


def answer_error(rid: bytes, rest: bytes, context: str = "") -> MqksError:
    """The exception for `{rid} error {error_id} {reason}`, given what follows `error`; `context` leads the reason."""
    error_id, reason = split_error(rest)
    return MqksError(context + reason, error_id, rid.decode(errors="replace"))


def split_delivery(data: bytes) -> tuple[bytes, bytes, int, bytes]:
    """`{msg_id} event={event}[,retry={n}] {data}` -> (msg_id, event, retry, data); ValueError if not one."""
    msg_id, _, rest = data.partition(b" ")
    meta, _, body = rest.partition(b" ")
    if not msg_id or not meta.startswith(b"event="):
        raise ValueError(f"not a delivery: {data[:200]!r}")
    event, fields = split_header_fields(meta[6:])
    return msg_id, event, fields.get(b"retry", 0), body


def split_header_fields(meta: bytes) -> tuple[bytes, dict[bytes, int]]:
    """`{event}[,{name}={n}]...` -> (event, {name: n}): the fields the server appends after the event.

    The server's fields come last and look like `,retry=2` (lowercase name, digits); they are
    read from the right, each name once, so an event holding a comma, an `=` or even
    `,retry=z` comes back whole, and a field a newer server adds (`,seq=7`) is skipped, not
    glued to the event. Only an event that itself ends in `,{name}={digits}` is ambiguous.
    """
    fields: dict[bytes, int] = {}
    while True:
        cut = meta.rfind(b",")
        if cut < 0:
            break
        name, equals, value = meta[cut + 1 :].partition(b"=")
        if not equals or not value.isdigit() or not name.isalpha() or not name.islower() or name in fields:
            break
        fields[name] = int(value)
        meta = meta[:cut]
    return meta, fields


def is_update(data: bytes) -> bool:
    """True for `--update {queue} ...`; a delivery whose msg_id is "--update" has `event=` next."""
    return data.startswith(b"--update ") and not data[9:].startswith(b"event=")


def split_update(data: bytes) -> tuple[str, list[str]]:
    """`--update {queue} {events...} [flags]` -> (queue, events); the flags are the consumer's own."""
    tokens = data.split()
    queue = tokens[1].decode() if len(tokens) > 1 else ""
    events = [token.decode() for token in tokens[2:] if not token.startswith(b"--")]
    return queue, events


def is_fire_and_forget_publish(line: bytes) -> bool:
    """True for a publish line without --confirm: the only kind of unsent line worth resending."""
    parts = line.split(b" ", 3)
    return len(parts) >= 3 and parts[1] == b"publish" and parts[2] != b"--confirm"


def consume_line(consumer_id: bytes, queue: bytes, events: list[bytes], *, add: bool, confirm: bool,
                 manual_ack: bool, delete_queue_when_unused: float | bool | None, prefetch: int) -> bytes:
    """`{consumer_id} consume [--confirm] {queue} [--add] {events...} {flags...}`, without its newline.

    `add` keeps the queue's other bindings; without it, the events replace them (none: left as they are).
    """
    parts = [consumer_id, b"consume"]
    if confirm:
        parts.append(b"--confirm")
    parts.append(queue)
    if add and events:
        parts.append(b"--add")
    parts += events
    parts += consume_flags(manual_ack, delete_queue_when_unused, prefetch)
    return b" ".join(parts)


def consume_flags(manual_ack: bool, delete_queue_when_unused: float | bool | None, prefetch: int) -> list[bytes]:
    """The flag tokens of a consume line, as the server prints them back in `--update`."""
    flags: list[bytes] = []
    if delete_queue_when_unused is True:
        flags.append(b"--delete-queue-when-unused")
    elif delete_queue_when_unused is not None and delete_queue_when_unused is not False:
        seconds = float(delete_queue_when_unused)
        if seconds < 0:
            raise ValueError(f"delete_queue_when_unused must be >= 0, not {delete_queue_when_unused!r}")
        flags.append(b"--delete-queue-when-unused=" + repr(seconds).encode())
    if manual_ack:
        flags.append(b"--manual-ack")
    if prefetch:
        if not manual_ack or prefetch < 0:
            raise ValueError("prefetch needs manual_ack=True and a count >= 0")
        flags.append(b"--prefetch=" + str(int(prefetch)).encode())
    return flags

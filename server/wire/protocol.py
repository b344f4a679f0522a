"""Bytes in, lines out; replies formatted back to bytes.

Pure code, no I/O and no broker state, so it can be unit-tested and fuzzed on raw bytes.
Invariants: a line never holds its `\\n` (nor a trailing `\\r`); a line that is too long
or not UTF-8 reaches the dispatcher as `None`, with its (rid, reason) queued in
`LineSplitter.rejected`, so one bad line never costs the connection.
"""

from __future__ import annotations

from collections import deque
from enum import Enum
from typing import Final

DEFAULT_MAX_LINE_BYTES = 1 << 20
CR: Final = 13  # b"\r"[0]: telnet ends lines with \r\n
RID_PEEK_BYTES = 64  # enough to recover a rid from the head of a rejected line
HTTP_METHODS = (b"GET ", b"POST ", b"PUT ", b"HEAD ", b"DELETE ", b"OPTIONS ", b"PATCH ", b"CONNECT ")


class ProtocolError(Exception):
    """A client mistake; the connection stays open and gets `{rid} error {id} {reason}`."""


class Held(Enum):
    """A handler's answer when its line went to another worker: the session's next lines wait for the answers."""

    NEXT = 1  # this line is done; the lines after it run once the answers are in
    AGAIN = 2  # this line itself runs again then (a ping that waited for a sync)


def msg_id_of(tail: bytes) -> bytes:
    """The message id of a tail, ` ok {msg_id} event={event}[,{field}={value}...] {data}` (as queues hold it)."""
    return tail[4 : tail.index(b" ", 4)]


def delivery_tail(msg_id: bytes, header: bytes, data: bytes) -> bytes:
    """` ok {msg_id} event={header} {data}`: a message as its queues hold it, built once per publish (a delivery is
    a consumer's id and this). `header` is the event, with any `,{field}={value}` after it (a request's reply
    token); the spec's delivery always has the space before {data}, even an empty one."""
    return b"".join((b" ok ", msg_id, b" event=", header, b" ", data))


def with_field(tail: bytes, field: bytes) -> bytes:
    """The tail with `field` (`,retry=1`, `,seq=7`) added to its header, as a delivery shows it.

    A msg id and an event never hold a space (the parser splits on them), so the second space
    after " ok " ends the header whatever characters the event holds."""
    end = tail.index(b" ", tail.index(b" ", 4) + 1)
    return b"%b%b%b" % (tail[:end], field, tail[end:])


def event_of(tail: bytes) -> bytes:
    """The event field of a tail's header (a request's carries `,reply={token}` after the event)."""
    start = tail.index(b" ", 4) + 7  # b" event="
    return tail[start : tail.index(b" ", start)]


def rid_of(line: bytes) -> bytes:
    """The request id at the head of a (possibly broken) line, or `-`."""
    head, space, _ = line[:RID_PEEK_BYTES].partition(b" ")
    if not head or not space:
        return b"-"
    try:
        head.decode()
    except UnicodeDecodeError:
        return b"-"
    return head


def looks_like_http(line: bytes) -> bool:
    """True for a request line or header a browser would send (the cross-protocol guard)."""
    return line.startswith(HTTP_METHODS) or line[:5].lower() == b"host:"


class LineSplitter:
    """Splits a stream of chunks into complete lines, bounding each line's length."""

    __slots__ = ("tail", "max_line_bytes", "discarding", "rejected")

    def __init__(self, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        self.tail = b""
        self.max_line_bytes = max_line_bytes
        self.discarding = False  # inside an overlong line, dropping bytes up to its newline
        self.rejected: deque[tuple[bytes, str]] = deque()

    def feed(self, chunk: bytes) -> list[bytes | None]:
        """Lines completed by `chunk`; `None` stands for a rejected line (see `rejected`)."""
        if self.discarding:
            end = chunk.find(b"\n")
            if end < 0:
                return []
            chunk = chunk[end + 1 :]
            self.discarding = False
        lines: list = chunk.split(b"\n")
        tail = self.tail
        if tail:
            # join the partial line to its rest, not the whole chunk to the tail: a 64 KiB
            # copy per read was both work and the main source of heap fragmentation
            lines[0] = tail + lines[0]
        self.tail = lines.pop()
        if len(chunk) + len(tail) > self.max_line_bytes:
            self._reject_overlong(lines)
        # C-speed scans of the whole chunk keep the common case free of per-line work
        if b"\r" in chunk or b"\r" in tail:
            lines = [line[:-1] if line and line[-1] == CR else line for line in lines]
        if not (chunk.isascii() and tail.isascii()):
            self._reject_non_utf8(lines)
        return lines

    def _reject_overlong(self, lines: list) -> None:
        limit = self.max_line_bytes
        reason = f"line longer than {limit} bytes: discarded"
        for i, line in enumerate(lines):
            if line is not None and len(line) > limit:
                self.rejected.append((rid_of(line), reason))
                lines[i] = None
        if len(self.tail) > limit:
            self.rejected.append((rid_of(self.tail), reason))
            lines.append(None)
            self.tail = b""
            self.discarding = True

    def _reject_non_utf8(self, lines: list) -> None:
        for i, line in enumerate(lines):
            if line is None or line.isascii():
                continue
            try:
                line.decode()
            except UnicodeDecodeError as e:
                self.rejected.append((rid_of(line), f"line is not valid UTF-8 (byte {e.start})"))
                lines[i] = None


def format_ok(rid: bytes, data: bytes = b"") -> bytes:
    return b"%b ok %b\n" % (rid, data)


def format_rows(rid: bytes, rows: list[bytes]) -> bytes:
    """A listing's answer (`queues`, `schedules`): `{rid} ok {row}` per row, then `{rid} ok --end`."""
    head = rid + b" ok "
    return b"".join([b"%b%b\n" % (head, row) for row in rows] + [head + b"--end\n"])


def ok_body(line: bytes) -> bytes:
    """The `{data}` of an answer line `{rid} ok {data}`, all that follows its ok; b"" for a line that is no ok."""
    return line.partition(b" ok ")[2]


def format_error(rid: bytes, error_id: str, reason: str) -> bytes:
    # a reason may quote client bytes: keep it on one line
    reason = reason.replace("\n", " ").replace("\r", " ")
    return f"{rid.decode(errors='replace')} error {error_id} {reason}\n".encode()


def text(value: bytes) -> str:
    """Client bytes made safe to quote in an error reason or a log line."""
    return value[:80].decode(errors="replace") + ("..." if len(value) > 80 else "")


def parse_flag_value(token: bytes, name: bytes) -> bytes | None:
    """`--name=value` -> value; `--name` -> b""; anything else -> None."""
    if token == name:
        return b""
    if token.startswith(name + b"="):
        return token[len(name) + 1 :]
    return None


def parse_seconds(value: bytes, flag: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise ProtocolError(f"{flag} wants a number of seconds, got {text(value)!r}") from None
    if not 0 <= seconds < 1e9 or seconds != seconds:
        raise ProtocolError(f"{flag} wants seconds >= 0, got {text(value)!r}")
    return seconds


def parse_unix_seconds(value: bytes, flag: str) -> float:
    """A point in time as Unix seconds (a float), sane enough to schedule: after 1970, before 2^33 (year 2242)."""
    try:
        seconds = float(value)
    except ValueError:
        raise ProtocolError(f"{flag} wants Unix seconds, got {text(value)!r}") from None
    if not 0 <= seconds < 1 << 33:
        raise ProtocolError(f"{flag} wants Unix seconds between 0 and {1 << 33}, got {text(value)!r}")
    return seconds


def parse_count(value: bytes, flag: str) -> int:
    try:
        count = int(value)
    except ValueError:
        raise ProtocolError(f"{flag} wants a whole number, got {text(value)!r}") from None
    if count < 0:
        raise ProtocolError(f"{flag} wants a number >= 0, got {count}")
    return count

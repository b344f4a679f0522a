"""The answer side of one client connection: which waiting request, or which consumer, each line is for. No I/O.

Step in the flow: a transport's reader splits the stream into lines and hands each to `Answers.take`;
both clients (the gevent `Client`, `mqks.aio.Client`) run this same routing, only their waiters differ
(a gevent AsyncResult, an asyncio Future): `resolve` and `fail` settle one. Invariants: a consumer's
delivery never wakes a request; a request whose answer comes in several `ok` lines wakes once, at its
`ok --end`; a rid nobody waits for any more (its caller timed out or was cancelled) is dropped quietly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from . import wire
from .errors import MqksError, MqksProtocolError

log = logging.getLogger("mqks.client")

END_OF_LINES = b"--end"  # the last `ok` of an answer in several lines
DRAINING = b"--draining"  # `{consumer_id} ok --draining`: the broker is stopping
PEER_TEXT_CHARS = 80  # of a non-MQKS answer, quoted in the error
TLS_PORT_REASON = "this port speaks TLS"  # the broker's reason to a plain client on its TLS port

W = TypeVar("W")


class Deliveries(Protocol):
    """The consumers of a connection, as the router sees them (each client's session)."""

    def deliver(self, rid: bytes, data: bytes) -> bool:
        """Take an `ok` line with data whose rid is a consumer's; False leaves it to the requests."""

    def answered(self, rid: bytes) -> None:
        """An `ok` answer to request `rid` is about to wake its caller."""

    def refused(self, rid: bytes, error: MqksError) -> bool:
        """Take an error answer nobody waits for; False when `rid` is not a consumer's."""


class Answers(Generic[W]):
    """Requests awaiting their answers on one connection, by rid, and the routing of every answer line."""

    __slots__ = ("waiters", "lines_by_rid", "session", "where", "resolve", "fail")

    def __init__(self, session: Deliveries, where: str, resolve: Callable[[W, bytes], None],
                 fail: Callable[[W, MqksError], None]) -> None:
        self.waiters: dict[bytes, W] = {}
        self.lines_by_rid: dict[bytes, list[bytes]] = {}  # answers in several lines, until `ok --end`
        self.session = session
        self.where = where  # host:port, for error texts
        self.resolve = resolve
        self.fail = fail

    def add(self, rid: bytes, waiter: W, lines: list[bytes] | None = None) -> None:
        """Wait for the answer to `rid`; with `lines`, it comes as several `ok` lines whose data go there."""
        self.waiters[rid] = waiter
        if lines is not None:
            self.lines_by_rid[rid] = lines

    def discard(self, rid: bytes) -> None:
        """Stop waiting for `rid` (its caller gave up): a late answer is dropped."""
        self.waiters.pop(rid, None)
        self.lines_by_rid.pop(rid, None)

    def fail_all(self, error: MqksError) -> None:
        """The connection is gone: every waiter gets `error`."""
        waiters, self.waiters = self.waiters, {}
        self.lines_by_rid = {}
        for waiter in waiters.values():
            self.fail(waiter, error)

    def take(self, line: bytes, ready: bool) -> bytes | MqksProtocolError | None:
        """Route one line; DRAINING when the broker is stopping, an error when the peer is not to be trusted.

        `ready` is False until the handshake is through: a line that is not MQKS before that means a wrong peer.
        """
        rid, status, data = wire.split_answer(line.rstrip(b"\r"))
        if status == b"ok":
            if data == DRAINING:
                return DRAINING
            if data and self.session.deliver(rid, data):
                return None
            if self.lines_by_rid:
                lines = self.lines_by_rid.get(rid)
                if lines is not None:
                    if data != END_OF_LINES:
                        lines.append(data)
                        return None
                    del self.lines_by_rid[rid]
                    data = b""
            waiter = self.waiters.pop(rid, None)
            if waiter is not None:
                self.session.answered(rid)
                self.resolve(waiter, data)
            return None
        if status == b"error":
            error = wire.answer_error(rid, data)
            if rid == b"-" and not ready and TLS_PORT_REASON in error.reason:
                # a plain connection to a TLS port: the broker says so once, then closes
                return MqksProtocolError(f"{self.where} speaks TLS: pass --tls (tls=True from Python)")
            self.lines_by_rid.pop(rid, None)
            waiter = self.waiters.pop(rid, None)
            if waiter is not None:
                self.fail(waiter, error)
            elif not self.session.refused(rid, error):
                log.warning("mqks %s: request %s failed: %s", self.where, error.rid, error)
            return None
        if not ready:
            # not even the handshake is through: this peer is something else (an HTTP server, say);
            # one clear error instead of a warning per line of its answer
            text = line.rstrip(b"\r")[:PEER_TEXT_CHARS].decode("utf-8", errors="replace")
            return MqksProtocolError(f"{self.where} does not speak MQKS (it answered {text!r})")
        log.warning("mqks %s: unexpected line %r", self.where, line[:200])
        return None

"""Requests waiting for a reply (extension, EventMQ's REQUEST/REPLY).

`{rid} request --timeout=S {event} {data}` is a publish whose deliveries carry
`,reply={token}` after the event; a worker answers `{id} reply {token} {data}` and the
requester gets `{rid} ok --reply {data}`. The first reply wins; later ones are counted and
dropped until the request's deadline, after which its token is unknown. A token lives only
in this process and only while its requester is connected. No sockets here: answers go to
the requester's `Outbox`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..wire.outbox import Outbox

DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def base36(number: int) -> str:
    text = ""
    while True:
        number, digit = divmod(number, 36)
        text = DIGITS[digit] + text
        if not number:
            return text


class Request:
    __slots__ = ("outbox", "rid", "seconds", "answered", "cancel_timer")

    def __init__(self, outbox: Outbox, rid: bytes, seconds: float) -> None:
        self.outbox = outbox
        self.rid = rid
        self.seconds = seconds
        self.answered = False
        self.cancel_timer: Callable[[], None] | None = None


class Requests:
    """Every request of the process waiting for its reply, by token."""

    def __init__(self, schedule: Callable[[float, Callable[[], None]], Callable[[], None]],
                 error_line: Callable[[bytes, str], bytes]) -> None:
        self.schedule = schedule
        self.error_line = error_line  # (rid, reason) -> the error line, with a fresh error id
        self.by_token: dict[bytes, Request] = {}
        self.tokens_by_outbox: dict[Outbox, set[bytes]] = {}
        # a token never repeats within a process, and a new process starts elsewhere: a reply
        # meant for a request before a restart cannot reach a new one
        self.prefix = base36(int.from_bytes(os.urandom(4), "big"))
        self.next_number = 0
        self.requests = 0
        self.replies = 0
        self.replies_late = 0
        self.timeouts = 0

    def open(self, outbox: Outbox, rid: bytes, seconds: float) -> bytes:
        """A token for a new request; its requester hears of a reply or of the timeout through `outbox`."""
        self.next_number += 1
        token = (self.prefix + base36(self.next_number)).encode()
        request = self.by_token[token] = Request(outbox, rid, seconds)
        self.tokens_by_outbox.setdefault(outbox, set()).add(token)
        request.cancel_timer = self.schedule(seconds, lambda: self._deadline(token))
        self.requests += 1
        return token

    def reply(self, token: bytes, data: bytes) -> bool:
        """Answer the request; False if the token is unknown (never issued, expired, or its requester left)."""
        request = self.by_token.get(token)
        if request is None:
            return False
        if request.answered:
            self.replies_late += 1  # the first reply won
            return True
        request.answered = True
        request.outbox.write(b"%b ok --reply %b\n" % (request.rid, data))
        self.replies += 1
        return True

    def forget(self, outbox: Outbox) -> None:
        """The requester left: its tokens are no longer valid."""
        for token in self.tokens_by_outbox.pop(outbox, ()):
            request = self.by_token.pop(token)
            if request.cancel_timer is not None:
                request.cancel_timer()

    def _deadline(self, token: bytes) -> None:
        request = self.by_token.pop(token, None)
        if request is None:
            return
        tokens = self.tokens_by_outbox.get(request.outbox)
        if tokens is not None:
            tokens.discard(token)
            if not tokens:
                del self.tokens_by_outbox[request.outbox]
        if not request.answered:
            self.timeouts += 1
            request.outbox.write(self.error_line(request.rid, f"no reply within {request.seconds:g} s"))

    def stats(self) -> dict[str, Any]:
        return {"requests": self.requests, "requests_waiting": sum(not r.answered for r in self.by_token.values()),
                "replies": self.replies, "replies_late": self.replies_late, "request_timeouts": self.timeouts}

"""Token scopes (a TOML `--auth-token-file`, whatever its name): the events a token may publish to (names, dot-star
masks, or `*` for any), the queues it may read (fnmatch patterns), and whether it may manage queues and schedules.

Beside the dispatcher, never in it: each action declares what a scoped token needs (`Action.scope`, a
`ScopeCheck`), and a session whose token is scoped runs a handler table whose guarded actions are wrapped with
that check, built once per token and base table (`Scope.table`, the one place it is read), and publishes through a
`ScopedPublisher`, which checks the event the handler already cut out against the token's set of events
decided allowed (one method call and one set lookup per publish: a wrapper that cut the event out again cost
three times that). A full-access session runs the plain table and the process's publisher, so scopes cost
nothing where they are not used. A publish its token may publish reaches every bound queue: a queue's
permission is about reading it, as NATS's subscribe permissions are.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable
from typing import Any

from ..core.routing import compile_mask, is_mask
from ..wire.protocol import ProtocolError
from .actions import ACTIONS, ScopeCheck

Handler = Callable[[Any, bytes, bytes, bool], Any]

MAX_DECIDED = 65536  # names a token's cache keeps; a client inventing names forever must not grow it forever


def schedule_event(args: bytes) -> bytes:
    """The event of `schedule {name} --every=S|--cron M H DOM MON DOW [--count=N] [--nohaste] {event} {data}`
    (b"" when the line has none: the handler answers its own error)."""
    words = args.split(b" ")[1:]  # after the name
    i = 0
    while i < len(words) and words[i].startswith(b"--"):
        i += 6 if words[i] == b"--cron" else 1
    return words[i] if i < len(words) else b""


class Scope:
    """What one token may do; `name` is how logs, errors and stats call it (never the secret)."""

    __slots__ = ("name", "publish", "consume", "manage", "_every_event", "_publish_masks", "_publish_names",
                 "_queue_patterns", "_may_publish", "_may_consume", "_tables", "allowed_events")

    def __init__(self, name: str, publish: Iterable[str], consume: Iterable[str], manage: bool) -> None:
        self.name = name
        self.publish = list(publish)
        self.consume = list(consume)
        self.manage = manage
        self._every_event = "*" in self.publish  # `publish = ["*"]`: any event (a lone `*` is no dot-star mask)
        encoded = [pattern.encode() for pattern in self.publish]
        self._publish_names = {pattern for pattern in encoded if not is_mask(pattern)}
        self._publish_masks = [compile_mask(pattern) for pattern in encoded if is_mask(pattern)]
        self._queue_patterns = [re.compile(fnmatch.translate(pattern).encode()) for pattern in self.consume]
        self._may_publish: dict[bytes, bool] = {}
        self._may_consume: dict[bytes, bool] = {}
        self._tables: dict[int, tuple[dict[bytes, Handler], dict[bytes, Handler]]] = {}
        self.allowed_events: set[bytes] = set()  # the publisher's fast path: events decided allowed

    def may_publish(self, event: bytes) -> bool:
        decided = self._may_publish.get(event)
        if decided is None:
            decided = (self._every_event or event in self._publish_names
                       or any(mask.fullmatch(event) for mask in self._publish_masks))
            _remember(self._may_publish, event, decided)
            if decided:
                if len(self.allowed_events) >= MAX_DECIDED:
                    self.allowed_events.clear()
                self.allowed_events.add(event)
        return decided

    def may_consume(self, queue: bytes) -> bool:
        decided = self._may_consume.get(queue)
        if decided is None:
            decided = any(pattern.fullmatch(queue) for pattern in self._queue_patterns)
            _remember(self._may_consume, queue, decided)
        return decided

    def refuse(self, session: Any, what: str, name: bytes) -> ProtocolError:
        """The error a refused line gets (the connection stays usable); counted in `stats` (refused_by_scope)."""
        session.process.refused_by_scope += 1
        return ProtocolError(f"permission denied: token {self.name!r} may not {what} "
                             f"{name.decode(errors='replace')!r}")

    def table(self, base: dict[bytes, Handler]) -> dict[bytes, Handler]:
        """`base` with every action wrapped by the check its `Action.scope` declares (made once per base table)."""
        made = self._tables.get(id(base))
        if made is not None and made[0] is base:
            return made[1]
        table = {name: self.guarded(name, ACTIONS[name].scope, handler) for name, handler in base.items()}
        self._tables[id(base)] = (base, table)
        return table

    def guarded(self, name: bytes, check: ScopeCheck, handler: Handler) -> Handler:
        """`handler` behind `check` for this token; `handler` itself where there is nothing to check here."""
        if check is ScopeCheck.READ_QUEUE:
            return self._guard(handler, _first_word, self.may_consume, name.decode())
        if check is ScopeCheck.SCHEDULE:  # a schedule publishes later, from the process: checked when it is set
            return self._guard(handler, schedule_event, self.may_publish, "schedule to")
        if check is ScopeCheck.MANAGE:
            return handler if self.manage else self._refused(name.decode())
        if check is ScopeCheck.FULL_ACCESS_ONLY:
            return self._refused(name.decode())
        if check is ScopeCheck.ANY or check is ScopeCheck.PUBLISH:  # PUBLISH: ScopedPublisher checks the event
            return handler
        raise ValueError(f"{name.decode()}: no check for {check}")  # a new kind of scope: closed until it has one

    def _guard(self, handler: Handler, name_of: Callable[[bytes], bytes], may: Callable[[bytes], bool],
               what: str) -> Handler:
        def guarded(session: Any, rid: bytes, args: bytes, confirm: bool) -> Any:
            name = name_of(args)
            if name and not may(name):
                raise self.refuse(session, what, name)
            return handler(session, rid, args, confirm)

        return guarded

    def _refused(self, what: str) -> Handler:
        def refused(session: Any, rid: bytes, args: bytes, confirm: bool) -> Any:
            raise self.refuse(session, what, _first_word(args))

        return refused


def _first_word(args: bytes) -> bytes:
    return args.partition(b" ")[0]


def _remember(decided: dict[bytes, bool], name: bytes, value: bool) -> None:
    if len(decided) >= MAX_DECIDED:
        decided.clear()  # rare: a cache full of one-off names; the next lookups decide again
    decided[name] = value


class ScopedPublisher:
    """A scoped session's publisher (`publish`, `request`, and their --confirm, --mandatory and --delay forms): the
    process's publisher, behind the check of each event against the token's scope."""

    __slots__ = ("inner", "scope", "allowed", "session")

    def __init__(self, inner: Any, scope: Scope, session: Any) -> None:
        self.inner = inner  # the process's Broker, or its Forwarder with worker processes
        self.scope = scope
        self.allowed = scope.allowed_events
        self.session = session

    def permits(self, event: bytes) -> bool:
        """True, or raises the refusal (a ProtocolError: the line gets its error, the connection goes on)."""
        if event not in self.allowed and not self.scope.may_publish(event):
            raise self.scope.refuse(self.session, "publish", event)
        return True

    def publish(self, msg_id: bytes, event: bytes, tail: bytes) -> None:
        if event not in self.allowed:
            self.permits(event)
        self.inner.publish(msg_id, event, tail)

    def routes(self, event: bytes) -> bool:
        self.permits(event)
        return bool(self.inner.routes(event))

    def full_queues(self, event: bytes) -> list[Any]:
        self.permits(event)
        return list(self.inner.full_queues(event))


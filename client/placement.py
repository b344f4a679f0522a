"""Client side of placement: which worker owns a queue, and where to reach it directly. Pure, no I/O.

Step in the flow: a connection's `hello` answer -> `Placement.from_hello` -> `route(queue)`, the
direct address a consume (and its acks) for that queue goes to; None sends it on the public
connection. Routing is only an optimisation: every worker serves every action, relaying to the
owner, so any doubt about the answer (an older broker, one worker, a malformed map, an entry
lacking a port) means None, never an error. No gevent: Spark executors import this.
The slot map comes from the broker; the slot function is the broker's own, from common/slots.py
(the client never imports server/: it ships on hosts without the broker's dependencies).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from mqks.common.slots import slot_of

log = logging.getLogger("mqks.client")

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})  # a bind address, not one to dial
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    """True for an address on this host: only then can a Unix socket path the broker names be ours too."""
    return host in LOOPBACK_HOSTS or host.startswith("127.")


@dataclass(frozen=True, slots=True)
class Route:
    """Where a direct connection to `worker` goes: TCP host:port, or the Unix socket `unix` when it exists."""

    worker: int
    host: str
    port: int
    unix: str | None = None


@dataclass(frozen=True, slots=True)
class Direct:
    """One worker's own addresses, as `hello` lists them under "direct"."""

    worker: int
    host: str
    port: int | None
    tls_port: int | None
    unix: str | None


@dataclass(frozen=True, slots=True)
class Placement:
    """The broker's slot map and direct addresses; equal placements route every queue alike."""

    workers: int
    slots: int
    firsts: tuple[int, ...]  # first slot of each row of the slot map, ascending
    owners: tuple[int, ...]  # the worker of each row
    direct: tuple[Direct, ...]

    @classmethod
    def from_hello(cls, info: Mapping[str, Any] | None) -> Placement | None:
        """The placement a `hello` answer describes; None when it names fewer than 2 workers or is malformed."""
        if not isinstance(info, Mapping):
            return None
        workers, slots = info.get("workers"), info.get("slots")
        slot_map, direct = info.get("slot_map"), info.get("direct")
        if not (isinstance(workers, int) and isinstance(slots, int) and isinstance(slot_map, list)
                and isinstance(direct, list) and _is_int(workers) and _is_int(slots) and workers >= 2 and slots > 0):
            return None
        rows = []
        for row in slot_map:
            if not (isinstance(row, list) and len(row) == 3 and all(_is_int(value) for value in row)):
                return None
            rows.append((row[0], row[1], row[2]))
        rows.sort()
        expected_first = 0
        for first, last, worker in rows:
            # contiguous and complete: a gap would leave some queue without an owner
            if first != expected_first or last < first or not 0 <= worker < workers:
                return None
            expected_first = last + 1
        if expected_first != slots:
            return None
        entries = [entry for entry in (_direct(item) for item in direct) if entry is not None]
        return cls(workers, slots, tuple(row[0] for row in rows), tuple(row[2] for row in rows),
                   tuple(sorted(entries, key=lambda entry: entry.worker)))

    def owner(self, queue: bytes) -> int:
        """The worker that owns `queue`."""
        return self.owners[bisect.bisect_right(self.firsts, slot_of(queue, self.slots)) - 1]

    def route(self, queue: bytes, public_host: str, tls: bool) -> Route | None:
        """Where a consume of `queue` goes: the owner's direct address, or None for the public connection."""
        return self.worker_route(self.owner(queue), public_host, tls)

    def worker_route(self, worker: int, public_host: str, tls: bool) -> Route | None:
        """`worker`'s direct address as this client dials it; None when its entry lacks what `tls` needs.

        A wildcard host (the broker bound every interface) is dialled at the public host. With TLS
        only the entry's "tls_port" will do, and never the Unix socket (the same rule as the public port).
        """
        entry = next((entry for entry in self.direct if entry.worker == worker), None)
        if entry is None:
            return None
        port = entry.tls_port if tls else entry.port
        if port is None:
            return None
        host = public_host if entry.host in WILDCARD_HOSTS else entry.host
        unix = entry.unix if entry.unix and not tls and is_loopback(public_host) else None
        return Route(worker, host, port, unix)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _port(value: Any) -> int | None:
    return value if _is_int(value) and 0 < value < 65536 else None


def _direct(item: Any) -> Direct | None:
    """One "direct" entry; None for one without a worker number (an entry without ports routes nowhere)."""
    if not isinstance(item, Mapping) or not _is_int(item.get("worker")):
        return None
    host, unix = item.get("host"), item.get("unix")
    return Direct(item["worker"], host if isinstance(host, str) else "", _port(item.get("port")),
                  _port(item.get("tls_port")), unix if isinstance(unix, str) and unix else None)


def parse_seeds(text: str | None, what: str) -> list[tuple[str, int]]:
    """`host:port,host:port` (a cluster's nodes) as (host, port) pairs; ValueError naming `what` for a bad item."""
    seeds = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        host, colon, port = item.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in host):
            raise ValueError(f"{what}: {item!r} is not host:port")
        seeds.append((host, int(port)))
    return seeds



class HomeSession(Protocol):
    """A client's session of one link, as `Homes` sees it (each client's `Consumers`)."""

    by_id: dict[str, Any]  # its consumers by their current ids
    link: Any  # its link: `connected`, `conn`

    def release(self, consumer: Any) -> None: ...


S = TypeVar("S", bound=HomeSession)


class Homes(Generic[S]):
    """Where a client's consumers live: the public link's session, plus one direct session per owning worker.

    Both clients (gevent and asyncio) keep their links in one of these and ask it the same questions;
    opening, closing and moving are theirs. `public` tells the public link's host and whether it speaks TLS
    (a direct address on a wildcard host is dialled at that host, with TLS only at a `tls_port`).
    """

    __slots__ = ("public_session", "public", "placement", "direct")

    def __init__(self, public_session: S, public: Callable[[], tuple[str, bool]]) -> None:
        self.public_session = public_session
        self.public = public
        self.placement: Placement | None = None  # the slot map the last hello told; None: one link for all
        self.direct: dict[int, tuple[Route, S]] = {}  # by worker: the direct link's route and session

    def sessions(self) -> list[S]:
        return [self.public_session, *(session for _, session in self.direct.values())]

    def learn(self, info: Mapping[str, Any] | None, where: str) -> bool:
        """Take the slot map of a `hello` answer (from the broker at `where`); True when it differs from the last."""
        placement = Placement.from_hello(info)
        if placement == self.placement:
            return False
        self.placement = placement
        log.info("mqks %s: %s", where, "no slot map: one connection for all" if placement is None
                 else f"{placement.workers} workers: consumes go to their queue's owner")
        return True

    def route(self, queue: bytes) -> Route | None:
        """The direct address for a consume of `queue` under the current slot map; None: the public link."""
        if self.placement is None:
            return None
        host, tls = self.public()
        return self.placement.route(queue, host, tls)

    def stale(self) -> list[int]:
        """The workers whose direct link no longer matches the current map (moved, or gone)."""
        host, tls = self.public()
        placement = self.placement
        return [worker for worker, (route, _) in self.direct.items()
                if placement is None or placement.worker_route(worker, host, tls) != route]

    def belongs(self, queue: bytes, session: S) -> bool:
        """True when the current slot map puts a consumer of `queue` on `session`'s link."""
        route = self.route(queue)
        if route is None:
            return session is self.public_session
        return self.direct.get(route.worker) == (route, session)

    def found(self, route: Route) -> S | None:
        """The session of the direct link for `route`, when one is open to exactly that address."""
        found = self.direct.get(route.worker)
        return found[1] if found is not None and found[0] == route else None

    def misplaced_on(self, session: S) -> list[Any]:
        """Take off `session` the consumers the current map places on another link; they wait to be placed."""
        moved = [consumer for consumer in list(session.by_id.values())
                 if not self.belongs(consumer.queue.encode(), session)]
        for consumer in moved:
            session.release(consumer)
        return moved

    def evict_misplaced(self, new_rid: Callable[[], bytes]) -> list[Any]:
        """Take every consumer off a link the current map no longer names for it; they wait to be placed.

        One still consuming on a live connection is deleted there first: it would take messages nobody handles.
        """
        moved = []
        for session in self.sessions():
            link = session.link
            for consumer in self.misplaced_on(session):
                moved.append(consumer)
                old_conn = consumer.conn
                if link is not None and link.connected and old_conn is link.conn and old_conn is not None:
                    old_conn.write(b"".join((new_rid(), b" delete_consumer ", consumer.id.encode(), b"\n")))
        return moved

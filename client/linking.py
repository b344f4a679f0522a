"""What both clients and their links share, whatever runs them: the settings, the constructor, the read-only
view of the link and the routing of consumers to their worker's link (`ClientBase`), the addresses tried in
turn, back-off, the handshake's refusals, the bookkeeping of a lost connection and of its unsent publishes. No I/O.

Step in the flow: each client (client/client.py on gevent, client/aio/client.py on asyncio) subclasses
`ClientBase`, which takes its `ClientSettings` once and leaves to hooks how a retired link closes and how a
rehoming pass or a moved consume runs, and its `Link` (client/connection.py, client/aio/connection.py)
subclasses `LinkBase`, adding the transport, the connection manager and the waits, which differ. Invariants:
addresses rotate in one order (the first is the one given); a connection is marked lost once, and every request
waiting on it fails then; only plain publishes that never reached a lost connection are kept for the next one (a
confirmed one is retried by its caller).
"""

from __future__ import annotations

import logging
import random
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from . import wire
from .answers import Answers
from .errors import (
    FAILOVER_SECONDS,
    TRANSIENT_RETRY_MAX_SECONDS,
    TRANSIENT_RETRY_SECONDS,
    MqksConnectionError,
    MqksError,
    MqksProtocolError,
    is_transient,
)
from .placement import Homes, Route
from .tls import tls_setting, token_setting


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """A client's options, checked once: `Client(host, port, settings=...)` on either transport, or the same names
    as keyword arguments. Every link of a client (the public one and each direct one) is made from them."""

    ping_seconds: float = 15.0  # keepalive: a ping every this many seconds
    ping_timeout_seconds: float | None = None  # a pong missing this long means a dead connection; None: ping_seconds
    reconnect_min_seconds: float = 0.05  # the back-off between attempts starts here, doubles, with jitter
    reconnect_max_seconds: float = 5.0
    timeout_seconds: float = 10.0  # what a call waits at most, a reconnect included, unless it names its own
    connect_timeout_seconds: float = 10.0
    tls: bool | ssl.SSLContext = False  # True: the system's CAs; a context for a private CA or a client certificate
    token: str | None = None  # None: MQKS_AUTH_TOKEN, read when the client is made
    ttl_seconds: float | None = None  # sent as `hello --ttl`; None: 2 * ping_seconds; 0: none
    fallbacks: tuple[tuple[str, int], ...] = ()  # other brokers, tried in turn; a list is taken too
    anonymous: bool = False  # connect to a broker that wants a token without one, for what needs none (ping)
    failover_seconds: float = FAILOVER_SECONDS  # how long a consume refused while its owner fails over keeps trying

    def __post_init__(self) -> None:
        if self.ttl_seconds and self.ping_seconds > self.ttl_seconds:
            # the broker drops a connection silent for 2x its TTL: an idle client must ping well within it
            raise ValueError(f"ping_seconds ({self.ping_seconds:g}) must not exceed ttl_seconds ({self.ttl_seconds:g})")
        object.__setattr__(self, "fallbacks", tuple((host, port) for host, port in self.fallbacks))

    def link_options(self) -> dict[str, Any]:
        """The keyword arguments of each of a client's links (its fallbacks go to the public one only): the TLS
        context made and the token read once, here."""
        return dict(ping_seconds=self.ping_seconds,
                    ping_timeout_seconds=self.ping_seconds if self.ping_timeout_seconds is None
                    else self.ping_timeout_seconds,
                    reconnect_min_seconds=self.reconnect_min_seconds, reconnect_max_seconds=self.reconnect_max_seconds,
                    timeout_seconds=self.timeout_seconds, connect_timeout_seconds=self.connect_timeout_seconds,
                    tls=tls_setting(self.tls), token=token_setting(self.token),
                    ttl_seconds=2 * self.ping_seconds if self.ttl_seconds is None else self.ttl_seconds,
                    anonymous=self.anonymous)


DEFAULT_SETTINGS = ClientSettings()


class ClientBase:
    """What both clients are before their transport: their settings, taken once, a read-only view of their
    public link, and the routing of consumers to a direct link per worker (`_session_for`, `_retire`, rehoming).
    Each client's `_set_up` makes its consumers, links and homes; the hooks below say what its transport does
    differently (how a link closes in the background, how a rehoming pass and a moved consume run)."""

    _link: LinkBase
    _link_class: Callable[..., Any]  # the transport's Link
    _session_class: Callable[..., Any]  # the transport's Consumers
    _consumers: Any  # the public link's session
    _homes: Homes[Any]  # the links consumers live on: the public one, one per owning worker
    _homeless: list[Any]  # consumers taken off a link, waiting for _rehome to place them
    _rehome_again: bool
    _log = logging.getLogger("mqks.client")

    def __init__(self, host: str = "127.0.0.1", port: int = 25000, *, settings: ClientSettings | None = None,
                 ping_seconds: float = 15.0, ping_timeout_seconds: float | None = None,
                 reconnect_min_seconds: float = 0.05, reconnect_max_seconds: float = 5.0,
                 timeout_seconds: float = 10.0, connect_timeout_seconds: float = 10.0,
                 tls: bool | ssl.SSLContext = False, token: str | None = None, ttl_seconds: float | None = None,
                 fallbacks: list[tuple[str, int]] | tuple[()] = (), anonymous: bool = False,
                 failover_seconds: float = FAILOVER_SECONDS,
                 on_refused: Callable[[MqksError], Any] | None = None) -> None:
        given = ClientSettings(
            ping_seconds=ping_seconds, ping_timeout_seconds=ping_timeout_seconds,
            reconnect_min_seconds=reconnect_min_seconds, reconnect_max_seconds=reconnect_max_seconds,
            timeout_seconds=timeout_seconds, connect_timeout_seconds=connect_timeout_seconds, tls=tls, token=token,
            ttl_seconds=ttl_seconds, fallbacks=tuple(fallbacks), anonymous=anonymous, failover_seconds=failover_seconds)
        if settings is not None and given != DEFAULT_SETTINGS:
            # an option beside settings= would be dropped without a word
            raise TypeError("give settings= or the options it holds, not both")
        self.settings = given if settings is None else settings
        self.host = host
        self.port = port
        self.timeout_seconds = self.settings.timeout_seconds
        self.failover_seconds = self.settings.failover_seconds
        self.on_refused = on_refused
        self._new_rid = wire.rid_maker()
        # what every link shares: direct links speak the same protocol, TLS and token included
        self._link_options = self.settings.link_options()
        self._set_up()

    def _set_up(self) -> None:
        """The transport's part of the constructor: its consumers, its public link (`_link`) and their homes."""
        raise NotImplementedError

    @property
    def server_info(self) -> dict[str, Any] | None:
        """The broker's `hello` answer (version, protocol, extensions, workers, ttl), or None from one without it."""
        return self._link.server_info

    @property
    def reconnects(self) -> int:
        """How many connections were lost so far; each loss starts a reconnect."""
        return self._link.reconnects

    @property
    def connected(self) -> bool:
        """True while a live, handshaken connection exists."""
        return self._link.connected

    def _close_later(self, link: Any) -> None:
        """Close a retired direct link without waiting for it."""
        raise NotImplementedError

    def _rehome_running(self) -> bool:
        raise NotImplementedError

    def _start_rehome(self) -> None:
        """Start a rehoming pass in the background: `_rehome` until nothing asks for another."""
        raise NotImplementedError

    def _move(self, session: Any, consumer: Any) -> None:
        """Send a moved consumer's consume on its new link in the background (`_moving` counts it meanwhile)."""
        raise NotImplementedError

    def _moving(self) -> bool:
        """True while a moved consumer's consume is on its way to its new link."""
        raise NotImplementedError

    def _session_for(self, route: Route | None) -> Any:
        """The session of the link for `route`, opened (connecting in the background) on first need."""
        if route is None:
            return self._consumers
        found = self._homes.found(route)
        if found is not None:
            return found
        if route.worker in self._homes.direct:
            self._retire(route.worker)
        session = self._session_class(f"{route.host}:{route.port}", self._new_rid, self._consumers.by_any_id,
                                      route.worker, self._on_connect, self._consumers.on_refused)
        # the public addresses as fallbacks, the one in use first: a direct port a firewall hides still leaves a
        # working (relayed) route, and when the owner is gone (a cluster's failover) the hello of any live seed
        # tells the new map
        public = self._link.addresses
        start = self._link.address_index
        session.link = self._link_class(route.host, route.port, session, self._new_rid, unix=route.unix,
                                        tls_hostname=self._link.host, fallbacks=public[start:] + public[:start],
                                        **self._link_options)
        self._homes.direct[route.worker] = (route, session)
        session.link.begin()
        return session

    def _retire(self, worker: int) -> None:
        """Close the direct link to `worker` (its address changed or is gone); its consumers wait for _rehome."""
        _, session = self._homes.direct.pop(worker)
        for consumer in list(session.by_id.values()):
            session.release(consumer)
            self._homeless.append(consumer)
        if session.link is not None:
            self._close_later(session.link)
        self._schedule_rehome()

    def _on_connect(self, session: Any) -> None:
        """A link's hello is in: learn the slot map from it, and take off this link what it now places elsewhere.

        Runs inside the link's handshake, before its replay: it never blocks; moving is _rehome's job.
        """
        assert session.link is not None
        changed = self._homes.learn(session.link.server_info, f"{self.host}:{self.port}")
        self._homeless += self._homes.misplaced_on(session)
        if changed or self._homeless:
            self._schedule_rehome()

    def _schedule_rehome(self) -> None:
        if self._rehome_running():
            self._rehome_again = True  # the running pass may have read the map before it changed
            return
        self._start_rehome()

    def _rehome(self) -> None:
        """Put every consumer on the link the current slot map names; a moved one comes back as after a reconnect."""
        for worker in self._homes.stale():
            self._retire(worker)
        self._homeless += self._homes.evict_misplaced(self._new_rid)
        homeless, self._homeless = self._homeless, []
        for consumer in homeless:
            if consumer.active:
                session = self._session_for(self._homes.route(consumer.queue.encode()))
                session.adopt(consumer)
                self._move(session, consumer)

    def _consumers_placed(self) -> bool:
        """True unless a consumer is still on its way back to its worker's link (a reconnect, a new map)."""
        if self._homeless or self._moving() or self._rehome_running():
            return False
        return all(session.link is None or session.link.connected or not session.by_id
                   for _, session in self._homes.direct.values())

    def _refused_on_new_link(self, session: Any, consumer: Any, error: MqksError) -> bool:
        """A moved consumer's consume was refused on its new link: True to send it again in a moment (its owner
        fails over), under a new id (a broker that kept the refused one would answer "already consuming");
        False when it is dropped."""
        if is_transient(error):
            consumer.conn = None
            session.renew(consumer)
            return True
        self._log.error("mqks %s: consumer %s on queue %s refused on its new worker, dropped: %s",
                        session.where, consumer.reported_id, consumer.queue, error)
        session.forget(consumer)
        return False

    def _let_go(self, consumer: Any) -> Any:
        """Forget `consumer` on its link; that link, for its `delete_consumer`, or None when the broker has dropped
        it with its connection already."""
        home = consumer.home
        (home or self._consumers).forget(consumer)
        link = home.link if home is not None else None
        return link if link is not None and link.connected else None

    def _forget_queue(self, queue: str) -> None:
        """A deleted queue's consumers end here, wherever they live or wait."""
        for session in self._homes.sessions():
            session.forget_queue(queue)
        for consumer in [consumer for consumer in self._homeless if consumer.queue == queue]:
            self._homeless.remove(consumer)
            self._consumers.forget(consumer)


def refused_for_now(error: MqksError) -> bool:
    """A broker's refusal to ask again after a pause (its owner fails over), not a lost connection or a timeout."""
    return type(error) is MqksError and is_transient(error)


class Retries:
    """A request asked again while it is refused for now, until `deadline` (the monotonic clock): the pause doubles
    from TRANSIENT_RETRY_SECONDS to TRANSIENT_RETRY_MAX_SECONDS. Each transport sleeps the pause its own way."""

    __slots__ = ("deadline", "pause")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.pause = TRANSIENT_RETRY_SECONDS

    def pause_after(self, error: MqksError, again: Callable[[MqksError], bool] = refused_for_now) -> float:
        """The pause before asking again; raises `error` when `again` says no or the pause would pass the deadline."""
        pause = self.pause
        if not again(error) or time.monotonic() + pause > self.deadline:
            raise error
        self.pause = min(pause * 2, TRANSIENT_RETRY_MAX_SECONDS)
        return pause


def connect_error(cause: BaseException | None, where: str, timeout: float, retry: bool) -> MqksError:
    """What `connect()` raises when no connection came: the last attempt's reason, as a person reads it."""
    if isinstance(cause, MqksProtocolError):
        return MqksProtocolError(cause.reason)
    if cause is None:
        return MqksConnectionError(f"cannot connect to {where} within {timeout:g}s")
    within = f" within {timeout:g}s" if retry else ""
    return MqksConnectionError(f"cannot connect to {where}{within}: {wire.connect_failure(cause)}")


class Flag(Protocol):
    """A gevent Event or an asyncio Event: what the shared bookkeeping sets, clears and reads."""

    def is_set(self) -> bool: ...

    def set(self) -> None: ...

    def clear(self) -> None: ...


class LinkConnection(Protocol):
    """A connection as the shared bookkeeping sees it (each client's `Connection`)."""

    lost: Any  # a Flag; Any so each client's own Event type matches
    reason: str
    ready: bool
    out: list[bytes]
    answers: Answers[Any]

    def write(self, line: bytes) -> None: ...

    def request(self, rid: bytes, line: bytes) -> Any: ...


class LinkBase:
    """A link's settings and shared bookkeeping; each client's `Link` adds the transport and its waits."""

    log = logging.getLogger("mqks.client")
    _connected: Flag  # set while a live, handshaken connection exists (each client's own Event)

    def __init__(self, host: str, port: int, session: Any, new_rid: Callable[[], bytes], *, ping_seconds: float,
                 ping_timeout_seconds: float, reconnect_min_seconds: float, reconnect_max_seconds: float,
                 timeout_seconds: float, connect_timeout_seconds: float, tls: ssl.SSLContext | None = None,
                 token: bytes | None = None, ttl_seconds: float | None = None,
                 fallbacks: list[tuple[str, int]] | tuple[()] = (), unix: str | None = None,
                 tls_hostname: str | None = None, anonymous: bool = False) -> None:
        self.host = host  # the address connected to, or tried next
        self.port = port
        # a Unix socket of the same broker, preferred to host:port (the first address) while it exists
        self.unix = unix
        # the name the broker's certificate is checked against: a direct address is still the public broker
        self.tls_hostname = tls_hostname
        # tried in turn when one cannot be reached, and left for the next when its broker drains
        self.addresses = [(host, port), *fallbacks]
        self.address_index = 0
        self.tls = tls
        self.token = token
        self.ttl_seconds = ttl_seconds  # sent as `hello --ttl`: the broker drops us after 2x that in silence
        # connect to a broker that wants a token without one, for what needs none (ping): its hello is refused
        self.anonymous = anonymous
        self.server_info: dict[str, Any] | None = None  # the last `hello` answer; None from a broker without hello
        self.session = session
        self.new_rid = new_rid
        self.ping_seconds = ping_seconds
        self.ping_timeout_seconds = ping_timeout_seconds
        self.reconnect_min_seconds = reconnect_min_seconds
        self.reconnect_max_seconds = reconnect_max_seconds
        self.timeout_seconds = timeout_seconds
        self.connect_timeout_seconds = connect_timeout_seconds
        self._random = random.Random()
        self.closed = False
        self.reconnects = 0
        self.last_error: OSError | MqksError | None = None  # why the last connect attempt failed
        self._unsent_publishes: list[bytes] = []

    @property
    def connected(self) -> bool:
        """True while a live, handshaken connection exists."""
        return self._connected.is_set()

    def _mark_lost(self, conn: LinkConnection, reason: str, error: MqksError | None, current: bool) -> bool:
        """Mark `conn` dead once: fail its pending answers (with `error`, if given); False if it already was.

        `current` says `conn` is the link's connection of the moment (then the link is no longer connected).
        """
        if conn.lost.is_set():
            return False
        conn.reason = reason
        if current:
            self._connected.clear()
        if not self.closed and conn.ready:
            # a connection lost during its handshake is reported by the connect attempt that made it
            self.log.warning("mqks %s:%s: connection lost: %s", self.host, self.port, reason)
        conn.answers.fail_all(error or MqksConnectionError(f"connection lost: {reason}"))
        conn.lost.set()
        return True

    def _attempt_failed(self, error: OSError | MqksError, tried: int) -> int:
        """Note a failed connect and move to the next address; returns how many failed in a row (0: a full round)."""
        self.last_error = error
        tried += 1
        failed_at = f"{self.host}:{self.port}"
        self._next_address()
        if tried < len(self.addresses):
            self.log.info("mqks %s: connect failed (%s); trying %s:%s", failed_at, error, self.host, self.port)
            return tried  # another address to try before backing off
        return 0

    def _next_address(self) -> None:
        self.address_index = (self.address_index + 1) % len(self.addresses)
        self.host, self.port = self.addresses[self.address_index]

    def _retry_delay(self, error: OSError | MqksError, attempt: int) -> float:
        """The back-off after a full round of failed addresses, logged."""
        delay = self._backoff_seconds(attempt)
        # before the first connection connect() is waiting and will raise: no need to shout
        self.log.log(logging.WARNING if self.reconnects else logging.INFO,
                     "mqks %s:%s: connect failed (%s); retrying in %.2fs", self.host, self.port, error, delay)
        return delay

    def _backoff_seconds(self, attempt: int) -> float:
        """Exponential backoff capped at reconnect_max_seconds, with jitter so clients do not stampede."""
        delay = min(self.reconnect_max_seconds, self.reconnect_min_seconds * (2 ** min(attempt, 30)))
        return self._random.uniform(delay / 2, delay)

    def _introduction(self, conn: LinkConnection) -> tuple[bytes, Any, bytes, Any]:
        """Send `auth` (with a token) and `hello [--ttl]` at once: their rids and awaitable answers (None: no auth)."""
        auth_rid = self.new_rid()
        auth = conn.request(auth_rid, auth_rid + b" auth " + self.token + b"\n") if self.token else None
        hello_rid = self.new_rid()
        return auth_rid, auth, hello_rid, conn.request(hello_rid, wire.hello_line(hello_rid, self.ttl_seconds))

    def _auth_refused(self, error: MqksError, where: str) -> None:
        """`auth` answered an error: raise the refusal it means, else go on without a token."""
        refusal = wire.auth_refusal(error)
        if refusal is not None:
            raise refusal from None
        # a broker without auth (or older than it) serves anyone: the token protects it, not us
        self.log.info("mqks %s: the broker takes no token; connected without one", where)

    def _hello_refused(self, error: MqksError) -> None:
        """`hello` answered an error: raise the refusal it means, else go on knowing nothing of the broker."""
        refusal = wire.hello_refusal(error, self.token is not None, self.anonymous)
        if refusal is not None:
            raise refusal from None
        # a broker that predates hello (no TTL agreed either), or an anonymous client: only ping will work
        self.server_info = None

    def _keep_unsent(self, conn: LinkConnection) -> None:
        """A lost connection's lines never sent: its plain publishes go again on the next one, the rest are gone."""
        if not self.closed:
            self._unsent_publishes.extend(line for line in conn.out if wire.is_fire_and_forget_publish(line))
        conn.out = []

    def _send_unsent(self, conn: LinkConnection) -> None:
        """Publishes that never reached the old connection go after the replay, before any new line."""
        for line in self._unsent_publishes:
            conn.write(line)
        self._unsent_publishes = []

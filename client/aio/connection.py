"""The asyncio client's link to the broker: one live connection at a time, as an asyncio Protocol.

A line travels: caller -> `Connection.write` (batched until the loop runs, or past HIGH_WATER_BYTES)
-> one `transport.write` per batch -> broker -> `data_received` (bytes.split) -> `Answers.take`
(client/answers.py, the gevent client's router too) -> a waiting future, or the `Session` (the
consumers). Invariants: the protocol never runs user code; a lost connection fails every future
waiting on it; on a new connection the session replays before the handshake pong, and no caller's line
goes out before that pong; a caller cancelled while waiting leaves nothing behind (its rid is dropped).
Back-pressure both ways: a caller awaits `writable()` while the transport is paused, and a consumer
whose local buffer is full pauses reading (`hold_back`) until its iterator catches up.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, cast

from mqks.client import wire
from mqks.client.answers import DRAINING, Answers, Deliveries
from mqks.client.errors import MqksConnectionError, MqksError, MqksProtocolError, MqksTimeoutError
from mqks.client.linking import LinkBase

log = logging.getLogger("mqks.aio")

# past this many unsent bytes a write goes to the transport at once: a publish loop that never yields
# still reaches the socket, and the transport's own back-pressure (pause_writing) reaches the caller
HIGH_WATER_BYTES = 256 * 1024
DRAIN_POLL_SECONDS = 0.02
DRAIN_WAIT_SECONDS = 60.0  # the broker closes at its own --drain-seconds anyway; this only bounds our wait


class Session(Deliveries, Protocol):
    """What runs on top of the link: replayed on every new connection, told of lines and of the loss."""

    def replay(self, conn: Connection) -> Callable[[float], Awaitable[None]]:
        """Queue the requests a new connection needs first; returns what awaits their answers by a deadline."""

    def disconnected(self, notify: bool, closed: bool) -> None:
        """The connection is gone; `notify` is False while handshaking or closing, `closed` when closing."""

    def holds_unacked(self) -> bool:
        """True while a manual-ack consumer holds a delivery it has not acked or rejected yet."""


def _resolve(future: asyncio.Future[bytes], data: bytes) -> None:
    if not future.done():  # a caller that was cancelled left its future cancelled
        future.set_result(data)


def _fail(future: asyncio.Future[bytes], error: MqksError) -> None:
    if not future.done():
        future.set_exception(error)
        # marked as seen: a request whose caller is gone (the handshake's, after an earlier step failed)
        # must not log "exception was never retrieved"; a caller awaiting it still gets the error
        future.exception()


class Connection(asyncio.Protocol):
    """One connection: its output batch, its pending answers, its back-pressure, its tasks."""

    def __init__(self, link: Link, where: str) -> None:
        self.link = link
        self.where = where  # host:port, for error texts
        self.loop = asyncio.get_running_loop()
        self.answers: Answers[asyncio.Future[bytes]] = Answers(link.session, where, _resolve, _fail)
        self.transport: asyncio.Transport | None = None
        self.out: list[bytes] = []
        self.out_bytes = 0
        self.flush_scheduled = False
        self.parts: list[bytes] = []  # a line longer than one read, kept whole until its newline comes
        self.lost = asyncio.Event()
        self.reason = ""
        self.ready = False  # handshaken: before that, a line that is not MQKS means a wrong peer
        self.draining = False  # the broker said `--draining`: leave once our consumers hold nothing
        self.tasks: list[asyncio.Task[None]] = []
        self.write_paused: asyncio.Future[None] | None = None  # set while the transport's buffer is full
        self.held_back_by: set[object] = set()  # consumers whose buffer is full: reading is paused for them

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport (uvloop's is not a subclass of asyncio.Transport, only shaped like one)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        """Split the stream into lines and route each."""
        if b"\n" not in data:
            self.parts.append(data)
            return
        if self.parts:
            self.parts.append(data)
            data = b"".join(self.parts)
        lines = data.split(b"\n")
        tail = lines.pop()
        self.parts = [tail] if tail else []
        take = self.answers.take
        for line in lines:
            try:
                outcome = take(line, self.ready)
            except Exception:
                log.exception("mqks %s: cannot handle %r", self.where, line[:200])
                continue
            if outcome is DRAINING:
                self.link.on_draining(self)
            elif isinstance(outcome, MqksProtocolError):
                self.link.lose(self, outcome.reason, outcome)
                return

    def eof_received(self) -> bool:
        self.link.lose(self, "closed by the broker")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.lose(self, f"receive failed: {exc}" if exc else "closed by the broker")
        self._wake_writers()

    def pause_writing(self) -> None:
        if self.write_paused is None:
            self.write_paused = self.loop.create_future()

    def resume_writing(self) -> None:
        self._wake_writers()

    # --- writing ---

    def write(self, line: bytes) -> None:
        """Queue one line (with its newline) for the batch the loop sends when it next runs."""
        self.out.append(line)
        self.out_bytes += len(line)
        if self.out_bytes > HIGH_WATER_BYTES:
            self.flush()
        elif not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Hand everything queued so far to the transport in one write."""
        self.flush_scheduled = False
        if not self.out or self.transport is None or self.lost.is_set():
            return
        batch = b"".join(self.out)
        self.out = []
        self.out_bytes = 0
        self.transport.write(batch)

    async def writable(self) -> None:
        """Wait while the transport's buffer is over its high-water mark (a broker slower than our callers)."""
        while self.write_paused is not None and not self.lost.is_set():
            await asyncio.shield(self.write_paused)

    def _wake_writers(self) -> None:
        waiter, self.write_paused = self.write_paused, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- reading back-pressure ---

    def hold_back(self, consumer: object) -> None:
        """`consumer`'s buffer is full: stop reading until every such consumer has caught up."""
        if not self.held_back_by and self.transport is not None and not self.lost.is_set():
            self.transport.pause_reading()
        self.held_back_by.add(consumer)

    def release(self, consumer: object) -> None:
        """`consumer` has caught up (or left): read again once no consumer holds back."""
        if consumer in self.held_back_by:
            self.held_back_by.discard(consumer)
            if not self.held_back_by and self.transport is not None and not self.lost.is_set():
                self.transport.resume_reading()

    # --- requests ---

    def request(self, rid: bytes, line: bytes, lines: list[bytes] | None = None) -> asyncio.Future[bytes]:
        """Queue a line whose answer is awaited; the future gets the ok data or an MqksError.

        With `lines`, the answer comes in several `ok` lines: their data go into `lines`, in order,
        and the future is set (with b"") by the closing `ok --end`.
        """
        future: asyncio.Future[bytes] = self.loop.create_future()
        self.answers.add(rid, future, lines)
        self.write(line)
        return future

    async def wait(self, rid: bytes, future: asyncio.Future[bytes], deadline: float, what: str) -> bytes:
        """The ok data of `future`; MqksError for an error answer, MqksTimeoutError after `deadline` (loop time).

        However the wait ends (the caller's cancellation included), `rid` no longer waits here.
        """
        try:
            async with asyncio.timeout_at(deadline):
                return await future
        except TimeoutError as e:
            if isinstance(e, MqksError):
                raise
            raise MqksTimeoutError(f"no answer to {what} from {self.where} in time") from None
        finally:
            if not future.done():
                self.answers.discard(rid)
                future.cancel()


class Link(LinkBase):
    """Keeps one live, handshaken connection to host:port: connects, keeps alive, reconnects with backoff.

    A send or call made while disconnected waits for the reconnect until its deadline, then raises
    MqksConnectionError. Plain publishes that never reached a lost transport go out again on the next one.
    Its settings and bookkeeping are `LinkBase`'s (client/linking.py), shared with the gevent client.
    """

    log = log
    _connected: asyncio.Event

    def __init__(self, host: str, port: int, session: Session, new_rid: Callable[[], bytes], **settings: Any) -> None:
        super().__init__(host, port, session, new_rid, **settings)
        self.session: Session = session
        self.conn: Connection | None = None
        self.live_conn: Connection | None = None  # `conn` while connected, else None: one check on the hot path
        self._connected = asyncio.Event()
        self._settled = asyncio.Event()  # connected, or closed: what a waiting caller wakes for
        self._attempted = asyncio.Event()  # a connect attempt ended (for start(retry=False))
        self._manager: asyncio.Task[None] | None = None

    async def wait_connected(self, timeout: float | None = None) -> bool:
        """Wait until connected (or `timeout` passes); returns whether connected."""
        try:
            async with asyncio.timeout(timeout):
                await self._connected.wait()
        except TimeoutError:
            pass
        return self._connected.is_set()

    async def start(self, timeout: float, retry: bool = True) -> bool:
        """Start connecting (retrying with backoff) unless started; returns whether connected within `timeout`.

        `retry=False` returns False at the first failed attempt (`last_error` says why).
        """
        self.begin()
        if retry:
            return await self.wait_connected(timeout)
        try:
            async with asyncio.timeout(timeout):
                await self._attempted.wait()
        except TimeoutError:
            pass
        return self._connected.is_set()

    def begin(self) -> None:
        """Start connecting in the background unless started: callers may wait for it (`live`) at once."""
        if self.closed:
            raise MqksConnectionError("client closed")
        if self._manager is None:
            self._manager = asyncio.get_running_loop().create_task(self._run(),
                                                                   name=f"mqks link {self.host}:{self.port}")

    async def close(self) -> None:
        """Stop for good: the manager, the connection's tasks, the connection (its transport flushes first)."""
        if self.closed:
            return
        self.closed = True
        self.live_conn = None
        self._connected.clear()
        self._settled.set()
        manager = self._manager
        if manager is not None and manager is not asyncio.current_task():
            manager.cancel()
            await asyncio.gather(manager, return_exceptions=True)
        if self.conn is not None:
            conn = self.conn
            conn.flush()
            self.lose(conn, "client closed")
            await self._teardown(conn, notify=False)

    async def live(self, deadline: float) -> Connection:
        """The current connection, waiting for a reconnect until `deadline` (loop time)."""
        conn = self.conn
        if conn is not None and self._connected.is_set():
            return conn
        if self.closed:
            raise MqksConnectionError("client closed")
        if self._manager is None:
            raise MqksConnectionError("not connected: call connect() first")
        loop = asyncio.get_running_loop()
        while not self._connected.is_set():
            if self.closed:
                raise MqksConnectionError("client closed")
            if loop.time() >= deadline:
                raise MqksConnectionError(f"not connected to {self.host}:{self.port} in time")
            try:
                async with asyncio.timeout_at(deadline):
                    await self._settled.wait()
            except TimeoutError:
                pass
        conn = self.conn
        assert conn is not None  # _connected is set only with a connection
        return conn

    def lose(self, conn: Connection, reason: str, error: MqksError | None = None) -> None:
        """Mark `conn` dead once: fail its pending answers (with `error`, if given) and wake the manager."""
        if conn is self.live_conn:
            self.live_conn = None
        if not self._mark_lost(conn, reason, error, conn is self.conn):
            return
        if conn is self.conn and not self.closed:
            self._settled.clear()
        if conn.transport is not None:
            if self.closed:
                conn.transport.close()  # what is written goes out first
            else:
                conn.transport.abort()

    async def _run(self) -> None:
        """Keep one live connection: connect, handshake, wait until lost, back off, again."""
        attempt = 0
        tried = 0  # addresses that failed in a row since the last full round
        while not self.closed:
            try:
                conn = await self._open()
            except (OSError, MqksError) as e:
                tried = self._attempt_failed(e, tried)
                if tried:
                    continue  # another address to try before backing off
                self._attempted.set()
                delay = self._retry_delay(e, attempt)
                attempt += 1
                await asyncio.sleep(delay)
                continue
            tried = 0
            if attempt or self.reconnects:
                log.info("mqks %s:%s: connected", self.host, self.port)
            self.last_error = None
            self.live_conn = conn
            self._connected.set()
            self._settled.set()
            self._attempted.set()
            loop = asyncio.get_running_loop()
            opened_at = loop.time()
            await conn.lost.wait()
            self._connected.clear()
            await self._teardown(conn)
            self.reconnects += 1
            if conn.draining:
                self._next_address()  # that broker is stopping: the next address first, if there is one
            if loop.time() - opened_at >= self.reconnect_max_seconds:
                attempt = 0  # it was a good connection: try again at once
            else:
                # a broker that accepts, answers and drops us again must not get a reconnect storm
                await asyncio.sleep(self._backoff_seconds(attempt))
                attempt += 1

    async def _open(self) -> Connection:
        """A new connection with the session replayed and a pong back; raises on failure."""
        loop = asyncio.get_running_loop()
        conn = Connection(self, f"{self.host}:{self.port}")
        try:
            async with asyncio.timeout(self.connect_timeout_seconds):  # the TLS handshake included
                if self.unix is not None and self.address_index == 0 and os.path.exists(self.unix) and not self.tls:
                    try:
                        await loop.create_unix_connection(lambda: conn, self.unix)
                    except OSError as e:
                        log.info("mqks %s: cannot connect (%s); using %s:%s", self.unix, e, self.host, self.port)
                if conn.transport is None:
                    await loop.create_connection(lambda: conn, self.host, self.port, ssl=self.tls,
                                                 server_hostname=(self.tls_hostname or self.host) if self.tls else None)
        except TimeoutError:
            raise MqksConnectionError(f"cannot connect to {self.host}:{self.port} "
                                      f"within {self.connect_timeout_seconds:g}s") from None
        self.conn = conn
        try:
            deadline = loop.time() + self.timeout_seconds
            await self._introduce(conn, deadline)
            confirm_replays = self.session.replay(conn)
            rid = self.new_rid()
            pong = conn.request(rid, rid + b" ping handshake\n")
            await conn.wait(rid, pong, deadline, "handshake ping")
            await confirm_replays(deadline)
            if conn.lost.is_set():
                raise MqksConnectionError(f"connection lost during the handshake: {conn.reason}")
        except BaseException:
            self.lose(conn, "handshake failed")
            await self._teardown(conn, notify=False)
            raise
        conn.ready = True
        self._send_unsent(conn)
        conn.tasks.append(loop.create_task(self._ping_loop(conn), name=f"mqks ping {conn.where}"))
        return conn

    async def _introduce(self, conn: Connection, deadline: float) -> None:
        """`auth` (with a token), then `hello [--ttl]`, before any consumer is replayed (as the gevent client)."""
        auth_rid, auth, hello_rid, hello = self._introduction(conn)
        if auth is not None:
            try:
                await conn.wait(auth_rid, auth, deadline, "auth")
            except MqksConnectionError:
                raise
            except MqksError as e:
                self._auth_refused(e, conn.where)
        try:
            self.server_info = wire.hello_info(await conn.wait(hello_rid, hello, deadline, "hello"))
        except MqksConnectionError:
            raise
        except MqksError as e:
            self._hello_refused(e)

    def on_draining(self, conn: Connection) -> None:
        """The broker is stopping: settle what our consumers hold, then leave and reconnect (later, or elsewhere)."""
        if conn.draining:
            return
        conn.draining = True
        log.info("mqks %s:%s: the broker is draining; reconnecting once our consumers have settled", self.host,
                 self.port)

        async def leave_when_settled() -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + DRAIN_WAIT_SECONDS
            while self.session.holds_unacked() and not conn.lost.is_set() and loop.time() < deadline:
                await asyncio.sleep(DRAIN_POLL_SECONDS)
            conn.flush()  # the last acks go out before we hang up
            self.lose(conn, "the broker is draining")

        conn.tasks.append(asyncio.get_running_loop().create_task(leave_when_settled()))

    async def _teardown(self, conn: Connection, notify: bool = True) -> None:
        """End a lost connection's tasks, keep its unsent publishes; `notify` runs on_disconnect hooks."""
        current = asyncio.current_task()
        tasks = [task for task in conn.tasks if task is not current]
        conn.tasks = []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._keep_unsent(conn)
        conn.out_bytes = 0
        self.session.disconnected(notify, self.closed)

    async def _ping_loop(self, conn: Connection) -> None:
        """Keepalive: a pong missing for ping_timeout_seconds means a dead connection.

        While reading is paused for a full consumer buffer no pong can be read: that is not a dead link.
        """
        loop = asyncio.get_running_loop()
        while not conn.lost.is_set():
            await asyncio.sleep(self.ping_seconds)
            rid = self.new_rid()
            future = conn.request(rid, rid + b" ping keepalive\n")
            try:
                await conn.wait(rid, future, loop.time() + self.ping_timeout_seconds, "keepalive ping")
            except MqksTimeoutError:
                if conn.held_back_by:
                    continue
                self.lose(conn, f"no pong within {self.ping_timeout_seconds}s")
                return
            except MqksError:
                return

    async def send(self, line: bytes, deadline: float) -> None:
        """Queue a line that gets no answer, waiting for a connection until `deadline`."""
        conn = await self.live(deadline)
        conn.write(line)
        if conn.write_paused is not None:
            await conn.writable()

    async def call(self, action: bytes, args: bytes, deadline: float, retry: bool = False,
                   lines: list[bytes] | None = None) -> tuple[bytes, bytes]:
        """Send `{rid} {action} {args}` and return (rid, ok data) once answered; MqksError for an error.

        With `retry`, a request cut off by a lost connection goes again, under a new rid, on the next
        connection until `deadline`: at least once, so only for requests that may be done twice.
        """
        while True:
            conn = await self.live(deadline)
            rid = self.new_rid()
            if lines is not None:
                lines.clear()  # a retry starts the answer over
            future = conn.request(rid, b"".join((rid, b" ", action, b" ", args, b"\n")), lines)
            try:
                return rid, await conn.wait(rid, future, deadline, action.decode())
            except MqksConnectionError:
                if not retry or self.closed or asyncio.get_running_loop().time() >= deadline:
                    raise

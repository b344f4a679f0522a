"""The client's link to the broker: one live TCP connection at a time, run by gevent greenlets.

A line travels: caller -> `Connection.write` (batched) -> writer greenlet (one sendall per batch)
-> broker -> reader greenlet (recv 64 KiB, bytes.split) -> a waiting future, or the `Session` (the
consumers). Invariants: the reader never runs user code, so a slow callback cannot stall pongs or
confirms; a lost connection fails every future waiting on it; on a new connection the session
replays before the handshake pong, and no caller's line goes out before that pong. A request may
collect several `ok` lines (`queues`): they are kept in order until its `ok --end`.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol

import gevent
import gevent.socket
import gevent.ssl
from gevent.event import AsyncResult, Event
from gevent.lock import Semaphore

from . import wire
from .answers import DRAINING, Answers, Deliveries
from .errors import MqksConnectionError, MqksError, MqksProtocolError, MqksTimeoutError
from .linking import LinkBase

log = logging.getLogger("mqks.client")

RECV_BYTES = 65536
# past this many unsent bytes the caller flushes itself: a publish loop that never yields
# still reaches the socket, and back-pressure from a full socket reaches the caller
HIGH_WATER_BYTES = 256 * 1024
KILL_TIMEOUT_SECONDS = 1.0
DRAIN_POLL_SECONDS = 0.02
DRAIN_WAIT_SECONDS = 60.0  # the broker closes at its own --drain-seconds anyway; this only bounds our wait


class Session(Deliveries, Protocol):
    """What runs on top of the link: replayed on every new connection, told of lines and of the loss."""

    def replay(self, conn: Connection) -> Callable[[float], None]:
        """Queue the requests a new connection needs first; returns what checks their answers by a deadline."""

    def disconnected(self, notify: bool, closed: bool) -> None:
        """The connection is gone; `notify` is False while handshaking or closing, `closed` when closing."""

    def holds_unacked(self) -> bool:
        """True while a manual-ack consumer holds a delivery it has not acked or rejected yet."""


class Connection:
    """One TCP connection: its output batch, its pending answers, its greenlets."""

    __slots__ = ("sock", "where", "on_error", "out", "out_bytes", "wakeup", "send_lock", "answers", "lost", "reason",
                 "ready", "greenlets", "draining")

    def __init__(self, sock: socket.socket, where: str, on_error: Callable[[str], None], session: Session) -> None:
        self.sock = sock
        self.where = where  # host:port, for error texts
        self.on_error = on_error  # marks this connection lost
        self.out: list[bytes] = []
        self.out_bytes = 0
        self.wakeup = Event()
        self.send_lock = Semaphore()
        self.answers: Answers[AsyncResult] = Answers(session, where, AsyncResult.set, AsyncResult.set_exception)
        self.lost = Event()
        self.reason = ""
        self.ready = False  # handshaken: before that, a line that is not MQKS means a wrong peer
        self.greenlets: list[gevent.Greenlet] = []
        self.draining = False  # the broker said `--draining`: leave once our consumers hold nothing

    def write(self, line: bytes) -> None:
        """Queue one line (with its newline) for the next batch."""
        self.out.append(line)
        self.out_bytes += len(line)
        if self.out_bytes <= HIGH_WATER_BYTES:
            self.wakeup.set()
            return
        try:
            self.flush()
        except OSError:
            pass  # flush has marked the connection lost

    def request(self, rid: bytes, line: bytes, lines: list[bytes] | None = None) -> AsyncResult:
        """Queue a line whose answer is awaited; the future gets the ok data or an MqksError.

        With `lines`, the answer comes in several `ok` lines: their data go into `lines`, in order,
        and the future is set (with b"") by the closing `ok --end`.
        """
        future = AsyncResult()
        self.answers.add(rid, future, lines)
        self.write(line)
        return future

    def wait(self, rid: bytes, future: AsyncResult, deadline: float, what: str) -> bytes:
        """The ok data of `future`; MqksError for an error answer, MqksTimeoutError after `deadline`.

        However the wait ends (a caller's own gevent.Timeout included), `rid` no longer waits here.
        """
        try:
            # wait(), not get(timeout): a caller's gevent.Timeout must stay theirs, not become ours
            future.wait(max(0.0, deadline - time.monotonic()))
        finally:
            if not future.ready():
                self.answers.discard(rid)
        if not future.ready():
            raise MqksTimeoutError(f"no answer to {what} from {self.where} in time")
        return future.get()

    def flush(self) -> None:
        """Send everything queued so far in one sendall; raises OSError when the socket is dead."""
        with self.send_lock:
            if not self.out:
                return
            batch = b"".join(self.out)
            self.out = []
            self.out_bytes = 0
            try:
                self.sock.sendall(batch)
            except BaseException as e:
                # a sendall cut short (error, or a caller's gevent.Timeout) may leave half a line
                # on the wire: this stream can no longer be trusted
                self.on_error(f"send failed: {e!r}")
                raise


class Link(LinkBase):
    """Keeps one live, handshaken connection to host:port: connects, keeps alive, reconnects with backoff.

    A send or call made while disconnected waits for the reconnect until its deadline, then raises
    MqksConnectionError. Plain publishes that never reached a lost socket go out again on the next one.
    Its settings and bookkeeping are `LinkBase`'s (client/linking.py), shared with the asyncio client.
    """

    _connected: Event

    def __init__(self, host: str, port: int, session: Session, new_rid: Callable[[], bytes], **settings: Any) -> None:
        super().__init__(host, port, session, new_rid, **settings)
        self.session: Session = session
        self.conn: Connection | None = None
        self._connected = Event()
        self._closing = Event()  # wakes callers waiting for a reconnect that will never come
        self._manager: gevent.Greenlet | None = None
        self._failed = Event()  # a connect attempt failed (for start(retry=False))

    def wait_connected(self, timeout: float | None = None) -> bool:
        """Block until connected (or `timeout` passes); returns whether connected."""
        return self._connected.wait(timeout)

    def start(self, timeout: float, retry: bool = True) -> bool:
        """Start connecting (retrying with backoff) unless started; returns whether connected within `timeout`.

        `retry=False` returns False at the first failed attempt (`last_error` says why); the link
        goes on retrying in the background until closed.
        """
        self.begin()
        if retry:
            return self._connected.wait(timeout)
        gevent.wait([self._connected, self._failed], timeout=timeout, count=1)
        return self._connected.is_set()

    def begin(self) -> None:
        """Start connecting in the background unless started: callers may wait for it (`live`) at once."""
        if self.closed:
            raise MqksConnectionError("client closed")
        if self._manager is None:
            self._manager = gevent.spawn(self._run)

    def close(self, greenlets: list[gevent.Greenlet]) -> None:
        """Stop for good: kill the manager and `greenlets` (the consumers'), then drop the connection quietly."""
        self.closed = True
        self._closing.set()
        self._connected.clear()
        if self._manager is not None and self._manager is not gevent.getcurrent():
            greenlets = [self._manager, *greenlets]
        gevent.killall(greenlets, timeout=KILL_TIMEOUT_SECONDS)
        if self.conn is not None:
            self.lose(self.conn, "client closed")
            self._teardown(self.conn, notify=False)

    def live(self, deadline: float) -> Connection:
        """The current connection, waiting for a reconnect until `deadline`."""
        if self.closed:
            raise MqksConnectionError("client closed")
        if self._manager is None:
            raise MqksConnectionError("not connected: call connect() first")
        # a loop: a connection may be up and lost again before this greenlet gets to run
        while not self._connected.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                raise MqksConnectionError(f"not connected to {self.host}:{self.port} in time")
            gevent.wait([self._connected, self._closing], timeout=left, count=1)
            if self.closed:
                raise MqksConnectionError("client closed")
        conn = self.conn
        assert conn is not None  # _connected is set only with a connection
        return conn

    def lose(self, conn: Connection, reason: str, error: MqksError | None = None) -> None:
        """Mark `conn` dead once: fail its pending answers (with `error`, if given) and wake the manager."""
        self._mark_lost(conn, reason, error, conn is self.conn)

    def _run(self) -> None:
        """Keep one live connection: connect, handshake, wait until lost, back off, again."""
        attempt = 0
        tried = 0  # addresses that failed in a row since the last full round
        while not self.closed:
            try:
                conn = self._open()
            except (OSError, MqksError) as e:
                tried = self._attempt_failed(e, tried)
                if tried:
                    continue  # another address to try before backing off
                self._failed.set()
                delay = self._retry_delay(e, attempt)
                attempt += 1
                gevent.sleep(delay)
                continue
            tried = 0
            if attempt or self.reconnects:
                log.info("mqks %s:%s: connected", self.host, self.port)
            self.last_error = None
            self._failed.clear()
            self._connected.set()
            opened_at = time.monotonic()
            conn.lost.wait()
            self._connected.clear()
            self._teardown(conn)
            self.reconnects += 1
            if conn.draining:
                self._next_address()  # that broker is stopping: the next address first, if there is one
            if time.monotonic() - opened_at >= self.reconnect_max_seconds:
                attempt = 0  # it was a good connection: try again at once
            else:
                # a broker that accepts, answers and drops us again must not get a reconnect storm
                gevent.sleep(self._backoff_seconds(attempt))
                attempt += 1

    def _open(self) -> Connection:
        """A new connection with the session replayed and a pong back; raises on failure."""
        sock = self._connect_unix()
        if sock is None:
            sock = gevent.socket.create_connection((self.host, self.port), timeout=self.connect_timeout_seconds)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is not None:
            sock = self._wrap_tls(sock)  # the handshake runs under the connect timeout
        sock.settimeout(None)
        conn = Connection(sock, f"{self.host}:{self.port}", lambda reason: self.lose(conn, reason), self.session)
        self.conn = conn
        conn.greenlets = [gevent.spawn(self._read_loop, conn), gevent.spawn(self._write_loop, conn)]
        try:
            deadline = time.monotonic() + self.timeout_seconds
            self._introduce(conn, deadline)
            confirm_replays = self.session.replay(conn)
            rid = self.new_rid()
            pong = conn.request(rid, rid + b" ping handshake\n")
            conn.wait(rid, pong, deadline, "handshake ping")
            confirm_replays(deadline)
            if conn.lost.is_set():
                raise MqksConnectionError(f"connection lost during the handshake: {conn.reason}")
        except BaseException:
            self.lose(conn, "handshake failed")
            self._teardown(conn, notify=False)
            raise
        conn.ready = True
        self._send_unsent(conn)
        conn.greenlets.append(gevent.spawn(self._ping_loop, conn))
        return conn

    def _connect_unix(self) -> socket.socket | None:
        """A connected Unix socket when one is set for this address and answers; else None (TCP then)."""
        if self.unix is None or self.address_index != 0 or not os.path.exists(self.unix):
            return None
        sock = gevent.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.connect_timeout_seconds)
        try:
            sock.connect(self.unix)
        except OSError as e:
            sock.close()
            log.info("mqks %s: cannot connect (%s); using %s:%s", self.unix, e, self.host, self.port)
            return None
        return sock

    def _wrap_tls(self, sock: socket.socket) -> socket.socket:
        """The TLS socket over `sock`, handshaken; ssl.SSLError (an OSError) when the broker's certificate fails."""
        try:
            # gevent's SSLSocket takes any context, a plain ssl.SSLContext included; the context's own
            # wrap_socket would make a blocking stdlib socket of it
            return gevent.ssl.SSLSocket(sock=sock, server_hostname=self.tls_hostname or self.host, _context=self.tls)
        except BaseException:
            sock.close()
            raise

    def _introduce(self, conn: Connection, deadline: float) -> None:
        """`auth` (with a token), then `hello [--ttl]`, before any consumer is replayed.

        A broker without `hello` (a spec server) is fine: `server_info` is None then. A broker that
        wants a token we lack, or refuses ours, fails the connect with its reason.
        """
        auth_rid, auth, hello_rid, hello = self._introduction(conn)
        if auth is not None:
            try:
                conn.wait(auth_rid, auth, deadline, "auth")
            except MqksConnectionError:
                raise
            except MqksError as e:
                self._auth_refused(e, conn.where)
        try:
            self.server_info = wire.hello_info(conn.wait(hello_rid, hello, deadline, "hello"))
        except MqksConnectionError:
            raise
        except MqksError as e:
            self._hello_refused(e)

    def _on_draining(self, conn: Connection) -> None:
        """The broker is stopping: settle what our consumers hold, then leave and reconnect (later, or elsewhere)."""
        if conn.draining:
            return
        conn.draining = True
        log.info("mqks %s:%s: the broker is draining; reconnecting once our consumers have settled", self.host,
                 self.port)

        def leave_when_settled() -> None:
            deadline = time.monotonic() + DRAIN_WAIT_SECONDS
            while self.session.holds_unacked() and not conn.lost.is_set() and time.monotonic() < deadline:
                gevent.sleep(DRAIN_POLL_SECONDS)
            try:
                conn.flush()  # the last acks go out before we hang up
            except OSError:
                pass
            self.lose(conn, "the broker is draining")

        conn.greenlets.append(gevent.spawn(leave_when_settled))

    def _teardown(self, conn: Connection, notify: bool = True) -> None:
        """Stop a lost connection's greenlets, keep its unsent publishes; `notify` runs on_disconnect hooks."""
        current = gevent.getcurrent()
        gevent.killall([g for g in conn.greenlets if g is not current], timeout=KILL_TIMEOUT_SECONDS)
        conn.greenlets = []
        try:
            conn.sock.close()
        except OSError:
            pass
        self._keep_unsent(conn)
        self.session.disconnected(notify, self.closed)

    def _read_loop(self, conn: Connection) -> None:
        """Split the stream into lines and route each; ends when the socket does."""
        parts: list[bytes] = []  # a line longer than one recv, kept whole until its newline comes
        try:
            while True:
                chunk = conn.sock.recv(RECV_BYTES)
                if not chunk:
                    self.lose(conn, "closed by the broker")
                    return
                if b"\n" not in chunk:
                    parts.append(chunk)
                    continue
                if parts:
                    parts.append(chunk)
                    chunk = b"".join(parts)
                lines = chunk.split(b"\n")
                tail = lines.pop()
                parts = [tail] if tail else []
                for line in lines:
                    try:
                        self._handle_line(conn, line)
                    except Exception:
                        log.exception("mqks %s:%s: cannot handle %r", self.host, self.port, line[:200])
        except OSError as e:
            self.lose(conn, f"receive failed: {e}")

    def _handle_line(self, conn: Connection, line: bytes) -> None:
        """Route one answer line: to the session, its waiting future, or the log."""
        outcome = conn.answers.take(line, conn.ready)
        if outcome is DRAINING:
            self._on_draining(conn)
        elif isinstance(outcome, MqksProtocolError):
            self.lose(conn, outcome.reason, outcome)

    def _write_loop(self, conn: Connection) -> None:
        """Send each batch the callers queued, once they yield."""
        try:
            while True:
                conn.wakeup.wait()
                conn.wakeup.clear()
                conn.flush()
        except OSError:
            pass  # flush has marked the connection lost

    def _ping_loop(self, conn: Connection) -> None:
        """Keepalive: a pong missing for ping_timeout_seconds means a dead connection."""
        while not conn.lost.is_set():
            gevent.sleep(self.ping_seconds)
            rid = self.new_rid()
            future = conn.request(rid, rid + b" ping keepalive\n")
            try:
                conn.wait(rid, future, time.monotonic() + self.ping_timeout_seconds, "keepalive ping")
            except MqksTimeoutError:
                self.lose(conn, f"no pong within {self.ping_timeout_seconds}s")
                return
            except MqksError:
                return

    def send(self, line: bytes, deadline: float) -> None:
        """Queue a line that gets no answer, waiting for a connection until `deadline`."""
        self.live(deadline).write(line)

    def call(self, action: bytes, args: bytes, deadline: float, retry: bool = False,
             lines: list[bytes] | None = None) -> tuple[bytes, bytes]:
        """Send `{rid} {action} {args}` and return (rid, ok data) once answered; MqksError for an error.

        With `retry`, a request cut off by a lost connection goes again, under a new rid, on the next
        connection until `deadline`: at least once, so only for requests that may be done twice.
        With `lines`, the answer is several `ok` lines up to `ok --end`: their data end up in `lines`.
        """
        while True:
            conn = self.live(deadline)
            rid = self.new_rid()
            if lines is not None:
                lines.clear()  # a retry starts the answer over
            future = conn.request(rid, b"".join((rid, b" ", action, b" ", args, b"\n")), lines)
            try:
                return rid, conn.wait(rid, future, deadline, action.decode())
            except MqksConnectionError:
                if not retry or self.closed or time.monotonic() >= deadline:
                    raise

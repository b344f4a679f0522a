"""The MQKS client: one TCP connection per `Client`, run by gevent greenlets.

A line travels: caller -> `_Connection.write` (batched) -> writer greenlet (one sendall per batch)
-> broker -> reader greenlet (recv 64 KiB, bytes.split) -> a confirm future, or a consumer's deque
-> that consumer's greenlet -> the callback.
Invariants: the reader never runs user code, so a slow or raising callback cannot stall pongs or
confirms; each consumer's callbacks run in delivery order in its own greenlet; a consumer id lives
for one connection only: a reconnect replays every live consumer under a new id, before any line
the caller sends on the new connection.
"""

from __future__ import annotations

import itertools
import logging
import random
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeAlias

import gevent
import gevent.socket
import ujson
from gevent.event import AsyncResult, Event
from gevent.lock import Semaphore

from . import wire
from .errors import MqksConnectionError, MqksError, MqksTimeoutError

log = logging.getLogger("mqks.client")

RECV_BYTES = 65536
# past this many unsent bytes the caller flushes itself: a publish loop that never yields
# still reaches the socket, and back-pressure from a full socket reaches the caller
HIGH_WATER_BYTES = 256 * 1024
KILL_TIMEOUT_SECONDS = 1.0


class Message:
    """One delivery. `ack`/`reject` matter only for a `manual_ack` consumer."""

    __slots__ = ("id", "event", "data", "retry", "consumer_id", "_consumer", "_settled")

    def __init__(self, msg_id: str, event: str, data: Any, retry: int, consumer_id: str,
                 consumer: _Consumer | None = None) -> None:
        self.id = msg_id
        self.event = event
        self.data = data
        self.retry = retry
        self.consumer_id = consumer_id
        self._consumer = consumer
        self._settled = False

    def ack(self, confirm: bool = False) -> None:
        """Ack once; a no-op for an auto-ack consumer (the broker acked on delivery) or when already settled."""
        self._settle(b"ack", confirm)

    def reject(self, confirm: bool = False) -> None:
        """Return the message to the front of its queue with retry + 1 (manual_ack consumers only)."""
        if self._consumer is not None and not self._consumer.manual_ack:
            raise MqksError("reject needs a consumer with manual_ack=True")
        self._settle(b"reject", confirm)

    def _settle(self, action: bytes, confirm: bool) -> None:
        consumer = self._consumer
        if self._settled or consumer is None or not consumer.manual_ack:
            return
        self._settled = True
        if self.consumer_id != consumer.id:
            # delivered on an earlier connection: the broker already requeued it, and the same
            # msg id may be in flight again under the new consumer id
            return
        consumer.client._settle(action, self.consumer_id, (self.id,), False, confirm)

    def __repr__(self) -> str:
        return (f"Message(id={self.id!r}, event={self.event!r}, data={self.data!r}, "
                f"retry={self.retry}, consumer_id={self.consumer_id!r})")


MessageCallback: TypeAlias = Callable[[Message], Any]


class _Consumer:
    """What the client needs to replay a consumer: queue, its current events, flags, callbacks."""

    __slots__ = ("client", "id", "first_id", "aliases", "reported_id", "queue", "events", "events_known", "manual_ack",
                 "delete_queue_when_unused", "prefetch", "callback", "json", "on_disconnect",
                 "on_reconnect", "pending", "wakeup", "greenlet", "unacked", "replaying", "active")

    def __init__(self, client: Client, consumer_id: str, queue: str, events: list[str], add: bool,
                 callback: MessageCallback, manual_ack: bool, delete_queue_when_unused: float | bool | None,
                 prefetch: int, json: bool, on_disconnect: Callable[[str], Any] | None,
                 on_reconnect: Callable[[str, str], Any] | None) -> None:
        self.client = client
        self.id = consumer_id
        self.first_id = consumer_id  # what consume() returned: valid for good
        self.aliases = [consumer_id]  # the ids `Client._consumers_by_any_id` knows it by
        self.reported_id = consumer_id  # the id the caller last heard of
        self.queue = queue
        self.events = list(events)
        # with --add and no --update back, the queue's other events are unknown: replay adds only ours
        self.events_known = not add
        self.manual_ack = manual_ack
        self.delete_queue_when_unused = delete_queue_when_unused
        self.prefetch = prefetch
        self.callback = callback
        self.json = json
        self.on_disconnect = on_disconnect
        self.on_reconnect = on_reconnect
        self.pending: deque[Message | Callable[[], Any]] = deque()
        self.wakeup = Event()
        self.greenlet: gevent.Greenlet | None = None
        # msg id -> deliveries on the current connection not yet settled; a count, not a set,
        # because msg ids are the publishers' and two publishers may both send "m1"
        self.unacked: dict[str, int] = {}
        self.replaying = False
        self.active = True

    def take_unacked(self, msg_id: str) -> bool:
        """Settle one delivery of `msg_id`; False when none is pending on this connection."""
        count = self.unacked.get(msg_id, 0)
        if count <= 1:
            return self.unacked.pop(msg_id, None) is not None
        self.unacked[msg_id] = count - 1
        return True

    def consume_line(self, confirm: bool) -> bytes:
        """The consume request that (re)creates this consumer with the queue's current events."""
        parts = [self.id.encode(), b"consume"]
        if confirm:
            parts.append(b"--confirm")
        parts.append(self.queue.encode())
        events = [event.encode() for event in self.events]
        if events and not self.events_known:
            parts.append(b"--add")
        parts.extend(events)
        parts.extend(wire.consume_flags(self.manual_ack, self.delete_queue_when_unused, self.prefetch))
        return b" ".join(parts) + b"\n"


class _Connection:
    """One TCP connection: its output batch, its pending answers, its greenlets."""

    __slots__ = ("sock", "on_error", "out", "out_bytes", "wakeup", "send_lock", "futures", "lost", "reason",
                 "greenlets")

    def __init__(self, sock: socket.socket, on_error: Callable[[str], None]) -> None:
        self.sock = sock
        self.on_error = on_error  # marks this connection lost
        self.out: list[bytes] = []
        self.out_bytes = 0
        self.wakeup = Event()
        self.send_lock = Semaphore()
        self.futures: dict[bytes, AsyncResult] = {}
        self.lost = Event()
        self.reason = ""
        self.greenlets: list[gevent.Greenlet] = []

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

    def request(self, rid: bytes, line: bytes) -> AsyncResult:
        """Queue a line whose answer is awaited; the future gets the ok data or an MqksError."""
        future = AsyncResult()
        self.futures[rid] = future
        self.write(line)
        return future

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


class Client:
    """A gevent MQKS client: publish, consume with callbacks, confirms, keepalive and reconnect.

    Many greenlets may share one client. Blocking calls wait at most `timeout_seconds` (or their own
    `timeout`). A call made while disconnected waits for the reconnect, then raises
    `MqksConnectionError`; nothing is dropped silently.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 25000, *, ping_seconds: float = 15.0,
                 ping_timeout_seconds: float | None = None, reconnect_min_seconds: float = 0.05,
                 reconnect_max_seconds: float = 5.0, timeout_seconds: float = 10.0,
                 connect_timeout_seconds: float = 10.0) -> None:
        self.host = host
        self.port = port
        self.ping_seconds = ping_seconds
        self.ping_timeout_seconds = ping_timeout_seconds if ping_timeout_seconds is not None else ping_seconds
        self.reconnect_min_seconds = reconnect_min_seconds
        self.reconnect_max_seconds = reconnect_max_seconds
        self.timeout_seconds = timeout_seconds
        self.connect_timeout_seconds = connect_timeout_seconds
        # a random prefix makes msg ids unique across clients: the broker keys un-acked messages by them
        self._rid_prefix = secrets.token_hex(6)
        self._rid_counter = itertools.count(1)
        self._random = random.Random()
        self._consumers_by_id: dict[str, _Consumer] = {}  # current ids only
        self._consumers_by_any_id: dict[str, _Consumer] = {}  # current and recent ids (see _keep_recent_aliases)
        self._conn: _Connection | None = None
        self._connected = Event()
        self._closed = False
        self._closing = Event()  # wakes callers waiting for a reconnect that will never come
        self._manager: gevent.Greenlet | None = None
        self._unsent_publishes: list[bytes] = []
        self.reconnects = 0

    @property
    def connected(self) -> bool:
        """True while a live, handshaken connection exists."""
        return self._connected.is_set()

    def wait_connected(self, timeout: float | None = None) -> bool:
        """Block until connected (or `timeout` passes); returns whether connected."""
        return self._connected.wait(timeout)

    def connect(self, timeout: float | None = None) -> Client:
        """Connect (retrying with backoff), or raise MqksConnectionError after `connect_timeout_seconds`."""
        if self._closed:
            raise MqksConnectionError("client closed")
        if self._manager is None:
            self._manager = gevent.spawn(self._run)
        timeout = self.connect_timeout_seconds if timeout is None else timeout
        if not self._connected.wait(timeout):
            self.close()
            raise MqksConnectionError(f"cannot connect to {self.host}:{self.port} within {timeout}s")
        return self

    def close(self, timeout: float | None = None) -> None:
        """Make sure the broker has read every line sent so far (ping barrier), then disconnect."""
        if self._closed:
            return
        if self._connected.is_set():
            try:
                self._call(b"ping", b"close", timeout=timeout)
            except MqksError as e:
                log.warning("mqks %s:%s: close could not flush: %s", self.host, self.port, e)
        self._closed = True
        self._closing.set()
        self._connected.clear()
        for consumer in self._consumers_by_id.values():
            consumer.active = False
        current = gevent.getcurrent()
        greenlets = [self._manager] if self._manager is not None and self._manager is not current else []
        greenlets += [consumer.greenlet for consumer in set(self._consumers_by_id.values())
                      if consumer.greenlet is not None and consumer.greenlet is not current]
        gevent.killall(greenlets, timeout=KILL_TIMEOUT_SECONDS)
        if self._conn is not None:
            self._lose(self._conn, "client closed")
            self._teardown(self._conn, notify=False)

    def __enter__(self) -> Client:
        return self.connect()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self) -> None:
        """Keep one live connection: connect, handshake, wait until lost, back off, again."""
        attempt = 0
        while not self._closed:
            try:
                conn = self._open()
            except (OSError, MqksError) as e:
                delay = self._backoff_seconds(attempt)
                attempt += 1
                # before the first connection connect() is waiting and will raise: no need to shout
                log.log(logging.WARNING if self.reconnects else logging.INFO,
                        "mqks %s:%s: connect failed (%s); retrying in %.2fs", self.host, self.port, e, delay)
                gevent.sleep(delay)
                continue
            if attempt or self.reconnects:
                log.info("mqks %s:%s: connected", self.host, self.port)
            self._connected.set()
            opened_at = time.monotonic()
            conn.lost.wait()
            self._connected.clear()
            self._teardown(conn)
            self.reconnects += 1
            if time.monotonic() - opened_at >= self.reconnect_max_seconds:
                attempt = 0  # it was a good connection: try again at once
            else:
                # a broker that accepts, answers and drops us again must not get a reconnect storm
                gevent.sleep(self._backoff_seconds(attempt))
                attempt += 1

    def _backoff_seconds(self, attempt: int) -> float:
        """Exponential backoff capped at reconnect_max_seconds, with jitter so clients do not stampede."""
        delay = min(self.reconnect_max_seconds, self.reconnect_min_seconds * (2 ** min(attempt, 30)))
        return self._random.uniform(delay / 2, delay)

    def _open(self) -> _Connection:
        """A new connection with every live consumer replayed and a pong back; raises on failure."""
        sock = gevent.socket.create_connection((self.host, self.port), timeout=self.connect_timeout_seconds)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Connection(sock, lambda reason: self._lose(conn, reason))
        self._conn = conn
        conn.greenlets = [gevent.spawn(self._read_loop, conn), gevent.spawn(self._write_loop, conn)]
        try:
            self._replay(conn)
            if conn.lost.is_set():
                raise MqksConnectionError(f"connection lost during the handshake: {conn.reason}")
        except BaseException:
            self._lose(conn, "handshake failed")
            self._teardown(conn, notify=False)
            raise
        # publishes that never reached the old socket go after the replay, before any new line
        for line in self._unsent_publishes:
            conn.write(line)
        self._unsent_publishes = []
        conn.greenlets.append(gevent.spawn(self._ping_loop, conn))
        return conn

    def _replay(self, conn: _Connection) -> None:
        """Recreate every live consumer under a new id, then wait for a pong: the broker is alive."""
        deadline = time.monotonic() + self.timeout_seconds
        replays: list[tuple[_Consumer, bytes, AsyncResult]] = []
        for consumer in list(self._consumers_by_id.values()):
            del self._consumers_by_id[consumer.id]
            consumer.id = self._new_rid().decode()
            self._keep_recent_aliases(consumer)
            consumer.unacked.clear()
            consumer.replaying = True
            self._consumers_by_id[consumer.id] = consumer
            self._consumers_by_any_id[consumer.id] = consumer
            rid = consumer.id.encode()
            replays.append((consumer, rid, conn.request(rid, consumer.consume_line(confirm=True))))
        rid = self._new_rid()
        pong = conn.request(rid, rid + b" ping handshake\n")
        self._wait(conn, rid, pong, deadline, "handshake ping")
        for consumer, rid, future in replays:
            try:
                self._wait(conn, rid, future, deadline, "consumer replay")
            except MqksConnectionError:
                raise
            except MqksError as e:
                # the broker refused this consumer on the new connection: it cannot come back
                log.error("mqks %s:%s: replay of consumer %s on queue %s failed, consumer dropped: %s",
                          self.host, self.port, consumer.reported_id, consumer.queue, e)
                self._forget_consumer(consumer)

    def _keep_recent_aliases(self, consumer: _Consumer) -> None:
        """Know the consumer by its new id, its first, its reported and its last few ids only.

        An alias kept per reconnect would pile up over months of a flapping network.
        """
        consumer.aliases.append(consumer.id)
        keep = {consumer.first_id, consumer.reported_id, *consumer.aliases[-3:]}
        for consumer_id in consumer.aliases:
            if consumer_id not in keep:
                self._consumers_by_any_id.pop(consumer_id, None)
        consumer.aliases = [consumer_id for consumer_id in consumer.aliases if consumer_id in keep]

    def _lose(self, conn: _Connection, reason: str) -> None:
        """Mark `conn` dead once: fail its pending answers and wake the manager."""
        if conn.lost.is_set():
            return
        conn.reason = reason
        if conn is self._conn:
            self._connected.clear()
        if not self._closed:
            log.warning("mqks %s:%s: connection lost: %s", self.host, self.port, reason)
        futures, conn.futures = conn.futures, {}
        error = MqksConnectionError(f"connection lost: {reason}")
        for future in futures.values():
            future.set_exception(error)
        conn.lost.set()

    def _teardown(self, conn: _Connection, notify: bool = True) -> None:
        """Stop a lost connection's greenlets, keep its unsent publishes; `notify` runs on_disconnect hooks."""
        current = gevent.getcurrent()
        gevent.killall([g for g in conn.greenlets if g is not current], timeout=KILL_TIMEOUT_SECONDS)
        conn.greenlets = []
        try:
            conn.sock.close()
        except OSError:
            pass
        if not self._closed:
            self._unsent_publishes.extend(line for line in conn.out if wire.is_fire_and_forget_publish(line))
        conn.out = []
        for consumer in self._consumers_by_id.values():
            consumer.unacked.clear()
            if consumer.manual_ack:
                # the broker put these back in the queue: running callbacks for them would double-process
                kept = [item for item in consumer.pending if not isinstance(item, Message)]
                consumer.pending.clear()
                consumer.pending.extend(kept)
            # after a failed handshake, a consumer already confirmed (and announced by on_reconnect)
            # on it hears about the loss too, so the hooks always alternate
            confirmed_here = not self._closed and consumer.reported_id == consumer.id
            if consumer.on_disconnect is not None and (notify or confirmed_here):
                consumer.pending.append(_notice(consumer.on_disconnect, consumer.reported_id))
                consumer.wakeup.set()

    def _read_loop(self, conn: _Connection) -> None:
        """Split the stream into lines and route each; ends when the socket does."""
        parts: list[bytes] = []  # a line longer than one recv, kept whole until its newline comes
        try:
            while True:
                chunk = conn.sock.recv(RECV_BYTES)
                if not chunk:
                    self._lose(conn, "closed by the broker")
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
            self._lose(conn, f"receive failed: {e}")

    def _handle_line(self, conn: _Connection, line: bytes) -> None:
        """Route one answer line: to its consumer, its waiting future, or the log."""
        rid, status, data = wire.split_answer(line.rstrip(b"\r"))
        if status == b"ok":
            consumer = self._consumers_by_id.get(rid.decode()) if data else None
            if consumer is not None:
                if wire.is_update(data):
                    self._on_update(consumer, data)
                else:
                    self._on_delivery(consumer, data)
                return
            future = conn.futures.pop(rid, None)
            if future is not None:
                consumer = self._consumers_by_id.get(rid.decode())
                if consumer is not None and consumer.replaying:
                    self._on_replayed(consumer)
                future.set(data)
            return
        if status == b"error":
            error_id, reason = wire.split_error(data)
            error = MqksError(reason, error_id, rid.decode(errors="replace"))
            future = conn.futures.pop(rid, None)
            if future is not None:
                future.set_exception(error)
                return
            consumer = self._consumers_by_id.get(rid.decode(errors="replace"))
            if consumer is not None:
                # only a consume line uses the consumer id as rid: the broker refused that consumer
                log.error("mqks %s:%s: consumer %s on queue %s refused: %s",
                          self.host, self.port, consumer.reported_id, consumer.queue, error)
                self._forget_consumer(consumer)
                return
            log.warning("mqks %s:%s: request %s failed: %s", self.host, self.port, error.rid, error)
            return
        log.warning("mqks %s:%s: unexpected line %r", self.host, self.port, line[:200])

    def _on_update(self, consumer: _Consumer, data: bytes) -> None:
        """Keep the consumer's view of its queue's events, so a replay never undoes a rebind."""
        _, events = wire.split_update(data)
        consumer.events = events
        consumer.events_known = True

    def _on_delivery(self, consumer: _Consumer, data: bytes) -> None:
        """Queue a delivery for the consumer's greenlet; data stays bytes until that greenlet decodes it."""
        msg_id, event, retry, body = wire.split_delivery(data)
        message = Message(msg_id.decode(), event.decode(), body, retry, consumer.id, consumer)
        if consumer.manual_ack:
            consumer.unacked[message.id] = consumer.unacked.get(message.id, 0) + 1
        consumer.pending.append(message)
        consumer.wakeup.set()

    def _on_replayed(self, consumer: _Consumer) -> None:
        """The broker confirmed a replayed consumer: queue on_reconnect before its first delivery."""
        consumer.replaying = False
        old_id, consumer.reported_id = consumer.reported_id, consumer.id
        if consumer.on_reconnect is not None:
            consumer.pending.append(_notice(consumer.on_reconnect, old_id, consumer.id))
            consumer.wakeup.set()

    def _write_loop(self, conn: _Connection) -> None:
        """Send each batch the callers queued, once they yield."""
        try:
            while True:
                conn.wakeup.wait()
                conn.wakeup.clear()
                conn.flush()
        except OSError:
            pass  # flush has marked the connection lost

    def _ping_loop(self, conn: _Connection) -> None:
        """Keepalive: a pong missing for ping_timeout_seconds means a dead connection."""
        while not conn.lost.is_set():
            gevent.sleep(self.ping_seconds)
            rid = self._new_rid()
            future = conn.request(rid, rid + b" ping keepalive\n")
            try:
                self._wait(conn, rid, future, time.monotonic() + self.ping_timeout_seconds, "keepalive ping")
            except MqksTimeoutError:
                self._lose(conn, f"no pong within {self.ping_timeout_seconds}s")
                return
            except MqksError:
                return

    def _run_consumer(self, consumer: _Consumer) -> None:
        """Run this consumer's callbacks one by one, in delivery order."""
        while consumer.active:
            consumer.wakeup.wait()
            consumer.wakeup.clear()
            while consumer.pending and consumer.active:
                item = consumer.pending.popleft()
                if isinstance(item, Message):
                    self._dispatch(consumer, item)
                else:
                    item()

    def _dispatch(self, consumer: _Consumer, message: Message) -> None:
        """Call the callback; an exception is logged and, with manual_ack, rejects the message."""
        try:
            message.data = message.data.decode()
            if consumer.json:
                message.data = ujson.loads(message.data)
            consumer.callback(message)
        except Exception:
            log.exception("mqks consumer %s (queue %s): callback failed on message %s",
                          message.consumer_id, consumer.queue, message.id)
            if consumer.manual_ack and not message._settled:
                try:
                    message.reject()
                except MqksError as e:
                    log.warning("mqks consumer %s: cannot reject message %s: %s", message.consumer_id, message.id, e)

    def _forget_consumer(self, consumer: _Consumer) -> None:
        """Drop a consumer locally: no more callbacks, no replay."""
        consumer.active = False
        consumer.pending.clear()
        consumer.wakeup.set()  # let its greenlet see `active` and end
        self._consumers_by_id.pop(consumer.id, None)
        for consumer_id in consumer.aliases:
            self._consumers_by_any_id.pop(consumer_id, None)

    def _new_rid(self) -> bytes:
        return f"{self._rid_prefix}{next(self._rid_counter):x}".encode()

    def _live_conn(self, deadline: float) -> _Connection:
        """The current connection, waiting for a reconnect until `deadline`."""
        if self._closed:
            raise MqksConnectionError("client closed")
        if self._manager is None:
            raise MqksConnectionError("not connected: call connect() first")
        # a loop: a connection may be up and lost again before this greenlet gets to run
        while not self._connected.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                raise MqksConnectionError(f"not connected to {self.host}:{self.port} in time")
            gevent.wait([self._connected, self._closing], timeout=left, count=1)
            if self._closed:
                raise MqksConnectionError("client closed")
        conn = self._conn
        assert conn is not None  # _connected is set only with a connection
        return conn

    def _wait(self, conn: _Connection, rid: bytes, future: AsyncResult, deadline: float, what: str) -> bytes:
        """The ok data of `future`; MqksError for an error answer, MqksTimeoutError after `deadline`.

        However the wait ends (a caller's own gevent.Timeout included), `rid` no longer waits in `conn`.
        """
        try:
            # wait(), not get(timeout): a caller's gevent.Timeout must stay theirs, not become ours
            future.wait(max(0.0, deadline - time.monotonic()))
        finally:
            if not future.ready():
                conn.futures.pop(rid, None)
        if not future.ready():
            raise MqksTimeoutError(f"no answer to {what} from {self.host}:{self.port} in time")
        return future.get()

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout_seconds if timeout is None else timeout)

    def _call(self, action: bytes, args: bytes, timeout: float | None = None, retry: bool = False) -> bytes:
        """Send `{rid} {action} {args}` and return the ok data; `retry` resends after a reconnect."""
        deadline = self._deadline(timeout)
        while True:
            conn = self._live_conn(deadline)
            rid = self._new_rid()
            future = conn.request(rid, b"".join((rid, b" ", action, b" ", args, b"\n")))
            try:
                return self._wait(conn, rid, future, deadline, action.decode())
            except MqksConnectionError:
                if not retry or self._closed or time.monotonic() >= deadline:
                    raise

    def _send(self, line: bytes, deadline: float) -> None:
        """Queue a line that gets no answer, waiting for a connection until `deadline`."""
        self._live_conn(deadline).write(line)

    def publish(self, event: str, data: Any = "", confirm: bool = False, json: bool = False,
                timeout: float | None = None) -> str:
        """Publish and return the msg id; with confirm, only after the broker's ok.

        Without confirm the line is queued for the next batch (fire and forget). With confirm a publish
        cut off by a lost connection is sent again after the reconnect: at least once, until `timeout`.
        """
        event_bytes = wire.encode_token(event, "event")
        body = wire.encode_data(ujson.dumps(data) if json else data)
        deadline = self._deadline(timeout)
        if not confirm:
            msg_id = self._new_rid()
            self._send(b"".join((msg_id, b" publish ", event_bytes, b" ", body, b"\n")), deadline)
            return msg_id.decode()
        while True:
            conn = self._live_conn(deadline)
            msg_id = self._new_rid()
            future = conn.request(msg_id, b"".join((msg_id, b" publish --confirm ", event_bytes, b" ", body, b"\n")))
            try:
                self._wait(conn, msg_id, future, deadline, "publish")
                return msg_id.decode()
            except MqksConnectionError:
                if self._closed or time.monotonic() >= deadline:
                    raise

    def consume(self, queue: str, events: list[str] | None, callback: MessageCallback, manual_ack: bool = False,
                delete_queue_when_unused: float | bool | None = None, add: bool = False, confirm: bool = True,
                on_disconnect: Callable[[str], Any] | None = None,
                on_reconnect: Callable[[str, str], Any] | None = None, *, json: bool = False,
                prefetch: int = 0, timeout: float | None = None) -> str:
        """Start a consumer and return its id; `callback(message)` runs in the consumer's own greenlet.

        `events` replace the queue's bindings, or are added to them with `add=True`. After a reconnect
        the consumer comes back under a new id and `on_reconnect(old_id, new_id)` runs first;
        `on_disconnect(consumer_id)` runs when the connection is lost. The returned id stays valid
        for `delete_consumer`.
        """
        queue_bytes = wire.encode_token(queue, "queue")
        events = [token.decode() for token in wire.encode_tokens(events, "event")]
        wire.consume_flags(manual_ack, delete_queue_when_unused, prefetch)  # reject bad flags before sending
        deadline = self._deadline(timeout)
        conn = self._live_conn(deadline)
        consumer = _Consumer(self, self._new_rid().decode(), queue_bytes.decode(), events, add, callback, manual_ack,
                             delete_queue_when_unused, prefetch, json, on_disconnect, on_reconnect)
        consumer.greenlet = gevent.spawn(self._run_consumer, consumer)
        self._consumers_by_id[consumer.id] = consumer
        self._consumers_by_any_id[consumer.id] = consumer
        if not confirm:
            conn.write(consumer.consume_line(confirm=False))
            return consumer.id
        rid = consumer.id.encode()
        future = conn.request(rid, consumer.consume_line(confirm=True))
        try:
            self._wait(conn, rid, future, deadline, "consume")
        except MqksConnectionError:
            # still registered: the reconnect replays it and calls on_reconnect(id, new_id)
            return consumer.reported_id
        except MqksTimeoutError:
            self._forget_consumer(consumer)
            # the broker may yet start it: a consumer nobody listens to would swallow messages
            conn.write(b"".join((self._new_rid(), b" delete_consumer ", rid, b"\n")))
            raise
        except MqksError:
            self._forget_consumer(consumer)
            raise
        return consumer.id

    def ack(self, consumer_id: str, *msg_ids: str, all: bool = False, confirm: bool = False,
            timeout: float | None = None) -> None:
        """Ack messages (or all=True) of a consumer; several msg ids go in one line."""
        self._settle(b"ack", consumer_id, msg_ids, all, confirm, timeout)

    def reject(self, consumer_id: str, *msg_ids: str, all: bool = False, confirm: bool = False,
               timeout: float | None = None) -> None:
        """Return messages (or all=True) to the front of their queue with retry + 1."""
        self._settle(b"reject", consumer_id, msg_ids, all, confirm, timeout)

    def _settle(self, action: bytes, consumer_id: str, msg_ids: tuple[str, ...], all: bool, confirm: bool,
                timeout: float | None = None) -> None:
        """Ack or reject; messages delivered on an earlier connection are skipped: the broker requeued them."""
        if not msg_ids and not all:
            raise ValueError(f"{action.decode()} needs msg ids or all=True")
        consumer = self._consumers_by_any_id.get(consumer_id)
        if consumer is not None:
            if not self._connected.is_set():
                return
            if all:
                consumer.unacked.clear()
            else:
                msg_ids = tuple(msg_id for msg_id in msg_ids if consumer.take_unacked(msg_id))
                if not msg_ids:
                    return
            consumer_id = consumer.id
        args = [wire.encode_token(consumer_id, "consumer id")]
        args += [b"--all"] if all else wire.encode_tokens(list(msg_ids), "msg id")
        if confirm:
            self._call(action, b" ".join([b"--confirm", *args]), timeout)
        else:
            rid = self._new_rid()
            self._send(b" ".join([rid, action, *args]) + b"\n", self._deadline(timeout))

    def rebind(self, queue: str, events: list[str] | None = None, remove: list[str] | tuple[str, ...] = (),
               remove_mask: list[str] | tuple[str, ...] = (), add: list[str] | tuple[str, ...] = (),
               confirm: bool = True, timeout: float | None = None) -> None:
        """Replace the queue's events (if `events`), then remove, remove by mask, and add; creates the queue."""
        args = [wire.encode_token(queue, "queue"), *wire.encode_tokens(events, "event")]
        for flag, values, kind in ((b"--remove", remove, "event"), (b"--remove-mask", remove_mask, "mask"),
                                   (b"--add", add, "event")):
            if values:
                args += [flag, *wire.encode_tokens(values, kind)]
        self._request(b"rebind", args, confirm, timeout)

    def delete_consumer(self, consumer_id: str, confirm: bool = True, timeout: float | None = None) -> None:
        """Stop a consumer: no more callbacks, no replay; its un-acked messages go back to the queue."""
        consumer = self._consumers_by_any_id.get(consumer_id)
        if consumer is not None:
            self._forget_consumer(consumer)
            if not self._connected.is_set():
                return  # the broker dropped it with the connection
            consumer_id = consumer.id
        try:
            self._request(b"delete_consumer", [wire.encode_token(consumer_id, "consumer id")], confirm, timeout,
                          retry=False)
        except MqksConnectionError:
            if consumer is None:
                raise

    def delete_queue(self, queue: str, confirm: bool = True, timeout: float | None = None) -> None:
        """Drop the queue with its bindings and messages; this client's consumers of it end too."""
        queue_bytes = wire.encode_token(queue, "queue")
        for consumer in [c for c in self._consumers_by_id.values() if c.queue == queue]:
            # the broker removes them; replaying them would bring the queue back
            self._forget_consumer(consumer)
        self._request(b"delete_queue", [queue_bytes], confirm, timeout)

    def ping(self, data: str = "", timeout: float | None = None) -> str:
        """Round trip to the broker; returns `data`."""
        return self._call(b"ping", wire.encode_data(data), timeout).decode()

    def eval(self, code: str, worker: int | None = None, timeout: float | None = None) -> str:
        """The repr of a Python expression evaluated in the broker (needs mqksd --eval)."""
        prefix = b"" if worker is None else b"--worker=%d " % int(worker)
        return self._call(b"_eval", prefix + wire.encode_data(code, "code"), timeout).decode()

    def _request(self, action: bytes, args: list[bytes], confirm: bool, timeout: float | None,
                 retry: bool = True) -> None:
        """Send an idempotent control request, waiting for its ok when `confirm`."""
        if confirm:
            self._call(action, b" ".join([b"--confirm", *args]), timeout, retry=retry)
        else:
            self._send(b" ".join([self._new_rid(), action, *args]) + b"\n", self._deadline(timeout))

    def consumer_events(self, consumer_id: str) -> list[str]:
        """The client's current view of the events of this consumer's queue (kept by --update)."""
        consumer = self._consumers_by_any_id.get(consumer_id)
        if consumer is None:
            raise KeyError(consumer_id)
        return list(consumer.events)


def _notice(callback: Callable[..., Any], *args: Any) -> Callable[[], None]:
    """A queued call to a user hook that logs instead of raising."""
    def run() -> None:
        try:
            callback(*args)
        except Exception:
            log.exception("mqks: %r%r failed", callback, args)
    return run

"""The public MQKS client API: publish, consume, ack, reject, rebind, deletes, ping, stats, queues, eval.

Step in the flow: a call checks and encodes its arguments (`wire`), then goes out over the `Link`
(connection.py); consumers and their callbacks live in `Consumers` (consumers.py).
Invariants: a call waits at most its timeout, a reconnect included, and then raises an MqksError;
a confirmed call returns only after the broker's ok.
"""

from __future__ import annotations

import json as jsonlib
import logging
import ssl
import time
from collections.abc import Callable
from typing import Any

import ujson

from . import wire
from .connection import Connection, Link
from .consumers import Consumer, Consumers, Message, MessageCallback
from .errors import MqksConnectionError, MqksError, MqksProtocolError, MqksTimeoutError
from .tls import tls_setting, token_setting

__all__ = ["Client", "Message", "MqksConnectionError", "MqksError", "MqksProtocolError", "MqksTimeoutError"]

log = logging.getLogger("mqks.client")


class Client:
    """A gevent MQKS client: publish, consume with callbacks, confirms, keepalive and reconnect.

    Many greenlets may share one client. Blocking calls wait at most `timeout_seconds` (or their own
    `timeout`). A call made while disconnected waits for the reconnect, then raises
    `MqksConnectionError`; nothing is dropped silently.

    `tls=True` speaks TLS to the broker's `--tls-port`, checking its certificate against the system's
    CAs (give an `ssl.SSLContext` for a private CA: `mqks.client.tls.client_context(ca_file)`).
    `token` (else the environment's MQKS_AUTH_TOKEN) is sent with `auth` on every connect. The client
    says `hello --ttl=ttl_seconds` (default 2x ping_seconds; 0: none), so a broker drops a connection
    whose client has vanished; its pings keep a live one within the TTL. When the broker drains
    (`ok --draining`), the client lets its consumers settle what they hold, then reconnects: to the
    next of `fallbacks` ([(host, port), ...], also tried in turn when one cannot be reached), else to
    the same address once it is back.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 25000, *, ping_seconds: float = 15.0,
                 ping_timeout_seconds: float | None = None, reconnect_min_seconds: float = 0.05,
                 reconnect_max_seconds: float = 5.0, timeout_seconds: float = 10.0,
                 connect_timeout_seconds: float = 10.0, tls: bool | ssl.SSLContext = False, token: str | None = None,
                 ttl_seconds: float | None = None, fallbacks: list[tuple[str, int]] | tuple[()] = ()) -> None:
        if ttl_seconds and ping_seconds > ttl_seconds:
            # the broker drops a connection silent for 2x its TTL: an idle client must ping well within it
            raise ValueError(f"ping_seconds ({ping_seconds:g}) must not exceed ttl_seconds ({ttl_seconds:g})")
        self.host = host
        self.port = port
        self.timeout_seconds = timeout_seconds
        self._new_rid = wire.rid_maker()
        self._consumers = Consumers(f"{host}:{port}", self._new_rid)
        self._link = Link(
            host, port, self._consumers, self._new_rid, ping_seconds=ping_seconds,
            ping_timeout_seconds=ping_seconds if ping_timeout_seconds is None else ping_timeout_seconds,
            reconnect_min_seconds=reconnect_min_seconds, reconnect_max_seconds=reconnect_max_seconds,
            timeout_seconds=timeout_seconds, connect_timeout_seconds=connect_timeout_seconds,
            tls=tls_setting(tls), token=token_setting(token),
            ttl_seconds=2 * ping_seconds if ttl_seconds is None else ttl_seconds, fallbacks=fallbacks)
        # internals the tests inspect (and drop connections through); not API
        self._consumers_by_id = self._consumers.by_id
        self._consumers_by_any_id = self._consumers.by_any_id
        self._lose = self._link.lose

    @property
    def _conn(self) -> Connection | None:
        return self._link.conn

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

    def wait_connected(self, timeout: float | None = None) -> bool:
        """Block until connected (or `timeout` passes); returns whether connected."""
        return self._link.wait_connected(timeout)

    def connect(self, timeout: float | None = None, *, retry: bool = True) -> Client:
        """Connect (retrying with backoff), or raise MqksConnectionError after `connect_timeout_seconds`.

        `retry=False` raises at the first failed attempt instead (a refused connection, a peer that is
        not MQKS: MqksProtocolError), for tools that report at once. The error says why either way.
        """
        timeout = self._link.connect_timeout_seconds if timeout is None else timeout
        if not self._link.start(timeout, retry):
            cause = self._link.last_error
            self.close()
            where = f"{self.host}:{self.port}"
            if isinstance(cause, MqksProtocolError):
                raise MqksProtocolError(cause.reason) from cause
            if cause is None:
                raise MqksConnectionError(f"cannot connect to {where} within {timeout:g}s")
            within = f" within {timeout:g}s" if retry else ""
            raise MqksConnectionError(f"cannot connect to {where}{within}: {_why(cause)}") from cause
        return self

    def close(self, timeout: float | None = None) -> None:
        """Make sure the broker has read every line sent so far (ping barrier), then disconnect."""
        if self._link.closed:
            return
        if self._link.connected:
            try:
                self._link.call(b"ping", b"close", self._deadline(timeout))
            except MqksError as e:
                log.warning("mqks %s:%s: close could not flush: %s", self.host, self.port, e)
        self._link.close(self._consumers.stop())

    def __enter__(self) -> Client:
        return self.connect()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout_seconds if timeout is None else timeout)

    def _request(self, action: bytes, args: list[bytes], confirm: bool, timeout: float | None, retry: bool) -> bytes:
        """Send `{rid} {action} [--confirm] {args...}` and return its rid: at once, or with `confirm` after the ok.

        `retry` sends a confirmed request cut off by a lost connection again after the reconnect.
        """
        deadline = self._deadline(timeout)
        if confirm:
            rid, _ = self._link.call(action, b" ".join([b"--confirm", *args]), deadline, retry)
            return rid
        rid = self._new_rid()
        self._link.send(b" ".join([rid, action, *args]) + b"\n", deadline)
        return rid

    def publish(self, event: str, data: Any = "", confirm: bool = False, json: bool = False,
                timeout: float | None = None) -> str:
        """Publish and return the msg id; with confirm, only after the broker's ok.

        Without confirm the line is queued for the next batch (fire and forget). With confirm a publish
        cut off by a lost connection is sent again after the reconnect: at least once, until `timeout`.
        """
        event_bytes = wire.encode_token(event, "event")
        body = wire.encode_data(ujson.dumps(data) if json else data)
        return self._request(b"publish", [event_bytes, body], confirm, timeout, retry=True).decode()

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
        conn = self._link.live(deadline)
        consumer = Consumer(self._settle, self._new_rid().decode(), queue_bytes.decode(), events, add, callback,
                            manual_ack, delete_queue_when_unused, prefetch, json, on_disconnect, on_reconnect)
        self._consumers.start(consumer)
        if not confirm:
            conn.write(consumer.consume_line(confirm=False))
            return consumer.id
        rid = consumer.id.encode()
        future = conn.request(rid, consumer.consume_line(confirm=True))
        try:
            conn.wait(rid, future, deadline, "consume")
        except MqksConnectionError:
            # still registered: the reconnect replays it and calls on_reconnect(id, new_id)
            return consumer.reported_id
        except MqksTimeoutError:
            self._consumers.forget(consumer)
            # the broker may yet start it: a consumer nobody listens to would swallow messages
            conn.write(b"".join((self._new_rid(), b" delete_consumer ", rid, b"\n")))
            raise
        except MqksError:
            self._consumers.forget(consumer)
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
        consumer = self._consumers.find(consumer_id)
        if consumer is not None:
            if not self._link.connected:
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
        self._request(action, args, confirm, timeout, retry=False)

    def rebind(self, queue: str, events: list[str] | None = None, remove: list[str] | tuple[str, ...] = (),
               remove_mask: list[str] | tuple[str, ...] = (), add: list[str] | tuple[str, ...] = (),
               confirm: bool = True, timeout: float | None = None) -> None:
        """Replace the queue's events (if `events`), then remove, remove by mask, and add; creates the queue."""
        args = [wire.encode_token(queue, "queue"), *wire.encode_tokens(events, "event")]
        for flag, values, kind in ((b"--remove", remove, "event"), (b"--remove-mask", remove_mask, "mask"),
                                   (b"--add", add, "event")):
            if values:
                args += [flag, *wire.encode_tokens(values, kind)]
        self._request(b"rebind", args, confirm, timeout, retry=True)

    def delete_consumer(self, consumer_id: str, confirm: bool = True, timeout: float | None = None) -> None:
        """Stop a consumer: no more callbacks, no replay; its un-acked messages go back to the queue."""
        consumer = self._consumers.find(consumer_id)
        if consumer is not None:
            self._consumers.forget(consumer)
            if not self._link.connected:
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
        self._consumers.forget_queue(queue)
        self._request(b"delete_queue", [queue_bytes], confirm, timeout, retry=True)

    def ping(self, data: str = "", timeout: float | None = None) -> str:
        """Round trip to the broker; returns `data`."""
        _, pong = self._link.call(b"ping", wire.encode_data(data), self._deadline(timeout))
        return pong.decode()

    def stats(self, worker: int | None = None, timeout: float | None = None) -> dict[str, Any]:
        """The broker's figures (the `stats` action): the whole broker's, or worker `worker`'s.

        Keys include published, queued, consumed, acked, rejected, queues, consumers, messages_waiting,
        messages_unacked, clients, events, top_queues, workers, version, uptime_seconds, connections,
        bytes_in, bytes_out, errors, and `log` when the broker has a data dir.
        """
        args = b"" if worker is None else b"--worker=%d" % _worker_number(worker)
        _, answer = self._link.call(b"stats", args, self._deadline(timeout), retry=True)
        return _json_object(answer, "stats")

    def queues(self, mask: str | None = None, timeout: float | None = None) -> list[dict[str, Any]]:
        """Every queue (or those whose name `mask` matches), one dict each (the `queues` action).

        Keys: queue, depth, unacked, consumers, bindings, flags.
        """
        args = b"" if mask is None else wire.encode_token(mask, "mask")
        lines: list[bytes] = []
        self._link.call(b"queues", args, self._deadline(timeout), retry=True, lines=lines)
        return [_json_object(line, "queues") for line in lines]

    def eval(self, code: str, worker: int | None = None, timeout: float | None = None) -> str:
        """The repr of a Python expression evaluated in the broker (needs mqksd --eval)."""
        prefix = b"" if worker is None else b"--worker=%d " % int(worker)
        _, result = self._link.call(b"_eval", prefix + wire.encode_data(code, "code"), self._deadline(timeout))
        return result.decode()

    def consumer_events(self, consumer_id: str) -> list[str]:
        """The client's current view of the events of this consumer's queue (kept by --update)."""
        consumer = self._consumers.find(consumer_id)
        if consumer is None:
            raise KeyError(consumer_id)
        return list(consumer.events)


def _worker_number(worker: int) -> int:
    """`worker` as a worker number, or ValueError."""
    if isinstance(worker, bool) or not isinstance(worker, int) or worker < 0:
        raise ValueError(f"worker must be an int >= 0, not {worker!r}")
    return worker


def _json_object(answer: bytes, action: str) -> dict[str, Any]:
    """The JSON object of one answer line, or MqksError naming what came instead."""
    try:
        value = jsonlib.loads(answer)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise MqksError(f"unexpected answer to {action}: {answer[:200]!r}")
    return value


def _why(error: BaseException) -> str:
    """The reason of a failed connect, as a person reads it: `Connection refused`, not `[Errno 111] ...`."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error) or type(error).__name__

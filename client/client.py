"""The public MQKS client API: publish, consume, ack, reject, rebind, deletes, ping, stats, queues, eval.

Step in the flow: a call checks and encodes its arguments (`wire`), then goes out over the `Link`
(connection.py); consumers and their callbacks live in `Consumers` (consumers.py).
Invariants: a call waits at most its timeout, a reconnect included, and then raises an MqksError;
a confirmed call returns only after the broker's ok.
With a broker of several workers (its `hello` lists a slot map and direct addresses), a consume goes
on a link to its queue's owner, opened on first need, and that consumer's acks, rejects and touches
follow it there; everything else stays on the one public link. Every link's hello re-reads the map:
when it changed (a restart with another --workers), each consumer is re-created on its new owner.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import gevent

from . import wire
from .connection import Connection, Link
from .consumers import Consumer, Consumers, Message, MessageCallback, notice
from .errors import (
    TRANSIENT_RETRY_SECONDS,
    MqksConnectionError,
    MqksError,
    MqksProtocolError,
    MqksTimeoutError,
    not_done_try_again,
)
from .linking import ClientBase, ClientSettings, Retries, connect_error
from .placement import Homes

__all__ = ["Client", "ClientSettings", "Message", "MqksConnectionError", "MqksError", "MqksProtocolError",
           "MqksTimeoutError"]

log = logging.getLogger("mqks.client")

REQUEST_TIMEOUT_SECONDS = 30.0  # the broker's own default for `request`
PLACING_POLL_SECONDS = 0.005  # how often a held publish looks again whether every consumer is back


class Client(ClientBase):
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
    the same address once it is back. A consume refused while its queue's owner fails over (a cluster's
    takeover, a worker's restart) is sent again with a back-off for up to `failover_seconds`.

    `on_refused(error)` is called with the `MqksError` of each error the broker answers to a request nobody
    waits for (one sent without confirm: a `mandatory` publish with no queue bound, a publish a scoped token
    may not make), in a greenlet of its own, started before `close()` returns: a hook that does not yield (a
    list's append) has seen every error to the lines sent before. Without it, such an error is a WARNING in
    the `mqks.client` log.

    The options may come as one `settings=ClientSettings(...)` instead (frozen; one may serve many clients);
    `client.settings` is what this client was made with either way.
    """

    _link: Link
    _link_class = Link
    _session_class = Consumers

    def _set_up(self) -> None:
        by_any_id: dict[str, Consumer] = {}
        self._consumers = Consumers(f"{self.host}:{self.port}", self._new_rid, by_any_id, on_connect=self._on_connect,
                                    on_refused=self._refused if self.on_refused is not None else None)
        self._link = Link(self.host, self.port, self._consumers, self._new_rid, fallbacks=self.settings.fallbacks,
                          **self._link_options)
        self._consumers.link = self._link
        # the links consumers live on: the public one, one per owning worker under the last hello's slot map
        self._homes = Homes(self._consumers, lambda: (self._link.host, self._link.tls is not None))
        self._direct = self._homes.direct  # tests inspect it
        self._homeless: list[Consumer] = []  # consumers taken off a link, waiting for _rehome to place them
        self._rehoming: gevent.Greenlet | None = None
        self._rehome_again = False
        self._adopting = 0  # moved consumers whose consume is on its way to their new link
        # internals the tests inspect (and drop connections through); not API
        self._consumers_by_id = self._consumers.by_id
        self._consumers_by_any_id = by_any_id
        self._lose = self._link.lose

    @property
    def _conn(self) -> Connection | None:
        return self._link.conn

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
            raise connect_error(cause, f"{self.host}:{self.port}", timeout, retry) from cause
        return self

    def close(self, timeout: float | None = None, *, flush: bool = True) -> None:
        """Make sure the broker has read every line sent so far (ping barrier), then disconnect.

        `flush=False` disconnects at once, for a tool the user interrupted: a broker that stopped
        answering must not hold it for `timeout`.
        """
        if self._link.closed:
            return
        deadline = self._deadline(timeout)
        sessions = self._sessions()
        for session in sessions if flush else ():
            link = session.link
            if link is not None and link.connected:
                try:
                    link.call(b"ping", b"close", deadline)
                except MqksError as e:
                    log.warning("mqks %s:%s: close could not flush: %s", link.host, link.port, e)
        if self._rehoming is not None:
            self._rehoming.kill()
        greenlets = [greenlet for session in sessions for greenlet in session.stop()]
        for consumer in self._homeless:
            consumer.active = False
            if consumer.greenlet is not None and consumer.greenlet is not gevent.getcurrent():
                greenlets.append(consumer.greenlet)
        self._homeless = []
        while self._direct:  # closing a link yields: a consume moving meanwhile may open another (CI saw it)
            _, (_, session) = self._direct.popitem()
            if session.link is not None:
                session.link.close([])
        self._link.close(greenlets)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the broker has read every line sent so far, on every link (ping barriers): its answers to them,
        `on_refused`'s errors included, are in. Raises MqksError when a link cannot say so by the deadline: a tool
        must not report success for lines the broker may never have read."""
        deadline = self._deadline(timeout)
        for session in self._sessions():
            if session.link is not None:
                session.link.call(b"ping", b"flush", deadline)

    def __enter__(self) -> Client:
        return self.connect()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout_seconds if timeout is None else timeout)

    def _ask_everyone(self, action: bytes, args: bytes, timeout: float | None,
                      lines: list[bytes] | None = None) -> bytes:
        """A read-only request the broker asks every worker (stats, queues, schedules): asked again, with a back-off,
        while one of them is failing over (`... (failing over): ask again in a moment`), until the timeout."""
        retries = Retries(self._deadline(timeout))
        while True:
            try:
                return self._link.call(action, args, retries.deadline, retry=True, lines=lines)[1]
            except MqksError as e:
                pause = retries.pause_after(e)
            gevent.sleep(pause)

    def _request(self, action: bytes, args: list[bytes], confirm: bool, timeout: float | None, retry: bool,
                 link: Link | None = None) -> bytes:
        """Send `{rid} {action} [--confirm] {args...}` and return its rid: at once, or with `confirm` after the ok.

        `retry` sends a confirmed request cut off by a lost connection again after the reconnect.
        `link` is a consumer's, for what must reach the worker its consume went to; else the public one.
        """
        link = link or self._link
        deadline = self._deadline(timeout)
        if confirm:
            rid, _ = link.call(action, b" ".join([b"--confirm", *args]), deadline, retry)
            return rid
        rid = self._new_rid()
        link.send(b" ".join([rid, action, *args]) + b"\n", deadline)
        return rid

    def publish(self, event: str, data: Any = "", confirm: bool = False, json: bool = False,
                timeout: float | None = None, *, delay: float | None = None,
                at: float | datetime | None = None, mandatory: bool = False) -> str:
        """Publish and return the msg id; with confirm, only after the broker's ok.

        Without confirm the line is queued for the next batch (fire and forget). With confirm a publish
        cut off by a lost connection is sent again after the reconnect: at least once, until `timeout`; so is
        one refused with "try again" while an owner fails over (nothing was published then).
        `delay` (seconds) or `at` (unix seconds or a datetime) hold the copies back until then (extension).
        `mandatory` (extension) makes a publish to an event no queue is bound to an error (with confirm, raised).
        """
        plain = not (confirm or json or mandatory or delay is not None or at is not None)
        rid = self._new_rid()
        line = wire.publish_line(rid, event, data) if plain else b""  # bad arguments fail before any wait
        args = [] if plain else wire.publish_args(event, data, json, delay, at, mandatory)
        if not self._consumers_placed():
            self._wait_until_consumers_placed(self._deadline(timeout))
        if plain:
            self._link.send(line, self._deadline(timeout))
            return rid.decode()
        if not confirm:
            return self._request(b"publish", args, confirm, timeout, retry=True).decode()
        return self._request_until_done(b"publish", args, timeout).decode()

    def _request_until_done(self, action: bytes, args: list[bytes], timeout: float | None) -> bytes:
        """A confirmed request, sent again with a back-off while it is refused with "try again" (nothing was done: an
        owner fails over, or binds nothing new for a moment), within `timeout`."""
        retries = Retries(self._deadline(timeout))
        while True:
            try:
                return self._request(action, args, True, retries.deadline - time.monotonic(), retry=True)
            except MqksError as e:
                pause = retries.pause_after(e, not_done_try_again)
            gevent.sleep(pause)

    def _wait_until_consumers_placed(self, deadline: float) -> None:
        """Hold a publish until every consumer is replayed on its worker's link, or until `deadline`.

        The public link can reconnect and publish before a direct link has replayed its consumers; to a
        restarted in-memory broker such a publish reaches queues that are not bound yet, and is lost.
        Past the deadline the publish goes anyway (a worker that stays away must not stop publishing).
        """
        while not self._consumers_placed() and time.monotonic() < deadline and not self._link.closed:
            gevent.sleep(PLACING_POLL_SECONDS)

    def consume(self, queue: str, events: list[str] | None, callback: MessageCallback, manual_ack: bool = False,
                delete_queue_when_unused: float | bool | None = None, add: bool = False, confirm: bool = True,
                on_disconnect: Callable[[str], Any] | None = None,
                on_reconnect: Callable[[str, str], Any] | None = None, *, json: bool = False,
                prefetch: int = 0, timeout: float | None = None, ack_timeout: float | None = None,
                max_retries: int | str | None = None, max_length: int | str | None = None) -> str:
        """Start a consumer and return its id once the broker has it (a confirmed publish after this returns reaches
        the queue, even when the connection was lost before the answer: the reconnect's replay is waited for);
        `callback(message)` runs in the consumer's own greenlet.

        `events` replace the queue's bindings, or are added to them with `add=True`. After a reconnect
        the consumer comes back under a new id and `on_reconnect(old_id, new_id)` runs first;
        `on_disconnect(consumer_id)` runs when the connection is lost. The returned id stays valid
        for `delete_consumer`. Extensions: `ack_timeout` (seconds, manual_ack only) requeues a message
        left un-acked that long; `max_retries` and `max_length` are the queue's settings (an int, or
        "none" to clear one; None leaves it as it is).
        """
        queue_bytes = wire.encode_token(queue, "queue")
        events = [token.decode() for token in wire.encode_tokens(events, "event")]
        # reject bad flags before sending
        wire.consume_flags(manual_ack, delete_queue_when_unused, prefetch, ack_timeout=ack_timeout,
                           max_retries=max_retries, max_length=max_length)
        def make(rid: str) -> Consumer:
            return Consumer(self._settle, rid, queue_bytes.decode(), events, add, callback, manual_ack,
                            delete_queue_when_unused, prefetch, json, on_disconnect, on_reconnect, answer=self._reply,
                            ack_timeout=ack_timeout, max_retries=max_retries, max_length=max_length)

        # refused while its queue's owner fails over (a cluster's takeover, a worker's restart): tried again
        # with a back-off for failover_seconds (a failover outlasts one answer's timeout); `timeout` bounds it all
        give_up = self._deadline(timeout) if timeout is not None else time.monotonic() + self.failover_seconds
        retries = Retries(give_up)
        while True:
            try:
                return self._consume_once(queue_bytes, make, confirm, min(self._deadline(timeout), give_up))
            except MqksError as e:
                pause = retries.pause_after(e)
                log.info("mqks: consume of %s refused for now (%s): again in %g s", queue, e.reason, pause)
            gevent.sleep(pause)

    def _consume_once(self, queue: bytes, make: Callable[[str], Consumer], confirm: bool, deadline: float) -> str:
        session, conn = self._consumer_link(queue, deadline)
        consumer = make(self._new_rid().decode())
        session.start(consumer)
        consumer.conn = conn
        if not confirm:
            conn.write(consumer.consume_line(confirm=False))
            return consumer.id
        rid = consumer.id.encode()
        future = conn.request(rid, consumer.consume_line(confirm=True))
        try:
            conn.wait(rid, future, deadline, "consume")
        except MqksConnectionError:
            # the line may never have reached the broker, and a caller that publishes next must find the queue
            # bound: the consumer is still registered, so return once the reconnect's replay of it is answered
            return self._wait_replayed(consumer, deadline)
        except MqksTimeoutError:
            session.forget(consumer)
            # the broker may yet start it: a consumer nobody listens to would swallow messages
            conn.write(b"".join((self._new_rid(), b" delete_consumer ", rid, b"\n")))
            raise
        except MqksError:
            session.forget(consumer)
            raise
        return consumer.id

    def _wait_replayed(self, consumer: Consumer, deadline: float) -> str:
        """`consumer`'s first id once the broker answered its replay; its refusal, or a timeout (then it is dropped)."""
        if not consumer.replayed.wait(max(0.0, deadline - time.monotonic())):
            self._drop(consumer)
            raise MqksTimeoutError(f"consume of {consumer.queue}: no connection took it within the timeout")
        if consumer.refusal is not None:
            raise consumer.refusal
        if not consumer.active:
            raise MqksConnectionError(f"consume of {consumer.queue}: the client closed before the broker had it")
        return consumer.first_id

    def _drop(self, consumer: Consumer) -> None:
        """Forget `consumer` here and, if its replay may have reached the broker, delete it there."""
        conn = consumer.conn
        if consumer.home is not None:
            consumer.home.forget(consumer)
        if conn is not None and not conn.lost.is_set():
            conn.write(b"".join((self._new_rid(), b" delete_consumer ", consumer.id.encode(), b"\n")))

    def _consumer_link(self, queue: bytes, deadline: float) -> tuple[Consumers, Connection]:
        """The session and live connection for a consume of `queue`: its owner's direct link, else the public one."""
        while True:
            self._link.live(deadline)  # its hello tells the slot map
            session = self._session_for(self._homes.route(queue))
            assert session.link is not None
            try:
                conn = session.link.live(deadline)
            except MqksConnectionError:
                if self._link.closed or not session.link.closed:
                    raise
                continue  # a new map retired that link while this waited (not the client closing): route again
            # waiting may have let a new slot map retire that link: then route again
            if self._session_for(self._homes.route(queue)) is session:
                return session, conn

    def _sessions(self) -> list[Consumers]:
        return self._homes.sessions()

    def _refused(self, error: MqksError) -> None:
        """Run on_refused in a greenlet of its own: the reader runs no user code. Its start is queued on the hub
        before the wake-up of any later answer's waiter, so it starts before a ping barrier (close's) returns."""
        assert self.on_refused is not None
        gevent.spawn(notice(self.on_refused, error))

    def _close_later(self, link: Link) -> None:
        gevent.spawn(link.close, [])

    def _rehome_running(self) -> bool:
        return self._rehoming is not None and not self._rehoming.dead

    def _start_rehome(self) -> None:
        self._rehoming = gevent.spawn(self._rehome_loop)

    def _move(self, session: Consumers, consumer: Consumer) -> None:
        self._adopting += 1
        gevent.spawn(self._send_adopted, session, consumer)

    def _moving(self) -> bool:
        return self._adopting > 0

    def _rehome_loop(self) -> None:
        self._rehome_again = True
        while self._rehome_again and not self._link.closed:
            self._rehome_again = False
            self._rehome()

    def _send_adopted(self, session: Consumers, consumer: Consumer) -> None:
        """Send a moved consumer's consume once its new link is up, unless that link's handshake replayed it."""
        try:
            self._send_adopted_once_linked(session, consumer)
        finally:
            self._adopting -= 1

    def _send_adopted_once_linked(self, session: Consumers, consumer: Consumer) -> None:
        link = session.link
        assert link is not None
        while not link.closed and consumer.active and session.by_id.get(consumer.id) is consumer:
            if not link.wait_connected(1.0):
                continue
            conn = link.conn
            if conn is None or consumer.conn is conn:
                return
            consumer.conn = conn
            rid = consumer.id.encode()
            future = conn.request(rid, consumer.consume_line(confirm=True))
            try:
                conn.wait(rid, future, time.monotonic() + link.timeout_seconds, "consume")
            except MqksConnectionError:
                pass  # that link's reconnect replays it
            except MqksError as e:
                if self._refused_on_new_link(session, consumer, e):
                    gevent.sleep(TRANSIENT_RETRY_SECONDS)
                    continue
            return

    def ack(self, consumer_id: str, *msg_ids: str, all: bool = False, confirm: bool = False,
            timeout: float | None = None) -> None:
        """Ack messages (or all=True) of a consumer; several msg ids go in one line."""
        self._settle(b"ack", consumer_id, msg_ids, all, confirm, timeout)

    def reject(self, consumer_id: str, *msg_ids: str, all: bool = False, confirm: bool = False,
               timeout: float | None = None, delay: float | None = None) -> None:
        """Return messages (or all=True) to the front of their queue with retry + 1; after `delay` seconds (ext)."""
        self._settle(b"reject", consumer_id, msg_ids, all, confirm, timeout, wire.reject_flags(delay))

    def touch(self, consumer_id: str, *msg_ids: str, all: bool = False, confirm: bool = False,
              timeout: float | None = None) -> None:
        """Restart the ack-timeout clock of messages (or all=True) in flight to a consumer (extension)."""
        self._settle(b"touch", consumer_id, msg_ids, all, confirm, timeout)

    def _settle(self, action: bytes, consumer_id: str, msg_ids: tuple[str, ...], all: bool, confirm: bool,
                timeout: float | None = None, flags: tuple[bytes, ...] = ()) -> None:
        """Ack, reject or touch; messages delivered on an earlier connection are skipped: the broker requeued them."""
        plan = self._consumers.settle_plan(action, consumer_id, msg_ids, all, flags)
        if plan is None:
            return
        link, args = plan
        self._request(action, args, confirm, timeout, retry=False, link=link)

    def rebind(self, queue: str, events: list[str] | None = None, remove: list[str] | tuple[str, ...] = (),
               remove_mask: list[str] | tuple[str, ...] = (), add: list[str] | tuple[str, ...] = (),
               confirm: bool = True, timeout: float | None = None, *, max_retries: int | str | None = None,
               max_length: int | str | None = None) -> None:
        """Replace the queue's events (if `events`), then remove, remove by mask, and add; creates the queue.

        `max_retries` and `max_length` (extension) set the queue's settings as in `consume`. With confirm, a rebind
        refused with "try again" (nothing was changed) is sent again, with a back-off, until `timeout`.
        """
        args = wire.rebind_args(queue, events, remove, remove_mask, add, max_retries, max_length)
        if confirm:
            self._request_until_done(b"rebind", args, timeout)
        else:
            self._request(b"rebind", args, False, timeout, retry=True)

    def delete_consumer(self, consumer_id: str, confirm: bool = True, timeout: float | None = None) -> None:
        """Stop a consumer: no more callbacks, no replay; its un-acked messages go back to the queue."""
        consumer = self._consumers.find(consumer_id)
        link = None
        if consumer is not None:
            link = self._let_go(consumer)
            if link is None:
                return  # the broker dropped it with the connection
            consumer_id = consumer.id
        try:
            self._request(b"delete_consumer", [wire.encode_token(consumer_id, "consumer id")], confirm, timeout,
                          retry=False, link=link)
        except MqksConnectionError:
            if consumer is None:
                raise

    def delete_queue(self, queue: str, confirm: bool = True, timeout: float | None = None) -> None:
        """Drop the queue with its bindings and messages; this client's consumers of it end too."""
        queue_bytes = wire.encode_token(queue, "queue")
        self._forget_queue(queue)
        self._request(b"delete_queue", [queue_bytes], confirm, timeout, retry=True)

    def purge_queue(self, queue: str, timeout: float | None = None) -> int:
        """Drop every message waiting in the queue (its consumers keep what they hold); how many went."""
        _, answer = self._link.call(b"purge_queue", wire.encode_token(queue, "queue"), self._deadline(timeout),
                                    retry=True)
        return wire.count_answer(answer, "purge_queue")

    def requeue_dead(self, queue: str, limit: int | None = None, msg_ids: list[str] | None = None,
                     timeout: float | None = None) -> int:
        """Move dead letters waiting in `{queue}.dead` back to `queue`, their retry counters at 0: all of them,
        the oldest `limit`, or those with `msg_ids`. How many moved. Not retried after a lost connection (a
        second run would move others): MqksError then, look at the queues."""
        _, answer = self._link.call(b"requeue_dead", wire.requeue_dead_args(queue, limit, msg_ids),
                                    self._deadline(timeout))
        return wire.count_answer(answer, "requeue_dead")

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
        answer = self._ask_everyone(b"stats", wire.stats_args(worker), timeout)
        return wire.json_object(answer, "stats")

    def queues(self, mask: str | None = None, timeout: float | None = None, *,
               detail: bool = False) -> list[dict[str, Any]]:
        """Every queue (or those whose name `mask` matches), one dict each (the `queues` action).

        Keys: queue, depth, unacked, leased, consumers, bindings, flags; with `detail` (extension) also events
        (the bindings), consumer_list (consumer, manual_ack, prefetch, unacked, ack_timeout) and newest (the 10
        newest messages waiting: msg_id, retry).
        """
        args = wire.queues_args(mask, detail)
        lines: list[bytes] = []
        self._ask_everyone(b"queues", args, timeout, lines)
        return [wire.json_object(line, "queues") for line in lines]

    def eval(self, code: str, worker: int | None = None, timeout: float | None = None) -> str:
        """The repr of a Python expression evaluated in the broker (needs mqksd --eval)."""
        _, result = self._link.call(b"_eval", wire.eval_args(code, worker), self._deadline(timeout))
        return result.decode()

    def request(self, event: str, data: Any = "", timeout: float = REQUEST_TIMEOUT_SECONDS, json: bool = False) -> Any:
        """Publish `data` as a request and return the first reply (extension; str, or decoded with `json`).

        Raises MqksTimeoutError when no worker replies within `timeout` seconds, MqksError when no queue
        is bound to `event`, and MqksConnectionError when the connection drops first: the broker forgets
        the requests of a client that went away, so a request is never sent twice.
        """
        args = wire.request_args(event, data, timeout, json)
        # the broker answers by `timeout`; the client's own timeout covers the way there and back
        deadline = self._deadline(None) + float(timeout)
        self._wait_until_consumers_placed(deadline)
        try:
            _, answer = self._link.call(b"request", b" ".join(args), deadline)
        except MqksError as e:
            failure = wire.request_failure(e)
            if failure is e:
                raise
            raise failure from None
        return wire.reply_data(answer, json)

    def _reply(self, token: str, data: Any, json: bool = False, confirm: bool = False,
               timeout: float | None = None) -> None:
        """Send `reply {token} {data}`; with `confirm`, MqksError when the broker no longer knows the token."""
        self._request(b"reply", wire.reply_args(token, data, json), confirm, timeout, retry=False)

    def schedule(self, name: str, event: str, data: Any = "", *, every: float | None = None,
                 cron: str | list[str] | None = None, count: int | None = None, nohaste: bool = False,
                 json: bool = False, confirm: bool = True, timeout: float | None = None) -> None:
        """Publish `event` `data` every `every` seconds or on a `cron` rule (extension); replaces one of that name.

        `cron` is five fields, minute hour day-of-month month day-of-week (`"*/5 * * * *"`). Firing n has
        msg id `{name}.{n}`. `count` stops it after that many firings; `nohaste` waits one interval
        before the first (else it fires at once).
        """
        args = wire.schedule_args(name, event, wire.body(data, json), every=every, cron=cron, count=count,
                                  nohaste=nohaste)
        self._request(b"schedule", args, confirm, timeout, retry=True)

    def unschedule(self, name: str, confirm: bool = True, timeout: float | None = None) -> None:
        """Remove the schedule `name` (extension); MqksError when there is none (with `confirm`)."""
        # not retried: a second try after a first that got through would fail with "unknown schedule"
        self._request(b"unschedule", [wire.encode_token(name, "schedule name")], confirm, timeout, retry=False)

    def schedules(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Every schedule, sorted by name, one dict each (extension).

        Keys: name, rule ("every 5", "cron */5 * * * *"), next_due (unix seconds), fired, count
        (None: no limit), event, data.
        """
        lines: list[bytes] = []
        self._ask_everyone(b"schedules", b"", timeout, lines)
        return [wire.json_object(line, "schedules") for line in lines]

    def consumer_events(self, consumer_id: str) -> list[str]:
        """The client's current view of the events of this consumer's queue (kept by --update)."""
        consumer = self._consumers.find(consumer_id)
        if consumer is None:
            raise KeyError(consumer_id)
        return list(consumer.events)

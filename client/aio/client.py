"""The asyncio MQKS client's API: publish, consume, ack, reject, touch, request/reply, rebind, deletes, stats.

Step in the flow: a call encodes its arguments with the same `wire` encoders as the gevent client, then
goes out over a `Link` (connection.py); consumers live in `Consumers` (consumers.py). Invariants: a call
waits at most its timeout, a reconnect included, then raises an MqksError; a confirmed call returns only
after the broker's ok; a cancelled call leaves the client usable. With a broker of several workers or a
cluster (its `hello` lists a slot map and direct addresses), a consume goes on a link to its queue's
owner, and that consumer's acks follow it there; everything else uses the public link. Every link's hello
re-reads the map: a consumer whose owner moved is re-created on its new owner, as after a reconnect.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from mqks.client import wire
from mqks.client.errors import (
    TRANSIENT_RETRY_SECONDS,
    MqksConnectionError,
    MqksError,
    MqksTimeoutError,
    not_done_try_again,
)
from mqks.client.linking import ClientBase, Retries, connect_error
from mqks.client.placement import Homes

from .connection import Connection, Link
from .consumers import DEFAULT_MAX_BUFFERED, Consumer, Consumers, Hook, MessageCallback, call_hook

log = logging.getLogger("mqks.aio")

REQUEST_TIMEOUT_SECONDS = 30.0  # the broker's own default for `request`
PLACING_POLL_SECONDS = 0.005  # how often a held publish looks again whether every consumer is back
CALLBACK_GRACE_SECONDS = 1.0  # close() lets a running callback finish this long, then cancels it


class Client(ClientBase):
    """An asyncio MQKS client: publish, consume as an async iterator or with a callback, confirms, reconnect.

    Any number of tasks may share one client; it belongs to the event loop it was connected on. Calls
    wait at most `timeout_seconds` (or their own `timeout`), a reconnect included, then raise
    `MqksConnectionError` or `MqksTimeoutError`. The options are the gevent client's (`mqks.client.Client`):
    `tls`, `token` (else MQKS_AUTH_TOKEN), `ttl_seconds`, `fallbacks`, pings and back-off, and
    `failover_seconds` (how long a consume refused while its queue's owner fails over keeps trying), and
    `on_refused(error)` (plain or async: run in a task of its own, started before `close()`'s barrier returns).
    The options may come as one `settings=aio.ClientSettings(...)` instead, the gevent client's class.
    """

    _link: Link
    _log = log
    _link_class = Link
    _session_class = Consumers

    def _set_up(self) -> None:
        self._consumers = Consumers(f"{self.host}:{self.port}", self._new_rid, on_connect=self._on_connect,
                                    on_refused=self._refused if self.on_refused is not None else None)
        self._link = Link(self.host, self.port, self._consumers, self._new_rid, fallbacks=self.settings.fallbacks,
                          **self._link_options)
        self._consumers.link = self._link
        self._homes = Homes(self._consumers, lambda: (self._link.host, self._link.tls is not None))
        self._homeless: list[Consumer] = []  # consumers taken off a link, waiting for _rehome to place them
        self._rehoming: asyncio.Task[None] | None = None
        self._rehome_again = False
        self._moving_tasks: set[asyncio.Task[None]] = set()  # moved consumers' consumes on their way to their new link
        self._closing: list[Awaitable[None]] = []  # direct links being retired, on_refused hooks running

    async def wait_connected(self, timeout: float | None = None) -> bool:
        """Wait until connected (or `timeout` passes); returns whether connected."""
        return await self._link.wait_connected(timeout)

    async def connect(self, timeout: float | None = None, *, retry: bool = True) -> Client:
        """Connect (retrying with backoff), or raise MqksConnectionError after `connect_timeout_seconds`.

        `retry=False` raises at the first failed attempt (a refused connection; a peer that is not MQKS:
        MqksProtocolError).
        """
        timeout = self._link.connect_timeout_seconds if timeout is None else timeout
        if not await self._link.start(timeout, retry):
            cause = self._link.last_error
            await self.close()
            raise connect_error(cause, f"{self.host}:{self.port}", timeout, retry) from cause
        return self

    async def close(self, timeout: float | None = None, *, flush: bool = True) -> None:
        """Make sure the broker has read every line sent so far (ping barrier), then disconnect.

        Every consumer's iterator ends and its callback task is awaited; nothing is left pending on the loop.
        `flush=False` disconnects at once.
        """
        if self._link.closed:
            return
        deadline = self._deadline(timeout)
        sessions = self._homes.sessions()
        for session in sessions if flush else ():
            link = session.link
            if link is not None and link.connected:
                try:
                    await link.call(b"ping", b"close", deadline)
                except MqksError as e:
                    log.warning("mqks %s:%s: close could not flush: %s", link.host, link.port, e)
        background = [task for task in (self._rehoming, *self._moving_tasks) if task is not None and not task.done()]
        for task in background:
            task.cancel()
        callbacks: list[asyncio.Task[None]] = []
        for consumer in self._homeless:
            consumer.stop()
            if consumer.task is not None:
                callbacks.append(consumer.task)
        self._homeless = []
        for session in sessions:
            callbacks += session.end_all()
        # a callback's iterator has ended: its task ends with the message in hand, or is cancelled after a grace
        current = asyncio.current_task()
        callbacks = [task for task in callbacks if task is not current and not task.done()]
        if callbacks:
            _, late = await asyncio.wait(callbacks, timeout=CALLBACK_GRACE_SECONDS)
            for task in late:
                task.cancel()
        await asyncio.gather(*background, *callbacks, return_exceptions=True)
        for session in sessions:
            if session.link is not None:
                await session.link.close()
        await asyncio.gather(*self._closing, return_exceptions=True)

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until the broker has read every line sent so far, on every link (ping barriers): its answers to them,
        `on_refused`'s errors included, are in. Raises MqksError when a link cannot say so by the deadline."""
        deadline = self._deadline(timeout)
        for session in self._homes.sessions():
            if session.link is not None:
                await session.link.call(b"ping", b"flush", deadline)

    async def __aenter__(self) -> Client:
        return await self.connect()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _deadline(self, timeout: float | None) -> float:
        return asyncio.get_running_loop().time() + (self.timeout_seconds if timeout is None else timeout)

    async def _ask_everyone(self, action: bytes, args: bytes, timeout: float | None,
                            lines: list[bytes] | None = None) -> bytes:
        """A read-only request the broker asks every worker (stats, queues, schedules): asked again, with a back-off,
        while one of them is failing over (`... (failing over): ask again in a moment`), until the timeout."""
        retries = Retries(self._deadline(timeout))
        while True:
            try:
                return (await self._link.call(action, args, retries.deadline, retry=True, lines=lines))[1]
            except MqksError as e:
                pause = retries.pause_after(e)
            await asyncio.sleep(pause)

    async def _request(self, action: bytes, args: list[bytes], confirm: bool, timeout: float | None, retry: bool,
                       link: Link | None = None) -> bytes:
        """Send `{rid} {action} [--confirm] {args...}` and return its rid: at once, or with `confirm` after the ok."""
        link = link or self._link
        deadline = self._deadline(timeout)
        if confirm:
            rid, _ = await link.call(action, b" ".join([b"--confirm", *args]), deadline, retry)
            return rid
        rid = self._new_rid()
        await link.send(b" ".join([rid, action, *args]) + b"\n", deadline)
        return rid

    async def publish(self, event: str, data: Any = "", confirm: bool = False, json: bool = False,
                      timeout: float | None = None, *, delay: float | None = None,
                      at: float | datetime | None = None, mandatory: bool = False) -> str:
        """Publish and return the msg id; with confirm, only after the broker's ok.

        Without confirm the line joins the batch the loop sends next (it awaits only while the socket is
        full). With confirm, a publish cut off by a lost connection goes again after the reconnect (at least
        once, until `timeout`), and so does one refused with "try again" while an owner fails over; run many at
        once with `asyncio.gather` to pipeline them. `mandatory`, `delay` and `at` are the gevent client's.
        """
        conn = self._link.live_conn
        if conn is not None and not (confirm or json or mandatory or delay is not None or at is not None) \
                and self._placed():
            rid = self._new_rid()  # the hot path: no deadline, no wait
            conn.write(wire.publish_line(rid, event, data))
            if conn.write_paused is not None:
                await conn.writable()
            return rid.decode()
        args = wire.publish_args(event, data, json, delay, at, mandatory)
        if not self._consumers_placed():
            await self._wait_until_consumers_placed(self._deadline(timeout))
        if not confirm:
            return (await self._request(b"publish", args, confirm, timeout, retry=True)).decode()
        return (await self._request_until_done(b"publish", args, timeout)).decode()

    async def _request_until_done(self, action: bytes, args: list[bytes], timeout: float | None) -> bytes:
        """A confirmed request, sent again with a back-off while it is refused with "try again" (nothing was done: an
        owner fails over, or binds nothing new for a moment), within `timeout`."""
        retries = Retries(self._deadline(timeout))
        while True:
            try:
                return await self._request(action, args, True, retries.deadline - time.monotonic(), retry=True)
            except MqksError as e:
                pause = retries.pause_after(e, not_done_try_again)
            await asyncio.sleep(pause)

    def _placed(self) -> bool:
        """`_consumers_placed`, at the cost of a few attribute reads when there is one link (the common case)."""
        if self._homes.direct or self._homeless or self._moving_tasks:
            return self._consumers_placed()
        return self._rehoming is None or self._rehoming.done()

    async def _wait_until_consumers_placed(self, deadline: float) -> None:
        """Hold a publish until every consumer is replayed on its worker's link, or until `deadline`.

        To a restarted in-memory broker a publish sent before a direct link replayed its consumers reaches
        queues that are not bound yet, and is lost. Past the deadline the publish goes anyway.
        """
        loop = asyncio.get_running_loop()
        while not self._consumers_placed() and loop.time() < deadline and not self._link.closed:
            await asyncio.sleep(PLACING_POLL_SECONDS)

    async def consume(self, queue: str, events: list[str] | None, callback: MessageCallback | None = None,
                      manual_ack: bool = False, delete_queue_when_unused: float | bool | None = None,
                      add: bool = False, confirm: bool = True, on_disconnect: Hook | None = None,
                      on_reconnect: Hook | None = None, *, json: bool = False, prefetch: int = 0,
                      timeout: float | None = None, ack_timeout: float | None = None,
                      max_retries: int | str | None = None, max_length: int | str | None = None,
                      max_buffered: int = DEFAULT_MAX_BUFFERED) -> Consumer:
        """Start a consumer: `async for message in consumer`, or `callback(message)` (plain or async) in its task.

        Returns once the broker has it, as the gevent client's consume() does (a lost answer waits for the replay).

        `events` replace the queue's bindings, or are added with `add=True`. `max_buffered` deliveries wait
        in the client at most; past that the connection stops reading until the consumer catches up (with
        `manual_ack`, `prefetch` bounds what the broker sends). After a reconnect the consumer comes back
        under a new broker id; `on_reconnect(old_id, new_id)` runs first, `on_disconnect(id)` at the loss.
        The extensions are the gevent client's: `ack_timeout`, `max_retries`, `max_length`.
        """
        queue_bytes = wire.encode_token(queue, "queue")
        events = [token.decode() for token in wire.encode_tokens(events, "event")]
        wire.consume_flags(manual_ack, delete_queue_when_unused, prefetch, ack_timeout=ack_timeout,
                           max_retries=max_retries, max_length=max_length)
        def make(rid: str) -> Consumer:
            return Consumer(self._settle, self._reply, self._delete, rid, queue_bytes.decode(), events, add,
                            manual_ack, delete_queue_when_unused, prefetch, json, max_buffered=max_buffered,
                            on_disconnect=on_disconnect, on_reconnect=on_reconnect, ack_timeout=ack_timeout,
                            max_retries=max_retries, max_length=max_length)

        # refused while its queue's owner fails over (a cluster's takeover, a worker's restart): tried again
        # with a back-off for failover_seconds (a failover outlasts one answer's timeout); `timeout` bounds it all
        give_up = self._deadline(timeout) if timeout is not None else time.monotonic() + self.failover_seconds
        retries = Retries(give_up)
        while True:
            try:
                return await self._consume_once(queue_bytes, make, callback, confirm,
                                                min(self._deadline(timeout), give_up))
            except MqksError as e:
                pause = retries.pause_after(e)
                log.info("mqks: consume of %s refused for now (%s): again in %g s", queue, e.reason, pause)
            await asyncio.sleep(pause)

    async def _consume_once(self, queue: bytes, make: Callable[[str], Consumer], callback: MessageCallback | None,
                            confirm: bool, deadline: float) -> Consumer:
        session, conn = await self._consumer_link(queue, deadline)
        consumer = make(self._new_rid().decode())
        session.start(consumer)
        consumer.conn = conn
        if callback is not None:
            consumer.task = asyncio.get_running_loop().create_task(consumer.run(callback),
                                                                   name=f"mqks consumer {consumer.id} of "
                                                                        f"{queue.decode()}")
        if not confirm:
            conn.write(consumer.consume_line(confirm=False))
            return consumer
        rid = consumer.id.encode()
        future = conn.request(rid, consumer.consume_line(confirm=True))
        try:
            await conn.wait(rid, future, deadline, "consume")
        except MqksConnectionError:
            # the line may never have reached the broker, and a caller that publishes next must find the queue
            # bound: the consumer is still registered, so return once the reconnect's replay of it is answered
            return await self._wait_replayed(consumer, deadline)
        except BaseException as e:  # refused, timed out, or the caller cancelled us
            session.forget(consumer)
            if not isinstance(e, MqksError) or isinstance(e, MqksTimeoutError):
                # the broker may yet start it: a consumer nobody listens to would swallow messages
                conn.write(b"".join((self._new_rid(), b" delete_consumer ", rid, b"\n")))
            raise
        return consumer

    async def _wait_replayed(self, consumer: Consumer, deadline: float) -> Consumer:
        """`consumer` once the broker answered its replay; its refusal, or a timeout (then it is dropped)."""
        try:
            await asyncio.wait_for(consumer.replayed.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            conn = consumer.conn
            if consumer.home is not None:
                consumer.home.forget(consumer)
            if conn is not None and not conn.lost.is_set():  # the replay may have reached the broker
                conn.write(b"".join((self._new_rid(), b" delete_consumer ", consumer.id.encode(), b"\n")))
            raise MqksTimeoutError(f"consume of {consumer.queue}: no connection took it within the timeout") from None
        if consumer.refusal is not None:
            raise consumer.refusal
        if not consumer.active:
            raise MqksConnectionError(f"consume of {consumer.queue}: the client closed before the broker had it")
        return consumer

    async def _consumer_link(self, queue: bytes, deadline: float) -> tuple[Consumers, Connection]:
        """The session and live connection for a consume of `queue`: its owner's direct link, else the public one."""
        while True:
            await self._link.live(deadline)  # its hello tells the slot map
            session = self._session_for(self._homes.route(queue))
            assert session.link is not None
            try:
                conn = await session.link.live(deadline)
            except MqksConnectionError:
                if self._link.closed or not session.link.closed:
                    raise
                continue  # a new map retired that link while this waited (not the client closing): route again
            if self._session_for(self._homes.route(queue)) is session:  # a new map may have retired that link
                return session, conn

    def _refused(self, error: MqksError) -> None:
        """Run on_refused in a task of its own (the protocol runs no user code), awaited by close(); its first step
        is queued on the loop before the wake-up of any later answer's waiter, as close()'s barrier."""
        assert self.on_refused is not None
        self._track(call_hook(self.on_refused, (error,)))

    def _track(self, awaitable: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(awaitable)
        self._closing.append(task)
        task.add_done_callback(lambda done: self._closing.remove(done) if done in self._closing else None)

    def _close_later(self, link: Link) -> None:
        self._track(link.close())

    def _rehome_running(self) -> bool:
        return self._rehoming is not None and not self._rehoming.done()

    def _start_rehome(self) -> None:
        self._rehoming = asyncio.get_running_loop().create_task(self._rehome_loop(), name="mqks rehome")

    def _move(self, session: Consumers, consumer: Consumer) -> None:
        task = asyncio.get_running_loop().create_task(self._send_adopted(session, consumer))
        self._moving_tasks.add(task)
        task.add_done_callback(self._moving_tasks.discard)

    def _moving(self) -> bool:
        return bool(self._moving_tasks)

    async def _rehome_loop(self) -> None:
        self._rehome_again = True
        while self._rehome_again and not self._link.closed:
            self._rehome_again = False
            self._rehome()
            await asyncio.sleep(0)

    async def _send_adopted(self, session: Consumers, consumer: Consumer) -> None:
        """Send a moved consumer's consume once its new link is up, unless that link's handshake replayed it."""
        link = session.link
        assert link is not None
        while not link.closed and consumer.active and session.by_id.get(consumer.id) is consumer:
            if not await link.wait_connected(1.0):
                continue
            conn = link.conn
            if conn is None or consumer.conn is conn:
                return
            consumer.conn = conn
            rid = consumer.id.encode()
            future = conn.request(rid, consumer.consume_line(confirm=True))
            try:
                await conn.wait(rid, future, asyncio.get_running_loop().time() + link.timeout_seconds, "consume")
            except MqksConnectionError:
                pass  # that link's reconnect replays it
            except MqksError as e:
                if self._refused_on_new_link(session, consumer, e):
                    await asyncio.sleep(TRANSIENT_RETRY_SECONDS)
                    continue
            return

    async def ack(self, consumer_id: str, *msg_ids: str, all: bool = False, confirm: bool = False,
                  timeout: float | None = None) -> None:
        """Ack messages (or all=True) of a consumer; several msg ids go in one line."""
        await self._settle(b"ack", consumer_id, msg_ids, all, confirm, timeout)

    async def reject(self, consumer_id: str, *msg_ids: str, all: bool = False, confirm: bool = False,
                     timeout: float | None = None, delay: float | None = None) -> None:
        """Return messages (or all=True) to the front of their queue with retry + 1; after `delay` seconds (ext)."""
        await self._settle(b"reject", consumer_id, msg_ids, all, confirm, timeout, wire.reject_flags(delay))

    async def touch(self, consumer_id: str, *msg_ids: str, all: bool = False, confirm: bool = False,
                    timeout: float | None = None) -> None:
        """Restart the ack-timeout clock of messages (or all=True) in flight to a consumer (extension)."""
        await self._settle(b"touch", consumer_id, msg_ids, all, confirm, timeout)

    async def _settle(self, action: bytes, consumer_id: str, msg_ids: tuple[str, ...], all: bool, confirm: bool,
                      timeout: float | None = None, flags: tuple[bytes, ...] = ()) -> None:
        """Ack, reject or touch on the consumer's own link; deliveries of an earlier connection are skipped."""
        plan = self._consumers.settle_plan(action, consumer_id, msg_ids, all, flags)
        if plan is None:
            return
        link, args = plan
        if not confirm and link is not None and link.conn is not None:  # the hot path of `await msg.ack()`
            link.conn.write(b" ".join([self._new_rid(), action, *args]) + b"\n")
            return
        await self._request(action, args, confirm, timeout, retry=False, link=link)

    async def rebind(self, queue: str, events: list[str] | None = None, remove: list[str] | tuple[str, ...] = (),
                     remove_mask: list[str] | tuple[str, ...] = (), add: list[str] | tuple[str, ...] = (),
                     confirm: bool = True, timeout: float | None = None, *, max_retries: int | str | None = None,
                     max_length: int | str | None = None) -> None:
        """Replace the queue's events (if `events`), then remove, remove by mask, and add; creates the queue. With
        confirm, one refused with "try again" (nothing was changed) is sent again, with a back-off, until `timeout`."""
        args = wire.rebind_args(queue, events, remove, remove_mask, add, max_retries, max_length)
        if confirm:
            await self._request_until_done(b"rebind", args, timeout)
        else:
            await self._request(b"rebind", args, False, timeout, retry=True)

    async def delete_consumer(self, consumer: Consumer | str, confirm: bool = True,
                              timeout: float | None = None) -> None:
        """Stop a consumer: its iterator ends, no replay; its un-acked messages go back to the queue."""
        found = self._consumers.find(consumer) if isinstance(consumer, str) else consumer
        consumer_id = consumer if isinstance(consumer, str) else consumer.id
        link = None
        if found is not None:
            link = self._let_go(found)
            if link is None:
                return  # the broker dropped it with the connection
            consumer_id = found.id
        try:
            await self._request(b"delete_consumer", [wire.encode_token(consumer_id, "consumer id")], confirm, timeout,
                                retry=False, link=link)
        except MqksConnectionError:
            if found is None:
                raise

    async def _delete(self, consumer: Consumer) -> None:
        await self.delete_consumer(consumer)

    async def delete_queue(self, queue: str, confirm: bool = True, timeout: float | None = None) -> None:
        """Drop the queue with its bindings and messages; this client's consumers of it end too."""
        queue_bytes = wire.encode_token(queue, "queue")
        self._forget_queue(queue)
        await self._request(b"delete_queue", [queue_bytes], confirm, timeout, retry=True)

    async def purge_queue(self, queue: str, timeout: float | None = None) -> int:
        """Drop every message waiting in the queue (its consumers keep what they hold); how many went."""
        _, answer = await self._link.call(b"purge_queue", wire.encode_token(queue, "queue"), self._deadline(timeout),
                                          retry=True)
        return wire.count_answer(answer, "purge_queue")

    async def requeue_dead(self, queue: str, limit: int | None = None, msg_ids: list[str] | None = None,
                           timeout: float | None = None) -> int:
        """Move dead letters waiting in `{queue}.dead` back to `queue`, their retry counters at 0: all of them,
        the oldest `limit`, or those with `msg_ids`. How many moved. Not retried after a lost connection (a
        second run would move others): MqksError then, look at the queues."""
        _, answer = await self._link.call(b"requeue_dead", wire.requeue_dead_args(queue, limit, msg_ids),
                                          self._deadline(timeout))
        return wire.count_answer(answer, "requeue_dead")

    async def ping(self, data: str = "", timeout: float | None = None) -> str:
        """Round trip to the broker; returns `data`."""
        _, pong = await self._link.call(b"ping", wire.encode_data(data), self._deadline(timeout))
        return pong.decode()

    async def stats(self, worker: int | None = None, timeout: float | None = None) -> dict[str, Any]:
        """The broker's figures (the `stats` action), as the gevent client's `stats`."""
        answer = await self._ask_everyone(b"stats", wire.stats_args(worker), timeout)
        return wire.json_object(answer, "stats")

    async def queues(self, mask: str | None = None, timeout: float | None = None, *,
                     detail: bool = False) -> list[dict[str, Any]]:
        """Every queue (or those whose name `mask` matches), one dict each, as the gevent client's `queues`."""
        args = wire.queues_args(mask, detail)
        lines: list[bytes] = []
        await self._ask_everyone(b"queues", args, timeout, lines)
        return [wire.json_object(line, "queues") for line in lines]

    async def eval(self, code: str, worker: int | None = None, timeout: float | None = None) -> str:
        """The repr of a Python expression evaluated in the broker (needs mqksd --eval)."""
        _, result = await self._link.call(b"_eval", wire.eval_args(code, worker), self._deadline(timeout))
        return result.decode()

    async def request(self, event: str, data: Any = "", timeout: float = REQUEST_TIMEOUT_SECONDS,
                      json: bool = False) -> Any:
        """Publish `data` as a request and return the first reply (extension; str, or decoded with `json`).

        MqksTimeoutError when no worker replies within `timeout` seconds, MqksError when no queue is bound
        to `event`, MqksConnectionError when the connection drops first (a request is never sent twice).
        """
        args = wire.request_args(event, data, timeout, json)
        deadline = self._deadline(None) + float(timeout)
        await self._wait_until_consumers_placed(deadline)
        try:
            _, answer = await self._link.call(b"request", b" ".join(args), deadline)
        except MqksError as e:
            failure = wire.request_failure(e)
            if failure is e:
                raise
            raise failure from None
        return wire.reply_data(answer, json)

    async def _reply(self, token: str, data: Any, json: bool = False, confirm: bool = False,
                     timeout: float | None = None) -> None:
        """Send `reply {token} {data}`; with `confirm`, MqksError when the broker no longer knows the token."""
        await self._request(b"reply", wire.reply_args(token, data, json), confirm, timeout, retry=False)

    async def schedule(self, name: str, event: str, data: Any = "", *, every: float | None = None,
                       cron: str | list[str] | None = None, count: int | None = None, nohaste: bool = False,
                       json: bool = False, confirm: bool = True, timeout: float | None = None) -> None:
        """Publish `event` `data` every `every` seconds or on a `cron` rule (extension); replaces one of that name."""
        args = wire.schedule_args(name, event, wire.body(data, json), every=every, cron=cron, count=count,
                                  nohaste=nohaste)
        await self._request(b"schedule", args, confirm, timeout, retry=True)

    async def unschedule(self, name: str, confirm: bool = True, timeout: float | None = None) -> None:
        """Remove the schedule `name` (extension); MqksError when there is none (with `confirm`)."""
        await self._request(b"unschedule", [wire.encode_token(name, "schedule name")], confirm, timeout, retry=False)

    async def schedules(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Every schedule, sorted by name, one dict each (extension), as the gevent client's `schedules`."""
        lines: list[bytes] = []
        await self._ask_everyone(b"schedules", b"", timeout, lines)
        return [wire.json_object(line, "schedules") for line in lines]


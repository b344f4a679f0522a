"""The asyncio client's consumers: deliveries in, an async iterator (or an async callback) out, replay on reconnect.

Step in the flow: the connection's router (client/answers.py) hands a consumer's delivery or `--update`
to `Consumers` (a `Registry`, client/consuming.py, shared with the gevent client), which appends it to
that consumer's buffer; `async for message in consumer` takes them in delivery order. Invariants: the
protocol never runs user code; a buffer past `max_buffered` pauses reading on its connection until the
iterator catches up (with `prefetch` the broker stops sooner); a manual-ack message delivered on a lost
connection is dropped from the buffer (the broker requeued it); the iterator ends when the consumer is
deleted, its queue deleted, or the client closed.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import ujson

from mqks.client import wire
from mqks.client.consuming import ConsumerState, Delivery, Registry
from mqks.client.errors import MqksConnectionError, MqksError, is_transient

if TYPE_CHECKING:
    from .connection import Connection, Link

log = logging.getLogger("mqks.aio")

DEFAULT_MAX_BUFFERED = 1000  # deliveries a consumer holds locally before its connection stops reading

# (action, consumer_id, msg_ids, all, confirm, timeout, flags): the client's ack/reject/touch, for Message's
Settle: TypeAlias = Callable[[bytes, str, tuple[str, ...], bool, bool, float | None, tuple[bytes, ...]],
                            Awaitable[None]]
# (reply token, data, json, confirm): the client's reply, for Message.reply
Answer: TypeAlias = Callable[[str, Any, bool, bool], Awaitable[None]]
Hook: TypeAlias = Callable[..., Any]  # on_disconnect(id), on_reconnect(old_id, new_id): plain or async


class Message(Delivery):
    """One delivery; `await msg.ack()`, `reject()`, `touch()` matter only for a `manual_ack` consumer."""

    __slots__ = ()
    _consumer: Consumer | None

    async def ack(self, confirm: bool = False) -> None:
        """Ack once; a no-op for an auto-ack consumer or when already settled; `confirm` waits for the broker."""
        await self._settle(b"ack", confirm)

    async def reject(self, confirm: bool = False, delay: float | None = None) -> None:
        """Return the message to the front of its queue with retry + 1; after `delay` seconds (extension)."""
        self._check_manual_ack("reject")
        await self._settle(b"reject", confirm, wire.reject_flags(delay))

    async def touch(self, confirm: bool = False) -> None:
        """Restart the consumer's ack-timeout clock for this message (extension); a no-op once settled."""
        consumer = self._consumer
        if consumer is None or not consumer.manual_ack:
            raise MqksError("touch needs a consumer with manual_ack=True")
        if not self._settled and self.consumer_id == consumer.id:
            await consumer.settle(b"touch", self.consumer_id, (self.id,), False, confirm, None, ())

    async def reply(self, data: Any = "", confirm: bool = False, json: bool | None = None) -> None:
        """Answer the `request` this message came from (extension); the requester gets the first reply only."""
        token = self._reply_to()
        assert self._consumer is not None
        await self._consumer.answer(token, data, self._consumer.json if json is None else json, confirm)

    async def _settle(self, action: bytes, confirm: bool, flags: tuple[bytes, ...] = ()) -> None:
        if self._claim():
            assert self._consumer is not None
            await self._consumer.settle(action, self.consumer_id, (self.id,), False, confirm, None, flags)


MessageCallback: TypeAlias = Callable[[Message], Any]  # plain or async


class Consumer(ConsumerState):
    """A consumer: `async for message in consumer`, or its callback run by its own task.

    `consumer.id` is the broker's id on the current connection (a reconnect renews it); `first_id` stays
    valid for `client.ack` and `delete_consumer` for good. `await consumer.cancel()` deletes it on the broker.
    """

    __slots__ = ("settle", "answer", "delete", "buffer", "waiter", "max_buffered", "on_disconnect", "on_reconnect",
                 "task", "home", "conn")

    def __init__(self, settle: Settle, answer: Answer, delete: Callable[[Consumer], Awaitable[None]],
                 consumer_id: str, queue: str, events: list[str], add: bool, manual_ack: bool,
                 delete_queue_when_unused: float | bool | None, prefetch: int, json: bool, *,
                 max_buffered: int = DEFAULT_MAX_BUFFERED, on_disconnect: Hook | None = None,
                 on_reconnect: Hook | None = None, ack_timeout: float | None = None,
                 max_retries: wire.QueueSetting = None, max_length: wire.QueueSetting = None) -> None:
        super().__init__(consumer_id, queue, events, add, manual_ack, delete_queue_when_unused, prefetch, json,
                         ack_timeout=ack_timeout, max_retries=max_retries, max_length=max_length)
        if max_buffered < 1:
            raise ValueError(f"max_buffered must be >= 1, not {max_buffered!r}")
        self.settle = settle
        self.answer = answer
        self.delete = delete
        self.buffer: deque[Message | Callable[[], Any]] = deque()
        self.waiter: asyncio.Future[None] | None = None  # the iterator waiting for a delivery
        self.max_buffered = max_buffered
        self.on_disconnect = on_disconnect
        self.on_reconnect = on_reconnect
        self.task: asyncio.Task[None] | None = None  # runs the callback, when consume() was given one
        self.home: Consumers | None = None  # the link's session it lives on
        self.conn: Connection | None = None  # the connection its last consume line went on

    def on_delivery(self, data: bytes) -> None:
        """Buffer a delivery for the iterator; a full buffer stops the connection reading."""
        msg_id, event, retry, reply_token, body = self.delivered(data)
        self.buffer.append(Message(msg_id, event, body, retry, self.id, self, reply_token))
        if len(self.buffer) >= self.max_buffered and self.conn is not None:
            self.conn.hold_back(self)
        self._wake()

    def notice(self, hook: Hook, *args: Any) -> None:
        """Queue a call to a user hook in delivery order (on_reconnect before the first delivery under a new id)."""
        self.buffer.append(lambda: _call_hook(hook, args))
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def stop(self) -> None:
        """No more deliveries: drop what is buffered and end the iterator."""
        self.active = False
        self.buffer.clear()
        if self.conn is not None:
            self.conn.release(self)
        self._wake()

    def disconnected(self, notify: bool) -> None:
        """The connection is gone: forget its un-acked deliveries; `notify` queues on_disconnect."""
        self.unacked.clear()
        if self.manual_ack:
            # the broker put these back in the queue: handing them out would double-process
            kept = [item for item in self.buffer if not isinstance(item, Message)]
            self.buffer.clear()
            self.buffer.extend(kept)
        if notify and self.on_disconnect is not None:
            self.notice(self.on_disconnect, self.reported_id)

    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> Message:
        """The next delivery, its data decoded (str, or JSON with `json=True`); ends when the consumer does."""
        while True:
            while not self.buffer:
                if not self.active:
                    raise StopAsyncIteration
                self.waiter = asyncio.get_running_loop().create_future()
                try:
                    await self.waiter
                finally:
                    self.waiter = None
            item = self.buffer.popleft()
            if self.conn is not None and len(self.buffer) <= self.max_buffered // 2:
                self.conn.release(self)
            if not isinstance(item, Message):
                await item()
                continue
            try:
                item.data = item.data.decode()
                if self.json:
                    item.data = ujson.loads(item.data)
            except ValueError:
                log.exception("mqks consumer %s (queue %s): cannot decode message %s", item.consumer_id, self.queue,
                              item.id)
                await self._reject_failed(item)
                continue
            return item

    async def cancel(self, confirm: bool = True) -> None:
        """Delete this consumer on the broker: its iterator ends, its un-acked messages go back to the queue."""
        await self.delete(self)

    async def run(self, callback: MessageCallback) -> None:
        """Call `callback(message)` (awaited when async) for each delivery; a failure is logged and rejects it."""
        async for message in self:
            try:
                result = callback(message)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("mqks consumer %s (queue %s): callback failed on message %s", message.consumer_id,
                              self.queue, message.id)
                await self._reject_failed(message)

    async def _reject_failed(self, message: Message) -> None:
        if self.manual_ack and not message._settled:
            try:
                await message.reject()
            except MqksError as e:
                log.warning("mqks consumer %s: cannot reject message %s: %s", message.consumer_id, message.id, e)


async def _call_hook(hook: Hook, args: tuple[Any, ...]) -> None:
    """Run a user hook (plain or async); it logs instead of raising."""
    try:
        result = hook(*args)
        if inspect.isawaitable(result):
            await result
    except Exception:
        log.exception("mqks: %r%r failed", hook, args)


class Consumers(Registry[Consumer]):
    """Every live consumer of one link, by id; the `Session` its link runs (see connection.py)."""

    __slots__ = ("worker", "link", "on_connect")

    def __init__(self, where: str, new_rid: Callable[[], bytes], by_any_id: dict[str, Consumer] | None = None,
                 worker: int | None = None, on_connect: Callable[[Consumers], None] | None = None) -> None:
        super().__init__(where, new_rid, by_any_id)
        self.worker = worker  # the worker whose direct link this is; None: the public link
        self.link: Link | None = None  # set by the client once the link exists
        self.on_connect = on_connect  # runs first on every new connection, its hello read

    def start(self, consumer: Consumer) -> None:
        """Know `consumer` by its id on this link."""
        consumer.home = self
        self.add(consumer)

    def release(self, consumer: Consumer) -> None:
        """Stop routing this link's lines to `consumer`, which moves to another link (its ids stay known)."""
        self.by_id.pop(consumer.id, None)
        consumer.home = None
        consumer.unacked.clear()  # the broker requeues what it held here once the old consumer goes
        if consumer.conn is not None:
            consumer.conn.release(consumer)

    def adopt(self, consumer: Consumer) -> None:
        """Take over a consumer from another link under a new id; it is sent as a replay (on_reconnect runs)."""
        self.renew(consumer)
        consumer.home = self
        consumer.conn = None

    def replay(self, conn: Connection) -> Callable[[float], Awaitable[None]]:
        """Recreate every live consumer on `conn` under a new id; returns what awaits their confirms."""
        if self.on_connect is not None:
            self.on_connect(self)
        replays: list[tuple[Consumer, bytes, asyncio.Future[bytes]]] = []
        for consumer in list(self.by_id.values()):
            self.renew(consumer)
            consumer.conn = conn
            rid = consumer.id.encode()
            replays.append((consumer, rid, conn.request(rid, consumer.consume_line(confirm=True))))

        async def confirm(deadline: float) -> None:
            for consumer, rid, future in replays:
                try:
                    await conn.wait(rid, future, deadline, "consumer replay")
                except MqksConnectionError:
                    raise
                except MqksError as e:
                    if is_transient(e):  # its queue's owner fails over: connect again (with back-off) and replay
                        raise MqksConnectionError(f"consumer replay on queue {consumer.queue}: {e.reason}") from None
                    log.error("mqks %s: replay of consumer %s on queue %s failed, consumer dropped: %s",
                              self.where, consumer.reported_id, consumer.queue, e)
                    self.forget(consumer)

        return confirm

    def replayed(self, consumer: Consumer) -> None:
        """The broker confirmed this replayed consumer: queue on_reconnect before its first delivery."""
        old_id = consumer.reported_id
        super().replayed(consumer)
        if consumer.on_reconnect is not None:
            consumer.notice(consumer.on_reconnect, old_id, consumer.id)

    def disconnected(self, notify: bool, closed: bool) -> None:
        """The connection is gone; `notify` runs every on_disconnect hook, `closed` says the client ended."""
        for consumer in self.by_id.values():
            confirmed_here = not closed and consumer.reported_id == consumer.id
            consumer.disconnected(notify or confirmed_here)

    def end_all(self) -> list[asyncio.Task[None]]:
        """Stop every consumer for good (their iterators end); returns their callback tasks."""
        tasks = []
        for consumer in list(self.by_id.values()):
            consumer.stop()
            if consumer.task is not None and consumer.task is not asyncio.current_task():
                tasks.append(consumer.task)
        return tasks

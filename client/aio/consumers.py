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
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import ujson

from mqks.client import wire
from mqks.client.consuming import ConsumerState, Delivery, Registry
from mqks.client.errors import MqksConnectionError, MqksError

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

    __slots__ = ("settle", "answer", "delete", "waiter", "max_buffered", "task", "replayed")
    home: Consumers | None  # the link's session it lives on
    conn: Connection | None  # the connection its last consume line went on

    def __init__(self, settle: Settle, answer: Answer, delete: Callable[[Consumer], Awaitable[None]],
                 consumer_id: str, queue: str, events: list[str], add: bool, manual_ack: bool,
                 delete_queue_when_unused: float | bool | None, prefetch: int, json: bool, *,
                 max_buffered: int = DEFAULT_MAX_BUFFERED, on_disconnect: Hook | None = None,
                 on_reconnect: Hook | None = None, ack_timeout: float | None = None,
                 max_retries: wire.QueueSetting = None, max_length: wire.QueueSetting = None) -> None:
        super().__init__(consumer_id, queue, events, add, manual_ack, delete_queue_when_unused, prefetch, json,
                         ack_timeout=ack_timeout, max_retries=max_retries, max_length=max_length,
                         on_disconnect=on_disconnect, on_reconnect=on_reconnect)
        if max_buffered < 1:
            raise ValueError(f"max_buffered must be >= 1, not {max_buffered!r}")
        self.settle = settle
        self.answer = answer
        self.delete = delete
        self.waiter: asyncio.Future[None] | None = None  # the iterator waiting for a delivery
        self.max_buffered = max_buffered
        self.task: asyncio.Task[None] | None = None  # runs the callback, when consume() was given one
        self.replayed = asyncio.Event()  # set by `settled`: what a consume() whose first answer was lost waits on

    @property
    def buffered(self) -> int:
        """How many deliveries (and queued hook calls) wait in the client for the iterator."""
        return len(self.pending)

    def on_delivery(self, data: bytes) -> None:
        """Buffer a delivery for the iterator; a full buffer stops the connection reading."""
        msg_id, event, retry, reply_token, body = self.delivered(data)
        self.pending.append(Message(msg_id, event, body, retry, self.id, self, reply_token))
        if len(self.pending) >= self.max_buffered and self.conn is not None:
            self.conn.hold_back(self)
        self.wake()

    def notice(self, hook: Hook, *args: Any) -> None:
        """Queue a call to a user hook (plain or async) in delivery order."""
        self.pending.append(lambda: call_hook(hook, args))
        self.wake()

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def settled(self) -> None:
        self.replayed.set()

    def stop(self) -> None:
        """No more deliveries: drop what is buffered and end the iterator."""
        if self.conn is not None:
            self.conn.release(self)
        super().stop()

    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> Message:
        """The next delivery, its data decoded (str, or JSON with `json=True`); ends when the consumer does."""
        while True:
            while not self.pending:
                if not self.active:
                    raise StopAsyncIteration
                self.waiter = asyncio.get_running_loop().create_future()
                try:
                    await self.waiter
                finally:
                    self.waiter = None
            item = self.pending.popleft()
            if self.conn is not None and len(self.pending) <= self.max_buffered // 2:
                self.conn.release(self)
            if not isinstance(item, Message):
                if callable(item):
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


async def call_hook(hook: Hook, args: tuple[Any, ...]) -> None:
    """Run a user hook (plain or async); it logs instead of raising."""
    try:
        result = hook(*args)
        if inspect.isawaitable(result):
            await result
    except Exception:
        log.exception("mqks: %r%r failed", hook, args)


class Consumers(Registry[Consumer]):
    """Every live consumer of one link, by id; the `Session` its link runs (see connection.py)."""

    __slots__ = ()
    link: Link | None

    def release(self, consumer: Consumer) -> None:
        """Stop routing this link's lines to `consumer`; its buffer no longer holds this connection back."""
        if consumer.conn is not None:
            consumer.conn.release(consumer)
        super().release(consumer)

    def replay(self, conn: Connection) -> Callable[[float], Awaitable[None]]:
        """Recreate every live consumer on `conn` under a new id; returns what awaits their confirms."""
        if self.on_connect is not None:
            self.on_connect(self)
        replays = self.replay_requests(conn)

        async def confirm(deadline: float) -> None:
            for consumer, rid, future in replays:
                try:
                    await conn.wait(rid, future, deadline, "consumer replay")
                except MqksConnectionError:
                    raise
                except MqksError as e:
                    self.replay_refused(consumer, e)

        return confirm

    def end_all(self) -> list[asyncio.Task[None]]:
        """Stop every consumer for good (their iterators end); returns their callback tasks."""
        tasks = []
        for consumer in list(self.by_id.values()):
            consumer.stop()
            if consumer.task is not None and consumer.task is not asyncio.current_task():
                tasks.append(consumer.task)
        return tasks

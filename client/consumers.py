"""The client's consumers: their lines in, their callbacks out, their replay after a reconnect.

Step in the flow: the link's reader hands a consumer's delivery or `--update` to `Consumers`, which
queues it on that consumer's deque; the consumer's own greenlet runs the callbacks in delivery order.
Invariants: the reader never runs user code; a consumer id lives for one connection only: a new
connection replays every live consumer under a new id, and `on_reconnect` is queued before the
first delivery under it; an ack of a message from an earlier connection sends nothing.
With several broker workers a client runs one `Consumers` per link (the public one, one per owning
worker): a consumer belongs to exactly one of them at a time, and moving it re-creates it under a new
id as a replay does; ids stay known client-wide in one shared `by_any_id`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import gevent
import ujson
from gevent.event import Event

from . import wire
from .consuming import ConsumerState, Delivery, Registry
from .errors import MqksConnectionError, MqksError

if TYPE_CHECKING:
    from .connection import Connection, Link

log = logging.getLogger("mqks.client")

# (action, consumer_id, msg_ids, all, confirm, timeout, flags): the client's ack/reject/touch, for Message's
Settle: TypeAlias = Callable[[bytes, str, tuple[str, ...], bool, bool, float | None, tuple[bytes, ...]], None]
# (reply token, data, json, confirm): the client's reply, for Message.reply
Answer: TypeAlias = Callable[[str, Any, bool, bool], None]


class Message(Delivery):
    """One delivery. `ack`/`reject`/`touch` matter only for a `manual_ack` consumer.

    `reply_token` is set when the message came from a `request` (extension): `reply(data)` answers it.
    """

    __slots__ = ()
    _consumer: Consumer | None

    def ack(self, confirm: bool = False) -> None:
        """Ack once; a no-op for an auto-ack consumer (the broker acked on delivery) or when already settled."""
        self._settle(b"ack", confirm)

    def reject(self, confirm: bool = False, delay: float | None = None) -> None:
        """Return the message to the front of its queue with retry + 1 (manual_ack consumers only).

        `delay` (extension) requeues it after that many seconds instead of at once.
        """
        self._check_manual_ack("reject")
        self._settle(b"reject", confirm, wire.reject_flags(delay))

    def touch(self, confirm: bool = False) -> None:
        """Restart the consumer's ack-timeout clock for this message (extension); a no-op once settled."""
        consumer = self._consumer
        if consumer is None or not consumer.manual_ack:
            raise MqksError("touch needs a consumer with manual_ack=True")
        if not self._settled and self.consumer_id == consumer.id:
            consumer.settle(b"touch", self.consumer_id, (self.id,), False, confirm, None, ())

    def reply(self, data: Any = "", confirm: bool = False, json: bool | None = None) -> None:
        """Answer the `request` this message came from (extension); the requester gets the first reply only.

        `json` (default: the consumer's own `json`) sends `data` JSON-encoded. MqksError when the
        message came from a plain publish; with `confirm`, also when the broker no longer knows the token
        (the request timed out, or its requester disconnected).
        """
        token = self._reply_to()
        assert self._consumer is not None
        self._consumer.answer(token, data, self._consumer.json if json is None else json, confirm)

    def _settle(self, action: bytes, confirm: bool, flags: tuple[bytes, ...] = ()) -> None:
        if self._claim():
            assert self._consumer is not None
            self._consumer.settle(action, self.consumer_id, (self.id,), False, confirm, None, flags)


MessageCallback: TypeAlias = Callable[[Message], Any]


class Consumer(ConsumerState):
    """A consumer of the gevent client: its wire state (consuming.py), callbacks, and the greenlet that runs them."""

    __slots__ = ("settle", "answer", "callback", "wakeup", "greenlet", "replayed")
    home: Consumers | None  # the link's session it lives on
    conn: Connection | None  # the connection its last consume line went on

    def __init__(self, settle: Settle, consumer_id: str, queue: str, events: list[str], add: bool,
                 callback: MessageCallback, manual_ack: bool, delete_queue_when_unused: float | bool | None,
                 prefetch: int, json: bool, on_disconnect: Callable[[str], Any] | None,
                 on_reconnect: Callable[[str, str], Any] | None, *, answer: Answer | None = None,
                 ack_timeout: float | None = None, max_retries: wire.QueueSetting = None,
                 max_length: wire.QueueSetting = None) -> None:
        super().__init__(consumer_id, queue, events, add, manual_ack, delete_queue_when_unused, prefetch, json,
                         ack_timeout=ack_timeout, max_retries=max_retries, max_length=max_length,
                         on_disconnect=on_disconnect, on_reconnect=on_reconnect)
        self.settle = settle
        self.answer = answer or _no_answer
        self.callback = callback
        self.wakeup = Event()
        self.greenlet: gevent.Greenlet | None = None
        self.replayed = Event()  # set by `settled`: what a consume() whose first answer was lost waits on

    def on_delivery(self, data: bytes) -> None:
        """Queue a delivery for this consumer's greenlet; data stays bytes until that greenlet decodes it."""
        msg_id, event, retry, reply_token, body = self.delivered(data)
        self.pending.append(Message(msg_id, event, body, retry, self.id, self, reply_token))
        self.wakeup.set()

    def notice(self, hook: Callable[..., Any], *args: Any) -> None:
        self.pending.append(notice(hook, *args))
        self.wakeup.set()

    def wake(self) -> None:
        self.wakeup.set()

    def settled(self) -> None:
        self.replayed.set()

    def run(self) -> None:
        """Run this consumer's callbacks one by one, in delivery order (its greenlet's body)."""
        while self.active:
            self.wakeup.wait()
            self.wakeup.clear()
            while self.pending and self.active:
                item = self.pending.popleft()
                if isinstance(item, Message):
                    self._dispatch(item)
                elif callable(item):
                    item()

    def _dispatch(self, message: Message) -> None:
        """Call the callback; an exception is logged and, with manual_ack, rejects the message."""
        try:
            message.data = message.data.decode()
            if self.json:
                message.data = ujson.loads(message.data)
            self.callback(message)
        except Exception:
            log.exception("mqks consumer %s (queue %s): callback failed on message %s",
                          message.consumer_id, self.queue, message.id)
            if self.manual_ack and not message._settled:
                try:
                    message.reject()
                except MqksError as e:
                    log.warning("mqks consumer %s: cannot reject message %s: %s", message.consumer_id, message.id, e)


class Consumers(Registry[Consumer]):
    """Every live consumer of one link, by id; the `Session` its link runs (see connection.py)."""

    __slots__ = ()
    link: Link | None

    def start(self, consumer: Consumer) -> None:
        """Know `consumer` by its id and start its greenlet."""
        consumer.greenlet = gevent.spawn(consumer.run)
        super().start(consumer)

    def stop(self) -> list[gevent.Greenlet]:
        """Stop every consumer for good; returns their greenlets (but the caller's) for the client to kill."""
        for consumer in self.by_id.values():
            consumer.active = False
        current = gevent.getcurrent()
        return [consumer.greenlet for consumer in set(self.by_id.values())
                if consumer.greenlet is not None and consumer.greenlet is not current]

    def replay(self, conn: Connection) -> Callable[[float], None]:
        """Recreate every live consumer on `conn` under a new id; returns what waits for their confirms.

        The link waits for its handshake pong before that: a broker that is down fails the handshake
        instead of having its consumers dropped as refused. `on_connect` runs first: it may take away
        consumers that a new slot map places on another link.
        """
        if self.on_connect is not None:
            self.on_connect(self)
        replays = self.replay_requests(conn)

        def confirm(deadline: float) -> None:
            for consumer, rid, future in replays:
                try:
                    conn.wait(rid, future, deadline, "consumer replay")
                except MqksConnectionError:
                    raise
                except MqksError as e:
                    self.replay_refused(consumer, e)

        return confirm


def _no_answer(token: str, data: Any, json: bool, confirm: bool) -> None:
    raise MqksError("this consumer was made without a client: it cannot reply")


def notice(callback: Callable[..., Any], *args: Any) -> Callable[[], None]:
    """A queued call to a user hook that logs instead of raising."""
    def run() -> None:
        try:
            callback(*args)
        except Exception:
            log.exception("mqks: %r%r failed", callback, args)
    return run

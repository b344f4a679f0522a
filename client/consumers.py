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
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import gevent
import ujson
from gevent.event import AsyncResult, Event

from . import wire
from .errors import MqksConnectionError, MqksError, is_transient

if TYPE_CHECKING:
    from .connection import Connection, Link

log = logging.getLogger("mqks.client")

# (action, consumer_id, msg_ids, all, confirm, timeout, flags): the client's ack/reject/touch, for Message's
Settle: TypeAlias = Callable[[bytes, str, tuple[str, ...], bool, bool, float | None, tuple[bytes, ...]], None]
# (reply token, data, json, confirm): the client's reply, for Message.reply
Answer: TypeAlias = Callable[[str, Any, bool, bool], None]


class Message:
    """One delivery. `ack`/`reject`/`touch` matter only for a `manual_ack` consumer.

    `reply_token` is set when the message came from a `request` (extension): `reply(data)` answers it.
    """

    __slots__ = ("id", "event", "data", "retry", "consumer_id", "_consumer", "_settled", "_reply_token")

    def __init__(self, msg_id: str, event: str, data: Any, retry: int, consumer_id: str,
                 consumer: Consumer | None = None, reply_token: bytes = b"") -> None:
        self.id = msg_id
        self.event = event
        self.data = data
        self.retry = retry
        self.consumer_id = consumer_id
        self._consumer = consumer
        self._settled = False
        self._reply_token = reply_token  # as delivered: decoded only when asked for, off the hot path

    @property
    def reply_token(self) -> str | None:
        """The broker's token of the `request` this message came from; None for a plain publish."""
        return self._reply_token.decode() if self._reply_token else None

    def ack(self, confirm: bool = False) -> None:
        """Ack once; a no-op for an auto-ack consumer (the broker acked on delivery) or when already settled."""
        self._settle(b"ack", confirm)

    def reject(self, confirm: bool = False, delay: float | None = None) -> None:
        """Return the message to the front of its queue with retry + 1 (manual_ack consumers only).

        `delay` (extension) requeues it after that many seconds instead of at once.
        """
        if self._consumer is not None and not self._consumer.manual_ack:
            raise MqksError("reject needs a consumer with manual_ack=True")
        flags = () if delay is None else (b"--delay=" + wire.seconds_token(delay, "delay", zero_ok=True),)
        self._settle(b"reject", confirm, flags)

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
        consumer = self._consumer
        token = self.reply_token
        if token is None or consumer is None:
            raise MqksError(f"message {self.id} came from a publish, not a request: there is nothing to reply to")
        consumer.answer(token, data, consumer.json if json is None else json, confirm)

    def _settle(self, action: bytes, confirm: bool, flags: tuple[bytes, ...] = ()) -> None:
        consumer = self._consumer
        if self._settled or consumer is None or not consumer.manual_ack:
            return
        self._settled = True
        if self.consumer_id != consumer.id:
            # delivered on an earlier connection: the broker already requeued it, and the same
            # msg id may be in flight again under the new consumer id
            return
        consumer.settle(action, self.consumer_id, (self.id,), False, confirm, None, flags)

    def __repr__(self) -> str:
        reply = "" if self.reply_token is None else f", reply_token={self.reply_token!r}"
        return (f"Message(id={self.id!r}, event={self.event!r}, data={self.data!r}, "
                f"retry={self.retry}, consumer_id={self.consumer_id!r}{reply})")


MessageCallback: TypeAlias = Callable[[Message], Any]


class Consumer:
    """What the client needs to replay a consumer: queue, its current events, flags, callbacks."""

    __slots__ = ("settle", "answer", "id", "first_id", "aliases", "reported_id", "queue", "events", "events_known",
                 "manual_ack", "delete_queue_when_unused", "prefetch", "ack_timeout", "max_retries", "max_length",
                 "callback", "json", "on_disconnect", "on_reconnect", "pending", "wakeup", "greenlet", "unacked",
                 "replaying", "active", "home", "conn")

    def __init__(self, settle: Settle, consumer_id: str, queue: str, events: list[str], add: bool,
                 callback: MessageCallback, manual_ack: bool, delete_queue_when_unused: float | bool | None,
                 prefetch: int, json: bool, on_disconnect: Callable[[str], Any] | None,
                 on_reconnect: Callable[[str, str], Any] | None, *, answer: Answer | None = None,
                 ack_timeout: float | None = None, max_retries: wire.QueueSetting = None,
                 max_length: wire.QueueSetting = None) -> None:
        self.settle = settle
        self.answer = answer or _no_answer
        self.id = consumer_id
        self.first_id = consumer_id  # what consume() returned: valid for good
        self.aliases = [consumer_id]  # the ids `Consumers.by_any_id` knows it by
        self.reported_id = consumer_id  # the id the caller last heard of
        self.queue = queue
        self.events = list(events)
        # with --add and no --update back, the queue's other events are unknown: replay adds only ours
        self.events_known = not add
        self.manual_ack = manual_ack
        self.delete_queue_when_unused = delete_queue_when_unused
        self.prefetch = prefetch
        self.ack_timeout = ack_timeout  # the consumer's own
        # the queue's settings as this client last heard them (`--update`): a replay must not undo a rebind
        self.max_retries = max_retries
        self.max_length = max_length
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
        self.home: Consumers | None = None  # the link's session it lives on
        self.conn: Connection | None = None  # the connection its last consume line went on

    def take_unacked(self, msg_id: str) -> bool:
        """Settle one delivery of `msg_id`; False when none is pending on this connection."""
        count = self.unacked.get(msg_id, 0)
        if count <= 1:
            return self.unacked.pop(msg_id, None) is not None
        self.unacked[msg_id] = count - 1
        return True

    def consume_line(self, confirm: bool) -> bytes:
        """The consume request that (re)creates this consumer with the queue's current events."""
        events = [event.encode() for event in self.events]
        return wire.consume_line(self.id.encode(), self.queue.encode(), events, add=not self.events_known,
                                 confirm=confirm, manual_ack=self.manual_ack,
                                 delete_queue_when_unused=self.delete_queue_when_unused, prefetch=self.prefetch,
                                 ack_timeout=self.ack_timeout, max_retries=self.max_retries,
                                 max_length=self.max_length) + b"\n"

    def on_update(self, data: bytes) -> None:
        """Keep this view of the queue's events and settings, so a replay never undoes a rebind."""
        _, events = wire.split_update(data)
        self.events = events
        self.events_known = True
        self.max_retries, self.max_length = wire.update_queue_settings(data)

    def on_delivery(self, data: bytes) -> None:
        """Queue a delivery for this consumer's greenlet; data stays bytes until that greenlet decodes it."""
        msg_id, event, retry, reply_token, body = wire.split_delivery_reply(data)
        message = Message(msg_id.decode(), event.decode(), body, retry, self.id, self, reply_token)
        if self.manual_ack:
            self.unacked[message.id] = self.unacked.get(message.id, 0) + 1
        self.pending.append(message)
        self.wakeup.set()

    def on_replayed(self) -> None:
        """The broker confirmed this replayed consumer: queue on_reconnect before its first delivery."""
        self.replaying = False
        old_id, self.reported_id = self.reported_id, self.id
        if self.on_reconnect is not None:
            self.pending.append(_notice(self.on_reconnect, old_id, self.id))
            self.wakeup.set()

    def disconnected(self, notify: bool) -> None:
        """The connection is gone: forget its un-acked deliveries; `notify` queues on_disconnect."""
        self.unacked.clear()
        if self.manual_ack:
            # the broker put these back in the queue: running callbacks for them would double-process
            kept = [item for item in self.pending if not isinstance(item, Message)]
            self.pending.clear()
            self.pending.extend(kept)
        if notify and self.on_disconnect is not None:
            self.pending.append(_notice(self.on_disconnect, self.reported_id))
            self.wakeup.set()

    def run(self) -> None:
        """Run this consumer's callbacks one by one, in delivery order (its greenlet's body)."""
        while self.active:
            self.wakeup.wait()
            self.wakeup.clear()
            while self.pending and self.active:
                item = self.pending.popleft()
                if isinstance(item, Message):
                    self._dispatch(item)
                else:
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


class Consumers:
    """Every live consumer of one client, by id; the `Session` its link runs (see connection.py)."""

    __slots__ = ("where", "new_rid", "by_id", "by_any_id", "worker", "link", "on_connect")

    def __init__(self, where: str, new_rid: Callable[[], bytes], by_any_id: dict[str, Consumer] | None = None,
                 worker: int | None = None, on_connect: Callable[[Consumers], None] | None = None) -> None:
        self.where = where  # host:port, for the log
        self.new_rid = new_rid
        self.by_id: dict[str, Consumer] = {}  # current ids only
        # current and recent ids (see _keep_recent_aliases), shared by every session of one client
        self.by_any_id: dict[str, Consumer] = {} if by_any_id is None else by_any_id
        self.worker = worker  # the worker whose direct link this is; None: the public link
        self.link: Link | None = None  # set by the client once the link exists
        # runs first on every new connection, its hello read: the client learns the slot map there
        self.on_connect = on_connect

    def start(self, consumer: Consumer) -> None:
        """Know `consumer` by its id and start its greenlet."""
        consumer.greenlet = gevent.spawn(consumer.run)
        consumer.home = self
        self.by_id[consumer.id] = consumer
        self.by_any_id[consumer.id] = consumer

    def release(self, consumer: Consumer) -> None:
        """Stop routing this link's lines to `consumer`, which moves to another link (its ids stay known)."""
        self.by_id.pop(consumer.id, None)
        consumer.home = None
        consumer.unacked.clear()  # the broker requeues what it held here once the old consumer goes

    def adopt(self, consumer: Consumer) -> None:
        """Take over a consumer from another link under a new id; it is sent as a replay (on_reconnect runs)."""
        consumer.id = self.new_rid().decode()
        self._keep_recent_aliases(consumer)
        consumer.unacked.clear()
        consumer.replaying = True
        consumer.home = self
        consumer.conn = None
        self.by_id[consumer.id] = consumer
        self.by_any_id[consumer.id] = consumer

    def find(self, consumer_id: str) -> Consumer | None:
        """The consumer known by `consumer_id`: its current, first, reported or a recent id."""
        return self.by_any_id.get(consumer_id)

    def forget(self, consumer: Consumer) -> None:
        """Drop a consumer locally: no more callbacks, no replay."""
        consumer.active = False
        consumer.pending.clear()
        consumer.wakeup.set()  # let its greenlet see `active` and end
        self.by_id.pop(consumer.id, None)
        for consumer_id in consumer.aliases:
            self.by_any_id.pop(consumer_id, None)

    def forget_queue(self, queue: str) -> None:
        """Drop every consumer of `queue`: the broker removes them with it; replaying them would bring it back."""
        for consumer in [c for c in self.by_id.values() if c.queue == queue]:
            self.forget(consumer)

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
        replays: list[tuple[Consumer, bytes, AsyncResult]] = []
        for consumer in list(self.by_id.values()):
            del self.by_id[consumer.id]
            consumer.id = self.new_rid().decode()
            self._keep_recent_aliases(consumer)
            consumer.unacked.clear()
            consumer.replaying = True
            consumer.conn = conn
            self.by_id[consumer.id] = consumer
            self.by_any_id[consumer.id] = consumer
            rid = consumer.id.encode()
            replays.append((consumer, rid, conn.request(rid, consumer.consume_line(confirm=True))))

        def confirm(deadline: float) -> None:
            for consumer, rid, future in replays:
                try:
                    conn.wait(rid, future, deadline, "consumer replay")
                except MqksConnectionError:
                    raise
                except MqksError as e:
                    if is_transient(e):  # its queue's owner fails over: connect again (with back-off) and replay
                        raise MqksConnectionError(f"consumer replay on queue {consumer.queue}: {e.reason}") from None
                    # the broker refused this consumer on the new connection: it cannot come back
                    log.error("mqks %s: replay of consumer %s on queue %s failed, consumer dropped: %s",
                              self.where, consumer.reported_id, consumer.queue, e)
                    self.forget(consumer)

        return confirm

    def _keep_recent_aliases(self, consumer: Consumer) -> None:
        """Know the consumer by its new id, its first, its reported and its last few ids only.

        An alias kept per reconnect would pile up over months of a flapping network.
        """
        consumer.aliases.append(consumer.id)
        keep = {consumer.first_id, consumer.reported_id, *consumer.aliases[-3:]}
        for consumer_id in consumer.aliases:
            if consumer_id not in keep:
                self.by_any_id.pop(consumer_id, None)
        consumer.aliases = [consumer_id for consumer_id in consumer.aliases if consumer_id in keep]

    def deliver(self, rid: bytes, data: bytes) -> bool:
        """Take an `ok` line with data for a consumer (a delivery or `--update`); False when `rid` names none."""
        consumer = self.by_id.get(rid.decode())
        if consumer is None:
            return False
        if wire.is_update(data):
            consumer.on_update(data)
        else:
            consumer.on_delivery(data)
        return True

    def answered(self, rid: bytes) -> None:
        """An `ok` answer to request `rid` is about to wake its caller: a replayed consume's marks it back."""
        consumer = self.by_id.get(rid.decode())
        if consumer is not None and consumer.replaying:
            consumer.on_replayed()

    def refused(self, rid: bytes, error: MqksError) -> bool:
        """Take an error answer nobody waits for; False when `rid` names no consumer."""
        consumer = self.by_id.get(rid.decode(errors="replace"))
        if consumer is None:
            return False
        # only a consume line uses the consumer id as rid: the broker refused that consumer
        log.error("mqks %s: consumer %s on queue %s refused: %s", self.where, consumer.reported_id, consumer.queue,
                  error)
        self.forget(consumer)
        return True

    def holds_unacked(self) -> bool:
        """True while a manual-ack consumer holds a delivery of this connection not yet acked or rejected."""
        return any(consumer.unacked for consumer in self.by_id.values())

    def disconnected(self, notify: bool, closed: bool) -> None:
        """The connection is gone; `notify` runs every on_disconnect hook, `closed` says the client ended."""
        for consumer in self.by_id.values():
            # after a failed handshake, a consumer already confirmed (and announced by on_reconnect)
            # on it hears about the loss too, so the hooks always alternate
            confirmed_here = not closed and consumer.reported_id == consumer.id
            consumer.disconnected(notify or confirmed_here)


def _no_answer(token: str, data: Any, json: bool, confirm: bool) -> None:
    raise MqksError("this consumer was made without a client: it cannot reply")


def _notice(callback: Callable[..., Any], *args: Any) -> Callable[[], None]:
    """A queued call to a user hook that logs instead of raising."""
    def run() -> None:
        try:
            callback(*args)
        except Exception:
            log.exception("mqks: %r%r failed", callback, args)
    return run

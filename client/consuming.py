"""What a client consumer is on the wire, whatever runs its callbacks: its consume line, ids, view of the queue.

Step in the flow: a connection's `Answers` hands a consumer's line to its `Registry`, which finds the
consumer by rid and keeps its view of the queue (`--update`) or passes the delivery on; how a delivery
reaches user code is each client's own (a greenlet per consumer in the gevent `Client`, an async
iterator in `mqks.aio`). Invariants: a consumer id lives for one connection only: a replay renews every
consumer under a new id; the ids a caller may still hold (the first, the last reported, the last few)
stay known client-wide in one shared `by_any_id`; a manual-ack delivery counts as un-acked until settled
on the connection it came on. No I/O, no gevent.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from . import wire
from .errors import MqksConnectionError, MqksError, is_transient

log = logging.getLogger("mqks.client")

RECENT_IDS = 3  # besides its first and reported ids, the ids a consumer stays known by


class Delivery:
    """One delivered message; each client's `Message` adds the ack, reject, touch and reply it can await or call.

    `reply_token` is set when the message came from a `request` (extension).
    """

    __slots__ = ("id", "event", "data", "retry", "consumer_id", "_consumer", "_settled", "_reply_token")

    def __init__(self, msg_id: str, event: str, data: Any, retry: int, consumer_id: str,
                 consumer: ConsumerState | None = None, reply_token: bytes = b"") -> None:
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

    def _claim(self) -> bool:
        """Mark this message settled; True when the broker must hear of it (a manual-ack delivery of this connection).

        A no-op for an auto-ack consumer (the broker acked on delivery) or when already settled. A message
        delivered on an earlier connection is claimed but not sent: the broker requeued it, and the same msg id
        may be in flight again under the consumer's new id.
        """
        consumer = self._consumer
        if self._settled or consumer is None or not consumer.manual_ack:
            return False
        self._settled = True
        return self.consumer_id == consumer.id

    def _check_manual_ack(self, action: str) -> None:
        if self._consumer is not None and not self._consumer.manual_ack:
            raise MqksError(f"{action} needs a consumer with manual_ack=True")

    def _reply_to(self) -> str:
        """The reply token, or MqksError for a message from a plain publish."""
        token = self.reply_token
        if token is None or self._consumer is None:
            raise MqksError(f"message {self.id} came from a publish, not a request: there is nothing to reply to")
        return token

    def __repr__(self) -> str:
        reply = "" if self.reply_token is None else f", reply_token={self.reply_token!r}"
        return (f"Message(id={self.id!r}, event={self.event!r}, data={self.data!r}, "
                f"retry={self.retry}, consumer_id={self.consumer_id!r}{reply})")


class ConsumerState:
    """A consumer's queue, its current events and flags, its ids, and its deliveries not yet settled."""

    __slots__ = ("id", "first_id", "aliases", "reported_id", "queue", "events", "events_known", "manual_ack",
                 "delete_queue_when_unused", "prefetch", "ack_timeout", "max_retries", "max_length", "json",
                 "unacked", "replaying", "active", "pending", "on_disconnect", "on_reconnect", "home", "conn",
                 "refusal")

    def __init__(self, consumer_id: str, queue: str, events: list[str], add: bool, manual_ack: bool,
                 delete_queue_when_unused: float | bool | None, prefetch: int, json: bool, *,
                 ack_timeout: float | None = None, max_retries: wire.QueueSetting = None,
                 max_length: wire.QueueSetting = None, on_disconnect: Callable[..., Any] | None = None,
                 on_reconnect: Callable[..., Any] | None = None) -> None:
        self.id = consumer_id
        self.first_id = consumer_id  # what consume() returned: valid for good
        self.aliases = [consumer_id]  # the ids `Registry.by_any_id` knows it by
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
        self.json = json
        # msg id -> deliveries on the current connection not yet settled; a count, not a set,
        # because msg ids are the publishers' and two publishers may both send "m1"
        self.unacked: dict[str, int] = {}
        self.replaying = False
        self.active = True
        # deliveries and queued hook calls, in order, for whatever runs this consumer's user code
        self.pending: deque[Delivery | Callable[[], Any]] = deque()
        self.on_disconnect = on_disconnect  # (id), when the connection is lost
        self.on_reconnect = on_reconnect  # (old id, new id), before the first delivery under the new id
        self.home: Any = None  # the session (one per link) it lives on
        self.conn: Any = None  # the connection its last consume line went on
        self.refusal: MqksError | None = None  # why the broker refused its replay for good (it is dropped)

    def take_unacked(self, msg_id: str) -> bool:
        """Settle one delivery of `msg_id`; False when none is pending on this connection."""
        count = self.unacked.get(msg_id, 0)
        if count <= 1:
            return self.unacked.pop(msg_id, None) is not None
        self.unacked[msg_id] = count - 1
        return True

    def settling(self, action: bytes, msg_ids: tuple[str, ...], all: bool) -> tuple[str, ...] | None:
        """The msg ids of an ack, reject or touch to send for this consumer; None when nothing is left to send.

        Deliveries of an earlier connection are skipped: the broker requeued them. A touch leaves them in flight.
        """
        if action == b"touch":
            msg_ids = tuple(msg_id for msg_id in msg_ids if msg_id in self.unacked)
            return msg_ids if msg_ids or all else None
        if all:
            self.unacked.clear()
            return msg_ids
        msg_ids = tuple(msg_id for msg_id in msg_ids if self.take_unacked(msg_id))
        return msg_ids or None

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

    def delivered(self, data: bytes) -> tuple[str, str, int, bytes, bytes]:
        """(msg id, event, retry, reply token, data) of a delivery to this consumer, counted un-acked if it must be."""
        msg_id, event, retry, reply_token, body = wire.split_delivery_reply(data)
        msg_id_text = msg_id.decode()
        if self.manual_ack:
            self.unacked[msg_id_text] = self.unacked.get(msg_id_text, 0) + 1
        return msg_id_text, event.decode(), retry, reply_token, body

    def on_delivery(self, data: bytes) -> None:
        """Hand a delivery on to whatever runs this consumer's callbacks."""
        raise NotImplementedError

    def notice(self, hook: Callable[..., Any], *args: Any) -> None:
        """Queue a call to a user hook in delivery order."""
        raise NotImplementedError

    def wake(self) -> None:
        """Let whatever runs this consumer's user code look at `pending` and `active` again."""
        raise NotImplementedError

    def stop(self) -> None:
        """No more deliveries to user code: drop what is queued."""
        self.active = False
        self.pending.clear()
        self.wake()
        self.settled()

    def settled(self) -> None:
        """The broker has this consumer under its current id, or it is dropped: a consume() still waiting for its
        replay (its first line's answer lost with a connection) looks again. Nothing waits here by default."""

    def disconnected(self, notify: bool) -> None:
        """The connection is gone: forget its un-acked deliveries; `notify` queues on_disconnect."""
        self.unacked.clear()
        if self.manual_ack:
            # the broker put these back in the queue: handing them to user code would double-process
            kept = [item for item in self.pending if not isinstance(item, Delivery)]
            self.pending.clear()
            self.pending.extend(kept)
        if notify and self.on_disconnect is not None:
            self.notice(self.on_disconnect, self.reported_id)


C = TypeVar("C", bound=ConsumerState)


class Registry(Generic[C]):
    """The live consumers on one link, by id; the router's `Deliveries` (see answers.py)."""

    __slots__ = ("where", "new_rid", "by_id", "by_any_id", "worker", "link", "on_connect", "on_refused")

    def __init__(self, where: str, new_rid: Callable[[], bytes], by_any_id: dict[str, C] | None = None,
                 worker: int | None = None, on_connect: Callable[[Any], None] | None = None,
                 on_refused: Callable[[MqksError], None] | None = None) -> None:
        self.where = where  # host:port, for the log
        self.new_rid = new_rid
        self.by_id: dict[str, C] = {}  # current ids only
        # current and recent ids, shared by every link of one client
        self.by_any_id: dict[str, C] = {} if by_any_id is None else by_any_id
        self.worker = worker  # the worker whose direct link this is; None: the public link
        self.link: Any = None  # the transport's Link, set by the client once it exists
        # runs first on every new connection, its hello read: the client learns the slot map there
        self.on_connect = on_connect
        # hands the client's on_refused an error answer nobody waits for, without running it here; None: logged
        self.on_refused = on_refused

    def add(self, consumer: C) -> None:
        """Know `consumer` by its id here and client-wide."""
        self.by_id[consumer.id] = consumer
        self.by_any_id[consumer.id] = consumer

    def start(self, consumer: C) -> None:
        """A new consumer lives on this link."""
        consumer.home = self
        self.add(consumer)

    def release(self, consumer: C) -> None:
        """Stop routing this link's lines to `consumer`, which moves to another link (its ids stay known)."""
        self.by_id.pop(consumer.id, None)
        consumer.home = None
        consumer.unacked.clear()  # the broker requeues what it held here once the old consumer goes

    def adopt(self, consumer: C) -> None:
        """Take over a consumer from another link under a new id; it is sent as a replay (on_reconnect runs)."""
        self.renew(consumer)
        consumer.home = self
        consumer.conn = None

    def replay_requests(self, conn: Any) -> list[tuple[C, bytes, Any]]:
        """Send every live consumer's consume on the new connection `conn` under a new id: (consumer, rid, waiter)."""
        replays = []
        for consumer in list(self.by_id.values()):
            self.renew(consumer)
            consumer.conn = conn
            rid = consumer.id.encode()
            replays.append((consumer, rid, conn.request(rid, consumer.consume_line(confirm=True))))
        return replays

    def replay_refused(self, consumer: C, error: MqksError) -> None:
        """The broker refused a replayed consume: a failover passes (reconnect and replay again), the rest drops it."""
        if is_transient(error):
            raise MqksConnectionError(f"consumer replay on queue {consumer.queue}: {error.reason}") from None
        log.error("mqks %s: replay of consumer %s on queue %s failed, consumer dropped: %s",
                  self.where, consumer.reported_id, consumer.queue, error)
        consumer.refusal = error
        self.forget(consumer)

    def disconnected(self, notify: bool, closed: bool) -> None:
        """The connection is gone; `notify` runs every on_disconnect hook, `closed` says the client ended."""
        for consumer in self.by_id.values():
            # after a failed handshake, a consumer already confirmed (and announced by on_reconnect)
            # on it hears about the loss too, so the hooks always alternate
            confirmed_here = not closed and consumer.reported_id == consumer.id
            consumer.disconnected(notify or confirmed_here)

    def renew(self, consumer: C) -> None:
        """Give `consumer` a new id (a replay, a move to this link): known here by it, its deliveries so far void."""
        self.by_id.pop(consumer.id, None)
        consumer.id = self.new_rid().decode()
        consumer.aliases.append(consumer.id)
        # an alias kept per reconnect would pile up over months of a flapping network
        keep = {consumer.first_id, consumer.reported_id, *consumer.aliases[-RECENT_IDS:]}
        for consumer_id in consumer.aliases:
            if consumer_id not in keep:
                self.by_any_id.pop(consumer_id, None)
        consumer.aliases = [consumer_id for consumer_id in consumer.aliases if consumer_id in keep]
        consumer.unacked.clear()
        consumer.replaying = True
        self.add(consumer)

    def find(self, consumer_id: str) -> C | None:
        """The consumer known by `consumer_id`: its current, first, reported or a recent id."""
        return self.by_any_id.get(consumer_id)

    def settle_plan(self, action: bytes, consumer_id: str, msg_ids: tuple[str, ...], all: bool,
                    flags: tuple[bytes, ...] = ()) -> tuple[Any, list[bytes]] | None:
        """(link, arguments) an ack, reject or touch goes out with; None when nothing is to be sent.

        A bad call raises before anything is taken. A consumer of this client's is settled on its own link
        (its worker's) under its current id; while it moves or its link is down nothing is sent (the broker
        requeued what it held). An id this client does not know goes as given, on the public link (None).
        """
        args = wire.settle_args(action, consumer_id, msg_ids, all, flags)
        consumer = self.find(consumer_id)
        if consumer is None:
            return None, args
        link = consumer.home.link if consumer.home is not None else None
        if link is None or not link.connected:
            return None
        to_send = consumer.settling(action, msg_ids, all)
        if to_send is None:
            return None
        if consumer.id != consumer_id or to_send != msg_ids:
            args = wire.settle_args(action, consumer.id, to_send, all, flags)
        return link, args

    def forget(self, consumer: C) -> None:
        """Drop a consumer locally: no more deliveries, no replay."""
        consumer.stop()
        self.by_id.pop(consumer.id, None)
        for consumer_id in consumer.aliases:
            self.by_any_id.pop(consumer_id, None)

    def forget_queue(self, queue: str) -> None:
        """Drop every consumer of `queue`: the broker removes them with it; replaying them would bring it back."""
        for consumer in [c for c in self.by_id.values() if c.queue == queue]:
            self.forget(consumer)

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
            self.replayed(consumer)

    def replayed(self, consumer: C) -> None:
        """The broker confirmed a replayed consumer under its new id: on_reconnect comes before its first delivery."""
        consumer.replaying = False
        old_id, consumer.reported_id = consumer.reported_id, consumer.id
        if consumer.on_reconnect is not None:
            consumer.notice(consumer.on_reconnect, old_id, consumer.id)
        consumer.settled()

    def refused(self, rid: bytes, error: MqksError) -> bool:
        """Take an error answer nobody waits for; False when `rid` names no consumer and no on_refused takes it."""
        consumer = self.by_id.get(rid.decode(errors="replace"))
        if consumer is None:
            if self.on_refused is None:
                return False
            self.on_refused(error)  # a request sent without confirm: a refused publish, ack, rebind...
            return True
        # only a consume line uses the consumer id as rid: the broker refused that consumer
        log.error("mqks %s: consumer %s on queue %s refused: %s", self.where, consumer.reported_id, consumer.queue,
                  error)
        self.forget(consumer)
        return True

    def holds_unacked(self) -> bool:
        """True while a manual-ack consumer holds a delivery of this connection not yet acked or rejected."""
        return any(consumer.unacked for consumer in self.by_id.values())

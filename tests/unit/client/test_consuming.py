"""What a client consumer is on the wire (client/consuming.py), shared by both clients: a manual-ack delivery counts
un-acked until settled on its connection, a replay renews the consumer under a new id while the ids a caller may
hold stay known (a bounded few), a rebind's `--update` is kept so a replay never undoes it, and a disconnect drops
the deliveries the broker put back. In process: a consumer that queues what it is handed."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from mqks.client.consuming import RECENT_IDS, ConsumerState, Delivery, Registry

pytestmark = pytest.mark.timeout(10)


class Consumer(ConsumerState):
    def on_delivery(self, data: bytes) -> None:
        msg_id, event, retry, _, body = self.delivered(data)
        self.pending.append(Delivery(msg_id, event, body, retry, self.id, self))

    def notice(self, hook, *args) -> None:
        self.pending.append(lambda: hook(*args))

    def wake(self) -> None:
        pass


def new_consumer(manual_ack: bool = True, **options) -> tuple[Consumer, Registry]:
    rids = (b"r%d" % n for n in itertools.count(2))
    registry: Registry[Consumer] = Registry("127.0.0.1:25000", lambda: next(rids))
    consumer = Consumer("r1", "q", ["e1", "e2"], add=False, manual_ack=manual_ack, delete_queue_when_unused=None,
                        prefetch=0, json=False, **options)
    registry.start(consumer)
    consumer.home = SimpleNamespace(link=SimpleNamespace(connected=True))
    return consumer, registry


def test_a_manual_ack_delivery_is_unacked_until_settled_once():
    consumer, registry = new_consumer()
    assert registry.deliver(b"r1", b"m1 event=e1 hello")
    assert registry.deliver(b"r1", b"m1 event=e1 again")  # a publisher reused the id: two deliveries
    assert consumer.unacked == {"m1": 2} and [d.data for d in consumer.pending] == [b"hello", b"again"]
    link, args = registry.settle_plan(b"ack", "r1", ("m1",), False)
    assert link is consumer.home.link and b"r1" in args and b"m1" in args
    assert consumer.unacked == {"m1": 1}
    registry.settle_plan(b"ack", "r1", ("m1",), False)
    assert consumer.unacked == {} and registry.settle_plan(b"ack", "r1", ("m1",), False) is None
    assert not registry.deliver(b"r9", b"m2 event=e1 x")  # nobody's


def test_an_update_is_kept_so_a_replay_sends_the_queues_events_and_settings():
    consumer, registry = new_consumer()
    assert registry.deliver(b"r1", b"--update q e1 e3 --max-retries=2")
    assert consumer.events == ["e1", "e3"] and consumer.max_retries == 2
    line = consumer.consume_line(confirm=True)
    assert b" q e1 e3 " in line and b"--max-retries=2" in line and line.endswith(b"\n")


def test_a_replay_renews_the_id_and_keeps_the_ids_a_caller_may_hold():
    consumer, registry = new_consumer()
    registry.deliver(b"r1", b"m1 event=e1 x")
    for _ in range(RECENT_IDS + 4):  # a flapping network
        registry.renew(consumer)
    assert consumer.id != "r1" and consumer.unacked == {} and consumer.replaying
    assert registry.find("r1") is consumer and registry.find(consumer.id) is consumer
    assert len(registry.by_any_id) <= RECENT_IDS + 2  # first, reported, and the last few: bounded
    link, args = registry.settle_plan(b"ack", "r1", ("m1",), False) or (None, None)
    assert link is None and args is None  # delivered on an earlier connection: the broker requeued it


def test_a_disconnect_drops_manual_ack_deliveries_and_tells_the_hook():
    lost: list[str] = []
    consumer, registry = new_consumer(on_disconnect=lost.append)
    registry.deliver(b"r1", b"m1 event=e1 x")
    registry.disconnected(notify=True, closed=False)
    assert consumer.unacked == {} and not any(isinstance(item, Delivery) for item in consumer.pending)
    for hook in consumer.pending:
        hook()
    assert lost == ["r1"]


def test_forgetting_a_queue_drops_its_consumers_and_their_ids():
    consumer, registry = new_consumer()
    registry.forget_queue("q")
    assert not consumer.active and registry.find("r1") is None and registry.by_id == {}

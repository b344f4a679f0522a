"""The broker core with no sockets: queues, consumers, acks, rebinds, delete-when-unused."""

import pytest

from mqks.server.core.messages import PACK_MIN_DEPTH, PACK_TAILS, Message, Packed, unpack
from mqks.server.core.state import Broker, Consumer, TimedConsumer, update_line
from mqks.server.core.timers import Timers
from mqks.server.wire.outbox import Outbox

pytestmark = [pytest.mark.timeout(10), pytest.mark.core]


class FakeClock:
    """The server's timer heap on a clock that moves only when the test says so."""

    def __init__(self):
        self.now = 0.0
        self.timers = Timers(clock=lambda: self.now)
        self.schedule = self.timers.call_later

    def advance(self, seconds: float) -> int:
        self.now += seconds
        return self.timers.run_due()


def tail(msg_id: bytes, event: bytes, data: bytes) -> bytes:
    return b" ok %b event=%b %b" % (msg_id, event, data)


def publish(broker: Broker, msg_id: bytes, event: bytes, data: bytes = b"d") -> None:
    broker.publish(msg_id, event, tail(msg_id, event, data))


def delivered(outbox: Outbox) -> list[bytes]:
    lines = b"".join(outbox.pieces()).split(b"\n")[:-1]
    outbox.discard()
    outbox.out_bytes = 0
    return lines


def consume(broker, outbox, consumer_id, queue, events=(), add=None, **flags) -> Consumer:
    queue = broker.queue(queue)
    consumer = Consumer(consumer_id, queue, outbox, **flags)
    broker.consume(consumer, list(events), add)
    broker.pump(queue)
    return consumer


@pytest.fixture
def broker():
    return Broker()


@pytest.fixture
def outbox():
    return Outbox(pending=[])


def test_message_waits_in_queue_until_a_consumer_comes(broker, outbox):
    broker.rebind(broker.queue(b"q1"), replace=[b"e1"])
    publish(broker, b"m1", b"e1")
    assert broker.queues[b"q1"].depth() == 1
    consume(broker, outbox, b"c1", b"q1")
    assert delivered(outbox) == [b"c1 ok m1 event=e1 d"]
    assert broker.stats()["messages_waiting"] == 0


def test_each_bound_queue_gets_one_copy_sharing_the_tail(broker, outbox):
    consume(broker, outbox, b"c1", b"q1", [b"e1"])
    consume(broker, outbox, b"c2", b"q2", [b"e1", b"e.*"])
    broker.publish(b"m1", b"e1", tail(b"m1", b"e1", b"x"))
    assert delivered(outbox) == [b"c1 ok m1 event=e1 x", b"c2 ok m1 event=e1 x"]
    assert outbox.pending == [outbox]  # marked once for the flush, not per message


def test_competing_consumers_share_round_robin(broker, outbox):
    consume(broker, outbox, b"c1", b"q", [b"e"])
    consume(broker, outbox, b"c2", b"q")
    for i in range(4):
        publish(broker, b"m%d" % i, b"e")
    lines = delivered(outbox)
    assert sorted(line.split()[0] for line in lines) == [b"c1", b"c1", b"c2", b"c2"]


def test_reject_requeues_at_front_with_retry(broker, outbox):
    consumer = consume(broker, outbox, b"c1", b"q", [b"e"], manual_ack=True, prefetch=1)
    publish(broker, b"m1", b"e")
    publish(broker, b"m2", b"e")
    assert delivered(outbox) == [b"c1 ok m1 event=e d"]
    assert broker.reject(consumer, [b"m1"]) == []
    assert delivered(outbox) == [b"c1 ok m1 event=e,retry=1 d"]
    broker.reject(consumer, [b"m1"])
    assert delivered(outbox) == [b"c1 ok m1 event=e,retry=2 d"]
    assert broker.ack(consumer, [b"m1"]) == []
    assert delivered(outbox) == [b"c1 ok m2 event=e d"]


def test_ack_of_unknown_message_is_reported(broker, outbox):
    consumer = consume(broker, outbox, b"c1", b"q", [b"e"], manual_ack=True)
    publish(broker, b"m1", b"e")
    assert broker.ack(consumer, [b"m1", b"nope"]) == [b"nope"]
    assert broker.stats()["acked"] == 1


def test_prefetch_caps_messages_in_flight(broker, outbox):
    consumer = consume(broker, outbox, b"c1", b"q", [b"e"], manual_ack=True, prefetch=2)
    for i in range(5):
        publish(broker, b"m%d" % i, b"e")
    assert len(delivered(outbox)) == 2
    broker.ack(consumer, [b"m0", b"m1"])
    assert [line.split()[2] for line in delivered(outbox)] == [b"m2", b"m3"]
    broker.ack_all(consumer)
    assert [line.split()[2] for line in delivered(outbox)] == [b"m4"]


def test_removed_consumer_returns_unacked_to_the_other_consumer(broker, outbox):
    first = consume(broker, outbox, b"c1", b"q", [b"e"], manual_ack=True)
    publish(broker, b"m1", b"e")
    delivered(outbox)
    consume(broker, outbox, b"c2", b"q", manual_ack=True)
    broker.remove_consumer(first)
    assert delivered(outbox) == [b"c2 ok m1 event=e,retry=1 d"]
    assert b"c1" not in outbox.consumers_by_id


def test_duplicate_msg_ids_are_acked_one_by_one(broker, outbox):
    consumer = consume(broker, outbox, b"c1", b"q", [b"e"], manual_ack=True)
    publish(broker, b"same", b"e", b"first")
    publish(broker, b"other", b"e")
    publish(broker, b"same", b"e", b"second")
    assert len(consumer.unacked) == 3
    assert broker.ack(consumer, [b"same"]) == []
    assert list(consumer.unacked) == [1, 2]  # the oldest copy went first
    assert broker.reject(consumer, [b"same"]) == []
    assert delivered(outbox)[-1] == b"c1 ok same event=e,retry=1 second"
    assert broker.ack(consumer, [b"same"]) == []
    assert broker.ack(consumer, [b"same"]) == [b"same"]
    # nothing is left behind for repeated ids: later acks stay O(1) (issue 16)
    assert consumer.later_seqs_by_msg_id == {} and consumer.seq_by_msg_id == {b"other": 1}


def test_each_copy_gets_the_next_seq_of_its_queue_through_packing_and_requeues(broker, outbox):
    broker.rebind(broker.queue(b"q"), replace=[b"e"])
    count = PACK_MIN_DEPTH + 2000  # some of it packed
    for i in range(count):
        publish(broker, b"m%d" % i, b"e")
    consumer = consume(broker, outbox, b"c1", b"q", manual_ack=True, prefetch=10)
    assert list(consumer.unacked) == list(range(10))
    broker.reject(consumer, [b"m3", b"m4"])  # back at the front, with their own seqs
    broker.ack(consumer, [b"m%d" % i for i in (0, 1, 2, 5, 6, 7, 8, 9)])
    assert list(consumer.unacked) == [3, 4, *range(10, 18)]
    while consumer.unacked:
        broker.ack_all(consumer)
    assert broker.queues[b"q"].next_seq == count
    publish(broker, b"late", b"e")
    assert list(consumer.unacked) == [count]


def test_rebind_replace_remove_add_and_remove_mask(broker):
    queue = broker.queue(b"q1")
    assert broker.rebind(queue, replace=[b"e3", b"e4", b"e5.id1.a1", b"e5.id2.a2"])
    assert broker.rebind(queue, remove=[b"e3"], add=[b"e6", b"e7"])
    assert list(queue.events) == [b"e4", b"e5.id1.a1", b"e5.id2.a2", b"e6", b"e7"]
    assert broker.rebind(queue, remove_masks=[b"e5.*.a1", b"e5.*.a2"], add=[b"e8"])
    assert list(queue.events) == [b"e4", b"e6", b"e7", b"e8"]
    assert not broker.rebind(queue, add=[b"e8"])  # nothing changed: no --update
    assert broker.routing.route(b"e5.id1.a1") == ()
    assert broker.routing.route(b"e8") == (queue,)


def test_update_line_lists_sorted_events_the_queues_setting_and_the_consumers_flags(broker, outbox):
    consumer = consume(broker, outbox, b"c1", b"q1", [b"e2", b"e1"], manual_ack=True)
    consumer.queue.delete_when_unused_seconds = 5.0
    assert update_line(consumer) == b"c1 ok --update q1 e1 e2 --delete-queue-when-unused=5.0 --manual-ack\n"


def test_delete_queue_when_unused_immediately(broker, outbox):
    consumer = consume(broker, outbox, b"c1", b"q", [b"e"], delete_when_unused_seconds=0.0)
    broker.remove_consumer(consumer)
    assert b"q" not in broker.queues
    assert broker.routing.route(b"e") == ()


def test_delete_queue_when_unused_after_seconds_keeps_it_if_a_consumer_returns(outbox):
    clock = FakeClock()
    broker = Broker(schedule=clock.schedule)
    first = consume(broker, outbox, b"c1", b"q", [b"e"], delete_when_unused_seconds=5.0)
    broker.remove_consumer(first)  # armed
    assert clock.advance(4.9) == 0 and b"q" in broker.queues
    second = consume(broker, outbox, b"c2", b"q", delete_when_unused_seconds=5.0)  # cancelled
    assert clock.advance(10) == 0 and b"q" in broker.queues
    broker.remove_consumer(second)  # armed again: a timer that re-arms after a cancel (issue 18)
    assert clock.advance(4.9) == 0 and b"q" in broker.queues
    assert clock.advance(0.2) == 1
    assert b"q" not in broker.queues and broker.routing.route(b"e") == ()


def test_delete_queue_when_unused_rearms_from_the_last_consumer_leaving(outbox):
    clock = FakeClock()
    broker = Broker(schedule=clock.schedule)
    first = consume(broker, outbox, b"c1", b"q", [b"e"], delete_when_unused_seconds=5.0)
    second = consume(broker, outbox, b"c2", b"q", delete_when_unused_seconds=5.0)
    broker.remove_consumer(first)
    assert len(clock.timers) == 0  # a consumer is left: nothing armed
    clock.advance(3)
    broker.remove_consumer(second)
    assert clock.advance(4.9) == 0 and b"q" in broker.queues  # counted from the last one leaving
    assert clock.advance(0.2) == 1 and b"q" not in broker.queues


def test_consume_without_the_flag_clears_the_queues_setting_and_disarms(outbox):
    clock = FakeClock()
    broker = Broker(schedule=clock.schedule)
    first = consume(broker, outbox, b"c1", b"q", [b"e"], delete_when_unused_seconds=5.0)
    broker.remove_consumer(first)
    plain = consume(broker, outbox, b"c2", b"q")
    broker.remove_consumer(plain)
    assert clock.advance(60) == 0 and b"q" in broker.queues


def test_delete_queue_drops_messages_bindings_and_consumers(broker, outbox):
    consume(broker, outbox, b"c1", b"q", [b"e"], manual_ack=True, prefetch=1)
    publish(broker, b"m1", b"e")
    publish(broker, b"m2", b"e")
    assert broker.delete_queue(b"q")
    assert not broker.delete_queue(b"q")
    assert outbox.consumers_by_id == {}
    stats = broker.stats()
    assert (stats["queues"], stats["consumers"], stats["events"]) == (0, 0, 0)


def test_high_water_pauses_deliveries_until_resumed(broker):
    outbox = Outbox(pending=[], high_water_bytes=100)
    consume(broker, outbox, b"c1", b"q", [b"e"])
    for i in range(20):
        publish(broker, b"m%d" % i, b"e", b"x" * 30)
    assert outbox.paused
    sent = len(delivered(outbox))
    assert 0 < sent < 20
    assert broker.stats()["consumed"] + broker.queues[b"q"].depth() == 20
    while broker.queues[b"q"].depth():
        outbox.paused = False
        outbox.out_bytes = 0
        broker.pump(broker.queues[b"q"])  # each resume must deliver, or this loops until the timeout
        batch = len(delivered(outbox))
        assert batch > 0
        sent += batch
    assert sent == 20


def test_retry_is_a_field_inserted_after_the_event_whatever_the_event_holds():
    assert Message(0, 1, b" ok m1 event=e1 a b c").delivery_tail() == b" ok m1 event=e1,retry=1 a b c"
    assert Message(0, 10, b" ok m1 event=e1 ").delivery_tail() == b" ok m1 event=e1,retry=10 "
    assert Message(0, 2, b" ok m1 event=x,retry=z d,retry=5").delivery_tail() == \
        b" ok m1 event=x,retry=z,retry=2 d,retry=5"


def test_event_holding_retry_text_is_requeued_intact(broker, outbox):
    consumer = consume(broker, outbox, b"c1", b"q", [b"x,retry=z", b"y,retry=5"], manual_ack=True)
    publish(broker, b"m1", b"x,retry=z", b"hello")
    publish(broker, b"m2", b"y,retry=5", b"hi")
    delivered(outbox)
    assert broker.reject(consumer, [b"m1", b"m2"]) == []
    assert delivered(outbox) == [b"c1 ok m1 event=x,retry=z,retry=1 hello", b"c1 ok m2 event=y,retry=5,retry=1 hi"]
    broker.reject(consumer, [b"m2"])
    assert delivered(outbox) == [b"c1 ok m2 event=y,retry=5,retry=2 hi"]


def test_stats_count_the_flow(broker, outbox):
    consumer = consume(broker, outbox, b"c1", b"q", [b"e"], manual_ack=True)
    publish(broker, b"m1", b"e")
    publish(broker, b"m2", b"nobody-listens")
    broker.reject(consumer, [b"m1"])
    stats = broker.stats()
    assert (stats["published"], stats["queued"], stats["rejected"], stats["messages_unacked"]) == (2, 1, 1, 1)
    assert stats["top_queues"] == [("q", 0)]


def test_deep_queue_packs_messages_and_still_delivers_all_in_order(broker, outbox):
    count = PACK_MIN_DEPTH * 3
    broker.rebind(broker.queue(b"q"), replace=[b"e"])
    for i in range(count):
        publish(broker, b"m%d" % i, b"e", b"data with\rcarriage return %d" % i)
    queue = broker.queues[b"q"]
    runs = [item for item in queue.messages if type(item) is Packed]
    assert len(runs) == (count - PACK_MIN_DEPTH) // PACK_TAILS  # the tails behind the first PACK_MIN_DEPTH
    assert {len(unpack(run)) for run in runs} == {PACK_TAILS}
    assert len(queue.messages) < count  # packed: fewer objects than messages
    assert broker.stats()["messages_waiting"] == count
    consumer = consume(broker, outbox, b"c1", b"q", manual_ack=True, prefetch=1000)
    got = delivered(outbox)
    broker.reject(consumer, [b"m0"])  # back at the very front, before every packed run
    got += delivered(outbox)
    assert got[-1].startswith(b"c1 ok m0 event=e,retry=1 data with\rcarriage")
    order = [line.split(b" ")[2] for line in got]
    while len(order) < count + 1:
        broker.ack_all(consumer)
        order += [line.split(b" ")[2] for line in delivered(outbox)]
    assert order[:1000] == [b"m%d" % i for i in range(1000)]
    assert order[1000] == b"m0"  # the rejected one came back first
    assert order[1001:] == [b"m%d" % i for i in range(1000, count)]
    assert broker.stats()["messages_waiting"] == 0


def test_a_dead_letter_behind_a_deep_packed_queue_keeps_every_seq_and_the_order(broker, outbox):
    dead = broker.queue(b"q.dead")
    broker.rebind(dead, replace=[b"direct"])
    count = PACK_MIN_DEPTH + 2000  # deep enough to be packed
    for i in range(count):
        publish(broker, b"p%d" % i, b"direct")
    assert any(type(item) is Packed for item in dead.messages)
    record = dead.put_record(tail(b"m1", b"e1", b"poison"), 3)
    assert record.seq == count and dead.depth() == count + 1
    publish(broker, b"after", b"direct")
    consumer = consume(broker, outbox, b"c1", b"q.dead", manual_ack=True)
    lines = delivered(outbox)
    assert lines[0] == b"c1 ok p0 event=direct d" and lines[count - 1] == b"c1 ok p%d event=direct d" % (count - 1)
    assert lines[count:] == [b"c1 ok m1 event=e1,retry=3 poison", b"c1 ok after event=direct d"]
    assert list(consumer.unacked) == list(range(count + 2))  # seqs in order, none skipped or repeated


def test_ack_timeout_expires_in_delivery_order_and_touch_moves_one_to_the_end(outbox):
    clock = FakeClock()
    broker = Broker(schedule=clock.schedule, clock=lambda: clock.now)
    queue = broker.queue(b"q1")
    consumer = TimedConsumer(b"c1", queue, outbox, manual_ack=True, ack_timeout_seconds=10, clock=lambda: clock.now)
    broker.consume(consumer, [b"e1"], None)
    for i in range(3):
        publish(broker, b"m%d" % i, b"e1")
        clock.advance(1)
    delivered(outbox)
    assert len(clock.timers) == 1  # one timer for the consumer, not one per message
    broker.touch(consumer, [b"m0"])  # m0's clock restarts at t=3: due at 13
    clock.advance(7.5)  # t=10.5: m1 (due 11) and m2 (due 12) not yet
    assert delivered(outbox) == []
    clock.advance(1)  # t=11.5: m1 is due
    assert delivered(outbox) == [b"c1 ok m1 event=e1,retry=1 d"]
    broker.ack(consumer, [b"m2"])
    clock.advance(1.6)  # t=13.1: m0 is due; m2 was acked; m1, delivered again at 11.5, is due at 21.5
    assert delivered(outbox) == [b"c1 ok m0 event=e1,retry=1 d"]
    assert broker.ack_timeouts == 2 and broker.touched == 1
    assert list(consumer.deadline_by_seq) == [1, 0]
    broker.remove_consumer(consumer)
    assert consumer.deadline_by_seq == {} and consumer.cancel_timer is None


def test_ack_one_forgets_the_copy_and_its_deadline_and_refuses_what_is_not_in_flight(outbox):
    """The one-id ack (an ack line per message) keeps the same books as `ack`: the oldest copy of a repeated id
    first, its ack-timeout deadline gone with it, and False (nothing changed) for an id not in flight."""
    clock = FakeClock()
    broker = Broker(schedule=clock.schedule, clock=lambda: clock.now)
    queue = broker.queue(b"q1")
    consumer = TimedConsumer(b"c1", queue, outbox, manual_ack=True, ack_timeout_seconds=10, clock=lambda: clock.now)
    broker.consume(consumer, [b"e1"], None)
    for msg_id in (b"m0", b"m1", b"m0"):
        publish(broker, msg_id, b"e1")
    assert len(delivered(outbox)) == 3
    assert broker.ack_one(consumer, b"m0") and broker.ack_one(consumer, b"m1")
    assert list(consumer.unacked) == list(consumer.deadline_by_seq) == [2]  # the younger m0 is still held
    assert not broker.ack_one(consumer, b"m1") and not broker.ack_one(consumer, b"nope")
    assert broker.ack_one(consumer, b"m0") and not broker.ack_one(consumer, b"m0")
    assert (consumer.unacked, consumer.deadline_by_seq, consumer.seq_by_msg_id, broker.acked) == ({}, {}, {}, 3)
    clock.advance(11)
    assert delivered(outbox) == [] and broker.ack_timeouts == 0


@pytest.mark.parametrize("held", [PACK_TAILS - 1, PACK_TAILS, 4000, PACK_MIN_DEPTH - 1, PACK_MIN_DEPTH,
                                  PACK_MIN_DEPTH + PACK_TAILS + 7])
@pytest.mark.parametrize("requeue", ["remove_consumer", "reject_all"])
def test_requeued_messages_then_new_publishes_across_every_packing_boundary_all_arrive_in_order(outbox, held,
                                                                                              requeue):
    # issue 31.1: the count of tails appended since the last pack outlived a drained queue, so
    # the packer took requeued records for plain tails, raised, and dropped what it had popped
    broker = Broker()
    broker.rebind(broker.queue(b"q"), replace=[b"e"])
    for i in range(held):
        publish(broker, b"m%d" % i, b"e")
    consumer = consume(broker, outbox, b"c1", b"q", manual_ack=True)
    assert len(delivered(outbox)) == held and broker.queues[b"q"].depth() == 0
    if requeue == "remove_consumer":
        broker.remove_consumer(consumer)
    else:
        consumer.outbox.paused = True  # the rejected ones stay in the queue
        broker.reject_all(consumer)
    queue = broker.queues[b"q"]
    assert queue.depth() == held
    later = 2 * PACK_MIN_DEPTH + PACK_TAILS + 3  # across several packs, wherever they fall
    for i in range(later):
        publish(broker, b"n%d" % i, b"e")
    assert queue.depth() == held + later
    # every run holds PACK_TAILS tails: a run packed into another would make one huge item to unpack
    assert {len(unpack(item)) for item in queue.messages if type(item) is Packed} == {PACK_TAILS}
    drainer = consume(broker, Outbox(pending=[]), b"c2", b"q")
    got = [line.split(b" ")[2] for line in delivered(drainer.outbox)]
    assert got == [b"m%d" % i for i in range(held)] + [b"n%d" % i for i in range(later)]
    assert queue.depth() == 0


def test_a_pack_that_fails_keeps_every_tail_it_was_given():
    # issue 31.1: the packer popped its run, the join raised, and the popped items were gone
    queue = Broker().queue(b"q")
    for i in range(PACK_MIN_DEPTH + PACK_TAILS - 1):
        queue.put(tail(b"m%d" % i, b"e", b"d"), b"m%d" % i)
    queue.newest[-1] = Message(10**6, 1, tail(b"odd", b"e", b"d"))  # where only tails may be: a bug's doing
    before = (list(queue.messages), list(queue.newest))
    with pytest.raises(TypeError):
        queue.put(tail(b"last", b"e", b"d"), b"last")
    assert (list(queue.messages), queue.newest) == (before[0], [*before[1], tail(b"last", b"e", b"d")])


def test_a_publish_no_queue_is_bound_to_is_counted_unrouted_and_nothing_else(broker, outbox):
    broker.rebind(broker.queue(b"q"), replace=[b"e"])
    publish(broker, b"m1", b"nobody")
    publish(broker, b"m2", b"e")
    assert (broker.published, broker.unrouted, broker.queued) == (2, 1, 1)
    assert broker.stats()["unrouted"] == 1


@pytest.mark.parametrize("tail_, retry, expected", [
    (b" ok m1 event=e hello there", 0, {"msg_id": "m1", "event": "e", "retry": 0, "data": "hello there"}),
    (b" ok m2 event=e ", 3, {"msg_id": "m2", "event": "e", "retry": 3, "data": ""}),
    (b" ok m3 event=job,reply=1x2 do it", 0, {"msg_id": "m3", "event": "job", "retry": 0, "data": "do it"}),
    (b" ok m4 event=e " + b"\xff" * 201, 0, {"msg_id": "m4", "event": "e", "retry": 0, "data": "\ufffd" * 200 + "…"}),
])
def test_a_peek_shows_id_event_retry_and_the_start_of_the_data(tail_, retry, expected):
    from mqks.server.dispatch.process import peek

    assert peek(tail_, retry) == expected

"""Wire transcripts over real TCP against an `mqksd` subprocess: every action and flag."""

import time

import pytest
from helpers import queue_row_on
from helpers import unique_bytes as unique
from waiting import wait_for

pytestmark = [pytest.mark.timeout(60), pytest.mark.core]

def test_spec_hello_world(broker):
    alice, bob, charlie, dave = (broker.wire() for _ in range(4))
    alice.send(b"Alice consume greetings hi hello")
    bob.send(b"Bob consume greetings hi hello")
    charlie.send(b"Charlie consume greetings-and-byes hi hello bye good-bye")
    for conn in (alice, bob, charlie):
        assert conn.barrier() == []  # no line of their own before the publish, as the spec shows
    dave.send(b"Dave publish hello world")
    charlie.expect(b"Charlie ok Dave event=hello world")
    got = alice.barrier() + bob.barrier()
    assert got in ([b"Alice ok Dave event=hello world"], [b"Bob ok Dave event=hello world"])
    assert dave.barrier() == []
    for conn in (alice, bob, charlie, dave):
        conn.close()


def test_publish_confirm_and_data_with_spaces_or_empty(wire):
    queue, event = unique("q"), unique("e")
    wire.send(b"c1 consume --confirm " + queue + b" " + event)
    wire.expect(b"c1 ok ")
    wire.send(b"m1 publish --confirm " + event + b" hello big  world ")
    # the copy is queued (here: delivered) before the confirm goes out
    wire.expect(b"c1 ok m1 event=" + event + b" hello big  world ")
    wire.expect(b"m1 ok ")
    wire.send(b"m2 publish " + event)
    wire.expect(b"c1 ok m2 event=" + event + b" ")


def test_update_shows_the_queues_setting_and_each_consumers_own_flags(wire):
    queue, (e1, e2) = unique("q"), sorted((unique("e"), unique("e")))  # --update lists events sorted
    wire.send(b"c1 consume --confirm %b %b --delete-queue-when-unused=5 --manual-ack --prefetch=3" % (queue, e1))
    wire.expect(b"c1 ok ")
    wire.send(b"c2 consume --confirm %b --add %b --delete-queue-when-unused=5" % (queue, e2))
    # every consumer of the queue in the order they came, the one that used --add included
    wire.expect(b"c1 ok --update %b %b %b --delete-queue-when-unused=5.0 --manual-ack --prefetch=3" % (queue, e1, e2))
    wire.expect(b"c2 ok --update %b %b %b --delete-queue-when-unused=5.0" % (queue, e1, e2))
    wire.expect(b"c2 ok ")
    assert wire.barrier() == []


def test_consume_confirm_answers_ok_alone_unless_it_used_add(broker):
    """The original MQKS's handshake: the consumer that named its events gets no --update of its own;
    one that used --add does, since only the server knows the merged list; --add keeps the bindings."""
    first, second, publisher = broker.wire(), broker.wire(), broker.wire()
    queue, (e1, e2) = unique("q"), sorted((unique("e"), unique("e")))  # --update lists events sorted
    first.send(b"c1 consume --confirm %b %b" % (queue, e1))
    first.expect(b"c1 ok ")
    second.send(b"c2 consume --confirm %b --add %b" % (queue, e2))
    second.expect(b"c2 ok --update %b %b %b" % (queue, e1, e2))
    second.expect(b"c2 ok ")
    first.expect(b"c1 ok --update %b %b %b" % (queue, e1, e2))
    publisher.send(b"c3 consume --confirm %b %b %b" % (queue, e1, e2))
    publisher.expect(b"c3 ok ")  # nothing changed: no --update to anyone
    assert first.barrier() == [] and second.barrier() == [] and publisher.barrier() == []
    publisher.send(b"dc delete_consumer --confirm c3")
    publisher.expect(b"dc ok ")
    publisher.send(b"m1 publish %b x" % e1, b"m2 publish %b y" % e2)
    publisher.barrier()  # both publishes are routed before the consumers' own barriers
    got = sorted(line.split(b" ", 2)[2] for line in first.barrier() + second.barrier())
    assert got == [b"m1 event=%b x" % e1, b"m2 event=%b y" % e2]


def test_consume_with_events_replaces_bindings(broker):
    conn, publisher = broker.wire(), broker.wire()
    queue, old, new = unique("q"), unique("e"), unique("e")
    conn.send(b"c1 consume %b %b" % (queue, old))
    conn.send(b"c2 consume %b %b" % (queue, new))
    conn.expect(b"c1 ok --update %b %b" % (queue, new))
    publisher.send(b"m1 publish %b x" % old, b"m2 publish %b y" % new)
    publisher.barrier()
    lines = conn.barrier()
    assert len(lines) == 1 and lines[0].endswith(b"ok m2 event=%b y" % new)


def test_rebind_replace_remove_add_and_remove_mask(broker):
    conn, publisher = broker.wire(), broker.wire()
    queue = unique("q")
    conn.send(b"c1 consume --confirm " + queue)
    conn.expect(b"c1 ok ")
    conn.send(b"rb1 rebind --confirm %b e3 e4 e5.id1.a1 e5.id2.a2" % queue)
    conn.expect(b"c1 ok --update %b e3 e4 e5.id1.a1 e5.id2.a2" % queue)
    conn.expect(b"rb1 ok ")
    conn.send(b"rb2 rebind %b --remove e3 --add e6 e7" % queue)
    conn.expect(b"c1 ok --update %b e4 e5.id1.a1 e5.id2.a2 e6 e7" % queue)
    conn.send(b"rb3 rebind %b --remove-mask e5.*.a1 e5.*.a2 --add e8" % queue)
    conn.expect(b"c1 ok --update %b e4 e6 e7 e8" % queue)
    publisher.send(b"m1 publish e5.id1.a1 gone", b"m2 publish e8 kept")
    publisher.barrier()
    assert conn.barrier() == [b"c1 ok m2 event=e8 kept"]
    conn.send(b"rb4 rebind --confirm %b --add e8" % queue)
    conn.expect(b"rb4 ok ")  # nothing changed, so no --update came first


def test_rebind_creates_the_queue_so_messages_wait_for_a_consumer(wire):
    queue, event = unique("q"), unique("e")
    wire.send(b"rb rebind --confirm %b %b" % (queue, event))
    wire.expect(b"rb ok ")
    wire.send(b"m1 publish %b early" % event)
    wire.send(b"c1 consume %b" % queue)
    wire.expect(b"c1 ok m1 event=%b early" % event)


def test_manual_ack_reject_redelivers_with_retry(wire):
    queue, event = unique("q"), unique("e")
    wire.send(b"c1 consume %b %b --manual-ack" % (queue, event), b"m1 publish %b d1" % event)
    wire.expect(b"c1 ok m1 event=%b d1" % event)
    wire.send(b"rj1 reject c1 m1")
    wire.expect(b"c1 ok m1 event=%b,retry=1 d1" % event)
    wire.send(b"rj2 reject --confirm c1 m1")
    wire.expect(b"c1 ok m1 event=%b,retry=2 d1" % event)
    wire.expect(b"rj2 ok ")
    wire.send(b"a1 ack --confirm c1 m1")
    wire.expect(b"a1 ok ")
    assert wire.barrier() == []
    assert queue_row_on(wire, queue)["unacked"] == 0


def test_ack_and_reject_all_and_batch_ack(wire):
    queue, event = unique("q"), unique("e")
    wire.send(b"c1 consume %b %b --manual-ack" % (queue, event))
    wire.send(*(b"m%d publish %b d" % (i, event) for i in range(5)))
    for i in range(5):
        wire.expect(b"c1 ok m%d event=%b d" % (i, event))
    wire.send(b"a1 ack --confirm c1 m0 m1")
    wire.expect(b"a1 ok ")
    wire.send(b"rj reject c1 --all")
    for i in range(2, 5):
        wire.expect(b"c1 ok m%d event=%b,retry=1 d" % (i, event))
    wire.send(b"a2 ack --confirm c1 --all")
    wire.expect(b"a2 ok ")
    assert wire.barrier() == []


def test_prefetch_limits_unacked_in_flight(wire):
    queue, event = unique("q"), unique("e")
    wire.send(b"c1 consume %b %b --manual-ack --prefetch=2" % (queue, event))
    wire.send(*(b"m%d publish %b d" % (i, event) for i in range(5)))
    assert [line.split()[2] for line in wire.barrier()] == [b"m0", b"m1"]
    wire.send(b"a ack c1 m0")
    wire.expect(b"c1 ok m2 event=%b d" % event)
    assert wire.barrier() == []


def test_ack_for_unknown_consumer_or_message_is_an_error(wire):
    wire.send(b"a1 ack nobody m1")
    wire.expect_error(b"a1", b"unknown consumer")
    wire.send(b"a2 ack --confirm nobody m1")
    wire.expect_error(b"a2", b"unknown consumer")
    wire.send(b"rj reject nobody --all")
    wire.expect_error(b"rj", b"unknown consumer")
    wire.send(b"c1 consume %b --manual-ack" % unique("q"))
    wire.send(b"a3 ack c1 never-delivered")
    wire.expect_error(b"a3", b"never-delivered")


def one_unacked_message(broker):
    """Two clients; the first holds m1 un-acked as consumer c1. Returns (leaving, staying, queue, event)."""
    leaving, staying = broker.wire(), broker.wire()
    queue, event = unique("q"), unique("e")
    leaving.send(b"c1 consume %b %b --manual-ack" % (queue, event), b"m1 publish %b d" % event)
    leaving.expect(b"c1 ok m1 event=%b d" % event)
    return leaving, staying, queue, event


def test_delete_consumer_requeues_to_the_other_consumer(broker):
    leaving, staying, queue, event = one_unacked_message(broker)
    staying.send(b"c2 consume --confirm %b --manual-ack" % queue)
    staying.expect(b"c2 ok ")
    leaving.send(b"dc delete_consumer --confirm c1")
    leaving.expect(b"dc ok ")
    staying.expect(b"c2 ok m1 event=%b,retry=1 d" % event)
    leaving.send(b"a ack c1 m1")
    leaving.expect_error(b"a", b"unknown consumer")


def test_disconnect_requeues_unacked_with_retry(broker):
    leaving, staying, queue, event = one_unacked_message(broker)
    leaving.close()
    staying.send(b"c2 consume %b --manual-ack" % queue)
    staying.expect(b"c2 ok m1 event=%b,retry=1 d" % event)


def test_delete_queue_tells_its_consumers_then_drops_them(broker, wire):
    queue, event = unique("q"), unique("e")
    other = broker.wire()
    other.send(b"c2 consume --confirm %b %b --manual-ack --delete-queue-when-unused=30" % (queue, event))
    other.expect(b"c2 ok ")
    wire.send(b"c1 consume --confirm %b %b --delete-queue-when-unused=30" % (queue, event))
    wire.expect(b"c1 ok ")
    wire.send(b"m0 publish %b held" % event)
    held = wire.barrier() + other.barrier()
    assert len(held) == 1 and held[0].endswith(b" ok m0 event=%b held" % event)
    wire.send(b"dq delete_queue --confirm " + queue)
    wire.expect(b"c1 ok --update %b --delete-queue-when-unused=30.0" % queue)  # unbound: no events
    wire.expect(b"dq ok ")
    other.expect(b"c2 ok --update %b --delete-queue-when-unused=30.0 --manual-ack" % queue)
    wire.send(b"m1 publish %b d" % event)
    assert wire.barrier() == [] and other.barrier() == []
    assert queue_row_on(wire, queue) is None
    # the consumers are gone: a settle is refused, and the un-acked m0 went with the queue
    other.send(b"a1 ack c2 m0")
    other.expect_error(b"a1", b"unknown consumer")
    wire.send(b"c3 consume --confirm %b" % queue)
    wire.expect(b"c3 ok ")
    assert wire.barrier() == []  # a new, empty queue: no old bindings, no old messages
    assert queue_row_on(wire, queue)["bindings"] == 0
    other.close()


def test_delete_queue_when_unused_immediately_and_after_seconds(wire, broker):
    now, later = unique("q"), unique("q")
    other = broker.wire()
    other.send(b"c1 consume %b e --delete-queue-when-unused" % now)
    other.send(b"c2 consume %b e --delete-queue-when-unused=0.3" % later)
    other.barrier()
    assert queue_row_on(wire, now) is not None
    assert queue_row_on(wire, later) is not None
    other.close()
    wait_for(lambda: queue_row_on(wire, now) is None, "immediate delete")
    wait_for(lambda: queue_row_on(wire, later) is None, "delayed delete")


def test_delete_queue_when_unused_keeps_queue_if_consumer_returns_in_time(broker, wire):
    queue = unique("q")
    first = broker.wire()
    first.send(b"c1 consume %b e --delete-queue-when-unused=1.0" % queue)
    first.barrier()
    first.close()
    wire.send(b"c2 consume --confirm %b --delete-queue-when-unused=1.0" % queue)
    wire.expect(b"c2 ok ")
    # a later queue that dies after the same wait proves the timer of the first one has run
    marker = unique("q")
    probe = broker.wire()
    probe.send(b"c3 consume %b e --delete-queue-when-unused=1.0" % marker)
    probe.barrier()
    probe.close()
    wait_for(lambda: queue_row_on(wire, marker) is None, "marker delete")
    assert queue_row_on(wire, queue) is not None


def test_ping_echoes_data(wire):
    wire.send(b"pg1 ping service1 with spaces", b"pg2 ping")
    wire.expect(b"pg1 ok service1 with spaces")
    wire.expect(b"pg2 ok ")


def test_one_publishers_messages_arrive_in_order(broker):
    consumer, publisher = broker.wire(), broker.wire()
    queue, event = unique("q"), unique("e")
    consumer.send(b"c1 consume %b %b" % (queue, event))
    consumer.barrier()
    publisher.send(*(b"m%d publish %b %d" % (i, event, i) for i in range(2000)))
    for i in range(2000):
        consumer.expect(b"c1 ok m%d event=%b %d" % (i, event, i))


def test_ten_thousand_pipelined_messages_are_delivered_exactly_once(broker):
    consumers = [broker.wire() for _ in range(3)]
    publisher = broker.wire()
    queue, event = unique("q"), unique("e")
    for n, conn in enumerate(consumers):
        conn.send(b"c%d consume %b %b --manual-ack" % (n, queue, event))
        conn.barrier()
    publisher.send_raw(b"".join(b"m%d publish %b payload-%d\n" % (i, event, i) for i in range(10_000)))
    seen: list[bytes] = []
    deadline = time.monotonic() + 30
    while len(seen) < 10_000 and time.monotonic() < deadline:
        for n, conn in enumerate(consumers):
            for line in conn.barrier():
                cid, ok, msg_id, _ = line.split(b" ", 3)
                assert (cid, ok) == (b"c%d" % n, b"ok")
                seen.append(msg_id)
                conn.send(b"a ack c%d %b" % (n, msg_id))
    assert len(seen) == 10_000
    assert set(seen) == {b"m%d" % i for i in range(10_000)}
    assert queue_row_on(publisher, queue)["depth"] == 0


def test_consume_with_add_gets_its_own_update_without_confirm_too(broker):
    first, second = broker.wire(), broker.wire()
    queue, (e1, e2) = unique("q"), sorted((unique("e"), unique("e")))  # --update lists events sorted
    first.send(b"c1 consume %b %b" % (queue, e1))
    assert first.barrier() == []
    second.send(b"c2 consume %b --add %b --manual-ack" % (queue, e2))
    assert second.barrier() == [b"c2 ok --update %b %b %b --manual-ack" % (queue, e1, e2)]
    assert first.barrier() == [b"c1 ok --update %b %b %b" % (queue, e1, e2)]
    first.close()
    second.close()


def test_consume_that_only_changes_the_delete_setting_updates_the_others(broker):
    first, second = broker.wire(), broker.wire()
    queue, event = unique("q"), unique("e")
    first.send(b"c1 consume --confirm %b %b" % (queue, event))
    first.expect(b"c1 ok ")
    second.send(b"c2 consume --confirm %b %b --delete-queue-when-unused=2" % (queue, event))
    second.expect(b"c2 ok ")
    assert first.barrier() == [b"c1 ok --update %b %b --delete-queue-when-unused=2.0" % (queue, event)]
    first.close()
    second.close()


def test_delete_when_unused_timer_arms_again_after_a_consumer_came_back(broker, wire):
    queue, event = unique("q"), unique("e")
    wire.send(b"c1 consume --confirm %b %b --delete-queue-when-unused=0.5" % (queue, event))
    wire.expect(b"c1 ok ")
    wire.send(b"d1 delete_consumer --confirm c1")  # armed
    wire.expect(b"d1 ok ")
    wire.send(b"c2 consume --confirm %b %b --delete-queue-when-unused=0.5" % (queue, event))  # cancelled
    wire.expect(b"c2 ok ")
    wire.send(b"d2 delete_consumer --confirm c2")  # armed again
    wire.expect(b"d2 ok ")
    wait_for(lambda: queue_row_on(wire, queue) is None,
             "the re-armed delete")
    publisher = broker.wire()
    publisher.send(b"p3 publish --confirm %b 3" % event)
    publisher.expect(b"p3 ok ")
    wire.send(b"c3 consume --confirm %b %b --delete-queue-when-unused=0.5" % (queue, event))
    wire.expect(b"c3 ok ")
    assert wire.barrier() == []  # p3 was published while no queue was bound: it must not appear
    publisher.close()


def test_error_ids_are_24_characters_unique_and_in_time_order(wire):
    wire.send(*(b"x%d blabla" % i for i in range(500)))
    ids = []
    for i in range(500):
        line = wire.expect_error(b"x%d" % i, b'unknown action "blabla"')
        ids.append(line.split(b" ")[2])
    assert all(len(error_id) == 24 and error_id.isalnum() for error_id in ids), ids[:3]
    assert len(set(ids)) == 500
    assert sorted(ids) == ids


def test_consume_seq_shows_each_copys_sequence_number_after_event_and_retry(broker):
    conn, publisher = broker.wire(), broker.wire()
    queue, event = unique("q"), unique("e")
    publisher.send(b"rb rebind --confirm %b %b" % (queue, event))
    publisher.expect(b"rb ok ")
    publisher.send(b"m0 publish %b waited" % event)
    assert publisher.barrier() == []
    conn.send(b"c1 consume --confirm %b --manual-ack --seq" % queue)
    conn.expect(b"c1 ok ")
    conn.expect(b"c1 ok m0 event=%b,seq=0 waited" % event)
    publisher.send(b"m1 publish %b direct" % event, b"m1 publish %b same-id" % event)
    conn.expect(b"c1 ok m1 event=%b,seq=1 direct" % event)
    conn.expect(b"c1 ok m1 event=%b,seq=2 same-id" % event)
    conn.send(b"r reject c1 m1")  # the oldest m1 comes back with its own seq, retry before seq
    conn.expect(b"c1 ok m1 event=%b,retry=1,seq=1 direct" % event)
    conn.send(b"c2 consume %b --add x.%b" % (queue, event))
    assert conn.barrier() == [b"c1 ok --update %b %b x.%b --manual-ack --seq" % (queue, event, event),
                              b"c2 ok --update %b %b x.%b" % (queue, event, event)]
    conn.close()
    publisher.close()

"""A queue's storage with no broker: packed runs store the header their tails share once, and give back every tail
as it was published, to a delivery, a fetch, a snapshot and a restore."""

import pytest

from mqks.server.core import restore
from mqks.server.core.messages import PACK_MIN_DEPTH, PACK_TAILS, MessageStore, Packed, pack, unpack
from mqks.server.core.snapshot import queue_snapshot_lines
from mqks.server.core.state import Broker, SeqConsumer
from mqks.server.journal import records
from mqks.server.journal.recovery import recover
from mqks.server.wire.outbox import Outbox
from mqks.server.wire.protocol import delivery_tail, msg_id_of, with_field

pytestmark = [pytest.mark.timeout(10), pytest.mark.core]

BENCH_DATA = b"T%019d" % 0 + b"." * 75 + b"|EOM|"  # bench/loadgen.py's 100-byte payload


def bench_tails(count: int, first: int = 0) -> list[bytes]:
    return [delivery_tail(b"m%d" % (100000 + i), b"bench.w4", BENCH_DATA) for i in range(first, first + count)]


def mixed_tails(count: int) -> list[bytes]:
    """Two events in turn, and data that holds what a packed run stands for or cuts at."""
    datas = [b"", b" event=e1 ", b"x event=e1 y", b" ok  ok ", b"\xc3\xa9t\xc3\xa9 \xe2\x9c\x93", b"e1", b"a  b"]
    return [delivery_tail(b"m%d" % i, b"e1" if i % 3 else b"e2,reply=t%d" % i, datas[i % len(datas)])
            for i in range(count)]


def test_a_deep_queue_keeps_of_each_message_its_id_its_data_and_two_bytes():
    # issue 59: a run held every tail whole, ` ok ` and ` event=bench.w4 ` repeated (128 bytes a message against
    # Redis Streams' 118.5); the header goes once per run now
    store = MessageStore(b"q")
    for tail in bench_tails(PACK_MIN_DEPTH + 3 * PACK_TAILS):
        store.append(tail, msg_id_of(tail))
    runs = [item for item in store.messages if type(item) is Packed]
    assert len(runs) >= 3
    per_message = len(b"m100000") + len(BENCH_DATA) + 2  # a mark between them, a newline after
    assert all(len(run) <= PACK_TAILS * per_message + len(b"bench.w4") for run in runs)


@pytest.mark.parametrize("tails", [
    bench_tails(PACK_TAILS),
    bench_tails(1),
    mixed_tails(PACK_TAILS),
    [delivery_tail(b"m1", b"e", b"")],
    [delivery_tail(b"m1", b"e", b"\xff raw"), delivery_tail(b"m2", b"e", b"d")],  # no line from a client holds 0xff
], ids=["bench", "one", "mixed", "empty-data", "0xff"])
def test_a_packed_run_gives_back_its_tails_as_they_were(tails):
    assert unpack(pack(tails, [msg_id_of(tail) for tail in tails])) == tails


def test_a_store_of_mixed_runs_hands_out_every_tail_in_order_by_pop_and_by_take_tails():
    tails = mixed_tails(PACK_MIN_DEPTH + 4 * PACK_TAILS + 5)
    store = MessageStore(b"q")
    for tail in tails:
        store.append(tail, msg_id_of(tail))
    assert any(type(item) is Packed for item in store.messages)
    popped = [store.pop() for _ in range(PACK_TAILS + 1)]
    assert popped == list(enumerate(tails[: PACK_TAILS + 1]))
    first, taken, size = store.take_tails(len(tails), 1 << 30, True)
    assert (first, taken, size) == (PACK_TAILS + 1, tails[PACK_TAILS + 1 :], sum(map(len, tails[PACK_TAILS + 1 :])))
    assert store.depth() == 0


def drain(broker: Broker, name: bytes) -> list[bytes]:
    queue = broker.queues[name]
    return [queue.pop()[1] for _ in range(queue.depth())]


def test_a_snapshot_of_packed_runs_writes_each_tail_whole_and_a_restore_packs_them_again():
    broker = Broker()
    queue = broker.queue(b"q")
    broker.rebind(queue, replace=[b"e1", b"e2"])
    tails = mixed_tails(PACK_MIN_DEPTH + 2 * PACK_TAILS + 9)
    for tail in tails:
        queue.put(tail, msg_id_of(tail))
    assert any(type(item) is Packed for item in queue.messages)
    lines = list(queue_snapshot_lines(queue))
    # the records hold the tails as published, as every earlier version wrote them: old data dirs read the same
    assert [records.decode_live(line)[4] for line in lines if line[:1] == records.LIVE] == tails
    again = Broker()
    assert restore.rebuild(recover(lines).queues, lambda name: again) == (1, len(tails))
    assert any(type(item) is Packed for item in again.queues[b"q"].messages)
    assert drain(again, b"q") == tails


def test_publish_records_of_an_earlier_version_restore_into_packed_runs_that_deliver_them_whole():
    tails = bench_tails(PACK_MIN_DEPTH + PACK_TAILS + 1)
    lines = [records.queue(b"q", None, [b"bench.w4"], None, None)]
    lines += [records.published_one(b"q", seq, False, tail) for seq, tail in enumerate(tails)]
    broker = Broker()
    restore.rebuild(recover(lines).queues, lambda name: broker)
    assert any(type(item) is Packed for item in broker.queues[b"q"].messages)
    assert drain(broker, b"q") == tails


def delivered(outbox: Outbox) -> list[bytes]:
    lines = b"".join(outbox.pieces()).split(b"\n")[:-1]
    outbox.discard()
    outbox.out_bytes = 0
    return lines


@pytest.mark.parametrize("prefetch", [1000, PACK_MIN_DEPTH + PACK_TAILS + 3, PACK_MIN_DEPTH + 2 * PACK_TAILS, 0])
def test_a_deep_queue_drains_in_order_with_every_seq_through_its_runs_and_newest_tails(prefetch):
    # a consumer that stops inside a run, or as the queue's items end before its newest tails: a publish then
    # still goes behind every waiting message, and each copy keeps its seq
    broker = Broker()
    queue = broker.queue(b"q")
    broker.rebind(queue, replace=[b"bench.w4"])
    tails = bench_tails(PACK_MIN_DEPTH + 2 * PACK_TAILS + 7)
    for tail in tails:
        broker.publish(msg_id_of(tail), b"bench.w4", tail)
    assert queue.newest and any(type(item) is Packed for item in queue.messages)
    consumer = SeqConsumer(b"c1", queue, Outbox(pending=[]), manual_ack=True, prefetch=prefetch)
    broker.consume(consumer, [b"bench.w4"], None)
    broker.pump(queue)
    got = delivered(consumer.outbox)
    late = delivery_tail(b"late", b"bench.w4", b"x")
    broker.publish(b"late", b"bench.w4", late)
    while len(got) < len(tails) + 1:
        broker.ack_all(consumer)
        got += delivered(consumer.outbox)
    assert got == [b"c1" + with_field(tail, b",seq=%d" % seq) for seq, tail in enumerate([*tails, late])]
    assert queue.depth() == 0 and not queue.newest

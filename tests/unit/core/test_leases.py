"""`fetch --runs` in process: what a lease takes in bulk (stored runs whole, tails between them), and that what it
holds that way comes back, is acked and is snapshotted as every message one by one would be."""

import pytest

from mqks.server.core.leases import Leases
from mqks.server.core.messages import PACK_MIN_DEPTH, PACK_TAILS, Message
from mqks.server.core.state import Broker

pytestmark = [pytest.mark.timeout(10), pytest.mark.core]

DEPTH = PACK_MIN_DEPTH + 2 * PACK_TAILS + 100  # tails, two stored runs, tails


@pytest.fixture
def broker():
    broker = Broker()
    broker.rebind(broker.queue(b"q"), replace=[b"e"])
    for i in range(DEPTH):
        broker.publish(b"u%d" % i, b"e", b" ok u%d event=e d%d" % (i, i))
    return broker


def blocks(lines: list[bytes]) -> list[tuple[bytes, int, int]]:
    """(kind, first seq, count) of each block of an answer, its byte count checked against its lines."""
    answer = b"".join(lines)
    found = []
    at = 0
    while at < len(answer):
        newline = answer.index(b"\n", at)
        rid, ok, kind, first, count, size, *_ = answer[at:newline].split(b" ")
        assert (rid, ok) == (b"r", b"ok") and kind in (b"--tails", b"--packed")
        at = newline + 1 + int(size)
        assert answer[at - 1 : at] == b"\n"
        found.append((kind, int(first), int(count)))
    return found


def test_a_stored_run_that_fits_goes_whole_and_one_that_does_not_is_split(broker):
    leases = Leases(broker)
    ask = PACK_MIN_DEPTH + PACK_TAILS + 10
    lines, count = leases.fetch(b"q", b"L", ask, 1 << 30, 60, False, b"r", runs=True)
    assert count == ask
    assert blocks(lines) == [(b"--tails", 0, PACK_MIN_DEPTH), (b"--packed", PACK_MIN_DEPTH, PACK_TAILS),
                             (b"--tails", PACK_MIN_DEPTH + PACK_TAILS, 10)]
    assert broker.queues[b"q"].depth() == DEPTH - ask
    # the split run's rest leads the queue: the next fetch goes on from the next seq
    lines, count = leases.fetch(b"q", b"L2", DEPTH, 1 << 30, 60, False, b"r", runs=True)
    assert blocks(lines) == [(b"--tails", ask, DEPTH - ask)]
    assert leases.count_by_queue() == {b"q": DEPTH} and leases.stats()["messages_leased"] == DEPTH


def test_what_a_lease_took_in_runs_comes_back_in_seq_order_with_its_retry_raised(broker):
    leases = Leases(broker)
    leases.fetch(b"q", b"L", DEPTH, 1 << 30, 60, False, b"r", runs=True)
    assert leases.settle(b"L", ack=False) == DEPTH
    queue = broker.queues[b"q"]
    back = [queue.pop() for _ in range(DEPTH)]
    assert [seq for seq, _ in back] == list(range(DEPTH))
    assert all(type(item) is Message and item.retry == 1 and item.tail == b" ok u%d event=e d%d" % (seq, seq)
               for seq, item in back)


def test_a_snapshot_and_an_ack_cover_every_message_a_lease_took_in_runs(broker):
    leases = Leases(broker)
    written: list[bytes] = []
    broker.record = written.append
    leases.fetch(b"q", b"L", DEPTH, 1 << 30, 60, False, b"r", runs=True)
    assert written == [b"D q " + b" ".join(b"%d" % seq for seq in range(DEPTH))]
    held = leases.held_by_queue()[b"q"]
    assert [(seq, item) for seq, item in held] == [(i, b" ok u%d event=e d%d" % (i, i)) for i in range(DEPTH)]
    assert leases.settle(b"L", ack=True) == DEPTH
    assert written[1] == b"A q " + b" ".join(b"%d" % seq for seq in range(DEPTH))
    assert leases.count_by_queue() == {} and broker.queues[b"q"].depth() == 0

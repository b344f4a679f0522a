"""Requeued messages and the publishes after them: every confirmed message stays (issue 31.1).

A queue packs runs of tails once it is deep; requeued messages come back in front as records.
Whatever brings them back (a disconnect, `reject --all`, an ack timeout, a client that
reconnects), the publishes that follow must cross every packing boundary without losing one,
in memory, with a log, and with two workers. After each scenario the queue's depth is checked
against what a consumer actually drains.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator

import pytest
from conftest import BrokerProcess, Wire
from helpers import unique_bytes as unique
from waiting import wait_for

from mqks.client import Client
from mqks.server.core.messages import PACK_MIN_DEPTH, PACK_TAILS

pytestmark = [pytest.mark.timeout(120), pytest.mark.core]

HELD = 4000  # under PACK_MIN_DEPTH: delivered, never packed, then requeued
BIG = b"." * 4096  # 4,000 of these fill any socket buffer: a consumer that stops reading is paused
LATER = PACK_MIN_DEPTH + 2 * PACK_TAILS + 3  # published after: past several packs wherever they fall


@pytest.fixture(scope="module", params=["memory", "data-dir", "workers2"])
def server(request) -> Iterator[BrokerProcess]:
    args = {"memory": [], "workers2": ["--workers", "2"]}.get(request.param)
    with tempfile.TemporaryDirectory() as data_dir:
        server = BrokerProcess("--eval", *(args if args is not None else ["--data-dir", data_dir]))
        yield server
        server.kill()


def publish_confirmed(wire: Wire, event: bytes, prefix: bytes, count: int, data: bytes = b"") -> None:
    """`count` confirmed publishes in one write; every one answered ok."""
    wire.send(*(b"%b%d publish --confirm %b %b%d%b" % (prefix, i, event, prefix, i, data) for i in range(count)))
    answers = [wire.recv_line() for _ in range(count)]
    assert answers == [b"%b%d ok " % (prefix, i) for i in range(count)], [
        a for a in answers if b" ok " not in a + b" "][:3]


def queue_figures(wire: Wire, queue: bytes) -> dict:
    wire.send(b"qs queues " + queue)
    line = wire.recv_line()
    wire.expect(b"qs ok --end")
    assert line.startswith(b"qs ok {"), line
    return json.loads(line[len(b"qs ok "):])


def assert_depth_is_what_drains(server: BrokerProcess, queue: bytes, expected: list[bytes],
                                ordered: bool = True) -> None:
    """The queue shows `len(expected)` waiting, and a consumer drains exactly those msg ids (in order,
    unless messages came back at several moments: each requeue goes to the front)."""
    wire = server.wire()
    try:
        figures = wait_for(lambda: (f := queue_figures(wire, queue))["unacked"] == 0 and f, "nothing unacked")
        assert figures["depth"] == len(expected), f"depth {figures['depth']}, expected {len(expected)}"
        wire.send(b"drain consume %b" % queue)
        got = [wire.recv_line().split(b" ")[2] for _ in range(len(expected))]
        assert wire.barrier() == [], "the queue held more than its depth"
        if ordered:
            assert got == expected
        else:
            assert sorted(got) == sorted(expected), "lost or repeated messages"
        assert queue_figures(wire, queue)["depth"] == 0
    finally:
        wire.close()


def hold_then_requeue(server: BrokerProcess, queue: bytes, event: bytes, how: str) -> Wire | None:
    """Deliver HELD messages to a manual-ack consumer and bring them back to wait in the queue by `how`.

    Records wait in the queue only while no consumer can take them: the consumer is gone, or its
    output is paused because it stopped reading (the ack-timeout case, with payloads big enough
    to fill the socket buffers).
    """
    publisher = server.wire()
    publisher.send(b"r rebind --confirm %b %b" % (queue, event))
    publisher.expect(b"r ok ")
    publish_confirmed(publisher, event, b"m", HELD, BIG if how == "ack timeout" else b"")
    if how == "client reconnects":
        hold_with_the_client(server, queue, event)
        wait_for(lambda: queue_figures(publisher, queue)["depth"] == HELD, "all held messages back in the queue")
        publisher.close()
        return None
    consumer = server.wire()
    timeout = b" --ack-timeout=1" if how == "ack timeout" else b""
    consumer.send(b"c consume --confirm %b --manual-ack%b" % (queue, timeout))
    consumer.expect(b"c ok ")
    for _ in range(HELD):
        assert consumer.recv_line().startswith(b"c ok m")
    if how == "disconnect":
        consumer.close()
    elif how == "reject --all":
        consumer.send(b"rj reject --confirm c --all --delay=0.5", b"d delete_consumer --confirm c")
        consumer.expect(b"rj ok ")
        consumer.expect(b"d ok ")
    else:  # the consumer stops reading: once its output is paused, the timed-out messages wait
        wait_for(lambda: queue_figures(publisher, queue)["depth"] > 0, "timed-out messages waiting", timeout=20)
        publisher.close()
        return consumer  # closed once the new publishes are in, which requeues what it still holds
    wait_for(lambda: queue_figures(publisher, queue)["depth"] == HELD, "all held messages back in the queue",
             timeout=20)
    consumer.close()
    publisher.close()
    return None


def hold_with_the_client(server: BrokerProcess, queue: bytes, event: bytes) -> None:
    """The Python client holds HELD messages, loses its connection, reconnects and replays its consume;
    its replayed consumer is then removed, so the requeued messages wait."""
    got: list[str] = []
    client = Client(server.host, server.port, reconnect_max_seconds=0.2, timeout_seconds=10)
    client.connect()
    try:
        consumer_id = client.consume(queue.decode(), None, lambda message: got.append(message.id), manual_ack=True,
                                     prefetch=HELD)
        wait_for(lambda: len(got) >= HELD, "the client to hold every message", 30)
        # drop every link the client has (with workers the consume went to its owner's direct link)
        links = [session.link for session in client._sessions() if session.link is not None]
        for link in links:
            if link.conn is not None:
                link.lose(link.conn, "dropped by the test")
        wait_for(lambda: len(got) >= 2 * HELD, "every message again after the reconnect", 30)
        assert sum(link.reconnects for link in links) >= 1
        client.delete_consumer(consumer_id)
    finally:
        client.close()


@pytest.mark.parametrize("how", ["disconnect", "reject --all", "ack timeout", "client reconnects"])
def test_requeued_messages_then_confirmed_publishes_all_stay(server: BrokerProcess, how: str) -> None:
    queue, event = unique("q"), unique("e")
    paused_consumer = hold_then_requeue(server, queue, event, how)
    publisher = server.wire()
    publish_confirmed(publisher, event, b"n", LATER)
    publisher.close()
    if paused_consumer is not None:
        paused_consumer.close()
    assert_depth_is_what_drains(server, queue, [b"m%d" % i for i in range(HELD)] + [b"n%d" % i for i in range(LATER)],
                                ordered=how != "ack timeout")

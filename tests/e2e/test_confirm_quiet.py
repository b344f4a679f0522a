"""`publish --confirm-quiet` and `sync` over real TCP: a quiet publish is answered only when refused, and a sync
answers once every earlier one is stored (in memory, and with --data-dir across a kill -9); a broker of several
worker processes refuses quiet publishes and says so in `hello`."""

from __future__ import annotations

import json

import pytest
from helpers import unique

pytestmark = pytest.mark.timeout(120)


def b(text: str) -> bytes:
    return text.encode()


def drain(wire, queue: bytes) -> list[bytes]:
    """The msg ids waiting in `queue`, taken by an auto-ack consumer (a ping after them proves there are no more)."""
    wire.send(b"c consume --confirm %b" % queue)
    wire.expect(b"c ok ")
    return [line.split(b" ")[2] for line in wire.barrier()]


@pytest.mark.parametrize("durable", [False, True], ids=["memory", "data-dir"])
def test_a_refused_quiet_publish_is_answered_and_the_sync_after_it_still_comes(make_broker, tmp_path, durable):
    server = make_broker(*(["--data-dir", str(tmp_path)] if durable else []))
    queue, event = b(unique("q")), b(unique("e"))
    wire = server.wire()
    wire.send(b"r rebind --confirm %b %b --max-length=2" % (queue, event))
    wire.expect(b"r ok ")
    wire.send(*(b"m%d publish --confirm-quiet %b body %d" % (i, event, i) for i in range(1, 4)), b"s sync")
    wire.expect_error(b"m3", b"is full (--max-length=2)")  # the only answer before the sync's: m1, m2 are quiet
    wire.expect(b"s ok ")
    assert drain(server.wire(), queue) == [b"m1", b"m2"]


def test_a_quiet_publish_takes_no_other_flag_and_sync_takes_no_argument(make_broker):
    wire = make_broker().wire()
    wire.send(b"m1 publish --confirm-quiet --mandatory e1 x", b"m2 publish --confirm --confirm-quiet e1 x",
              b"s1 sync now")
    wire.expect_error(b"m1", b"publish: event expected, got '--mandatory'")
    wire.expect_error(b"m2", b"give one of --confirm and --confirm-quiet")
    wire.expect_error(b"s1", b"sync: unexpected 'now'")


def test_the_sync_answers_only_once_every_earlier_quiet_publish_survives_a_kill_9(make_broker, tmp_path):
    """A sync answered before the log had the publishes ahead of it would lose some of them to the kill."""
    server = make_broker("--data-dir", str(tmp_path))
    queue, event = b(unique("q")), b(unique("e"))
    wire = server.wire()
    wire.send(b"r rebind --confirm %b %b" % (queue, event))
    wire.expect(b"r ok ")
    count = 50_000
    wire.send_raw(b"".join(b"m%d publish --confirm-quiet %b %b\n" % (i, event, b"x" * 100) for i in range(count))
                  + b"s sync\n")
    wire.expect(b"s ok ", timeout=60)  # nothing before it: no publish was refused
    server.kill()
    server.restart()
    got = drain(server.wire(), queue)
    assert len(got) == count and got[0] == b"m0" and got[-1] == b"m%d" % (count - 1)


def test_several_workers_refuse_quiet_publishes_and_hello_does_not_offer_them(make_broker):
    one, two = make_broker(), make_broker("--workers", "2")
    for server, offered in ((one, True), (two, False)):
        wire = server.wire()
        wire.send(b"h hello")
        answer = wire.recv_line()
        assert answer.startswith(b"h ok ")
        assert ("confirm_quiet" in json.loads(answer[5:])["extensions"]) is offered
    wire = two.wire()
    wire.send(b"m1 publish --confirm-quiet e1 x", b"s sync")
    wire.expect_error(b"m1", b"one worker process only, not --workers N or a cluster")
    wire.expect(b"s ok ")

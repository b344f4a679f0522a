"""`publish --confirm-quiet` and `sync` over real TCP: a quiet publish is answered only when refused, and a sync
answers once every earlier one is stored (in memory, and with --data-dir across a kill -9), on one worker process and
on two, whose copies for the other worker's queues are confirmed quietly there."""

from __future__ import annotations

import json
import resource
import socket

import pytest
from conftest import BrokerProcess, Wire
from helpers import queue_owned_by, unique

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


def direct(server: BrokerProcess, worker: int) -> Wire:
    """A connection to worker `worker` of `server` alone (its own port, from hello)."""
    wire = server.wire()
    wire.send(b"h hello")
    entry = json.loads(wire.recv_line()[5:])["direct"][worker]
    wire.close()
    return Wire(entry["host"], entry["port"])


def offers_quiet(wire: Wire) -> bool:
    wire.send(b"h hello")
    answer = wire.recv_line()
    assert answer.startswith(b"h ok ")
    return "confirm_quiet" in json.loads(answer[5:])["extensions"]


@pytest.mark.parametrize("durable", [False, True], ids=["memory", "data-dir"])
@pytest.mark.parametrize("shared", [False, True], ids=["other-worker", "both-workers"])
def test_two_workers_answer_a_refusal_on_the_other_worker_before_the_sync(make_broker, tmp_path, durable, shared):
    """Worker 0's client publishes quietly to a queue of worker 1 (and, `shared`, to one of its own as well): worker
    1's refusal reaches the client ahead of the sync's ok."""
    server = make_broker("--workers", "2", *(["--data-dir", str(tmp_path)] if durable else []))
    wire = direct(server, 0)
    assert offers_quiet(wire)
    event = b(unique("e"))
    far = b(queue_owned_by(1, 2))
    wire.send(b"r rebind --confirm %b %b --max-length=2" % (far, event))
    wire.expect(b"r ok ")
    if shared:
        near = b(queue_owned_by(0, 2))
        wire.send(b"n rebind --confirm %b %b" % (near, event))
        wire.expect(b"n ok ")
    wire.send(*(b"m%d publish --confirm-quiet %b body %d" % (i, event, i) for i in range(1, 4)), b"s sync")
    wire.expect_error(b"m3", b"is full (--max-length=2)")  # the only answer before the sync's
    wire.expect(b"s ok ")
    assert drain(server.wire(), far) == [b"m1", b"m2"]
    if shared:
        assert drain(server.wire(), near) == [b"m1", b"m2", b"m3"]


def test_two_workers_answer_a_half_closed_client_the_other_workers_refusal(make_broker, tmp_path):
    """Quiet publishes to worker 1's queue from worker 0's client, then its writing side shut (`printf | nc -q`), no
    sync: the refusal still reaches it before the close."""
    server = make_broker("--workers", "2", "--data-dir", str(tmp_path))
    wire = direct(server, 0)
    queue, event = b(queue_owned_by(1, 2)), b(unique("e"))
    wire.send(b"r rebind --confirm %b %b --max-length=2" % (queue, event))
    wire.expect(b"r ok ")
    wire.send(*(b"m%d publish --confirm-quiet %b body %d" % (i, event, i) for i in range(1, 4)))
    wire.sock.shutdown(socket.SHUT_WR)
    wire.expect_error(b"m3", b"is full (--max-length=2)")
    assert wire.closed_by_server()  # once it is answered


def test_two_workers_answer_the_other_workers_failed_commit_before_the_sync(make_broker, tmp_path):
    """Worker 1's log fails the commit of a quiet publish from worker 0's client (its disk "full"): the error comes
    first, then the sync's ok. A sync that did not wait for worker 1's log would answer ahead of it."""
    server = make_broker("--workers", "2", "--data-dir", str(tmp_path))
    wire = direct(server, 0)
    queue, event = b(queue_owned_by(1, 2)), b(unique("e"))
    wire.send(b"r rebind --confirm %b %b" % (queue, event), b"m0 publish --confirm %b before" % event)
    wire.expect(b"r ok ")
    wire.expect(b"m0 ok ")
    wire.send(b"w stats --worker=1")
    answer = wire.recv_line()
    assert answer.startswith(b"w ok "), answer
    pid = json.loads(answer[5:])["pid"]
    used = sum(path.stat().st_size for path in (tmp_path / "worker-1").glob("*.log"))
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (used + 100, hard))  # worker 1's disk is "full"
    try:
        wire.send(b"m1 publish --confirm-quiet %b %b" % (event, b"z" * 500), b"s sync")
        wire.expect_error(b"m1", b"disk full")
        wire.expect(b"s ok ")
    finally:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard, hard))


def test_two_workers_sync_only_once_every_quiet_publish_on_either_survives_a_kill_9(make_broker, tmp_path):
    """50,000 quiet publishes from worker 0's client over a queue of each worker, one sync, kill -9 of the whole
    broker: a sync answered before worker 1's log had its part would lose some of them."""
    server = make_broker("--workers", "2", "--data-dir", str(tmp_path))
    wire = direct(server, 0)
    events = [b(unique("e")), b(unique("e"))]
    queues = [b(queue_owned_by(worker, 2)) for worker in (0, 1)]
    for n, (queue, event) in enumerate(zip(queues, events, strict=True)):
        wire.send(b"r%d rebind --confirm %b %b" % (n, queue, event))
        wire.expect(b"r%d ok " % n)
    count = 50_000
    wire.send_raw(b"".join(b"m%d publish --confirm-quiet %b %b\n" % (i, events[i % 2], b"x" * 100)
                           for i in range(count)) + b"s sync\n")
    wire.expect(b"s ok ", timeout=60)  # nothing before it: no publish was refused
    server.kill()
    server.restart()
    for n, queue in enumerate(queues):
        got = drain(server.wire(), queue)
        assert got == [b"m%d" % i for i in range(n, count, 2)], (queue, len(got))


def test_two_workers_offer_quiet_publishes_in_hello_and_take_one_no_queue_is_bound_to(make_broker):
    server = make_broker("--workers", "2")
    for worker in (0, 1):
        wire = direct(server, worker)
        assert offers_quiet(wire)
        wire.send(b"m1 publish --confirm-quiet %b x" % b(unique("e")), b"s sync")
        assert wire.recv_line() == b"s ok "  # stored nowhere, refused by nobody: as one worker's

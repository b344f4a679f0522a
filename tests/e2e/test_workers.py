"""Worker processes (`mqksd --workers N`): lines that cross workers on purpose, and the supervisor.

Each worker's own port (from `hello`'s "direct") reaches that worker alone, so a test can put a
client on the owner of a queue or on the other worker. Placement is server/dispatch/slots.py's.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading

import pytest
from conftest import BrokerProcess, Wire, free_port
from helpers import (
    eval_on,
    http_get,
    queue_owned_by,
    queue_row,
    queue_row_on,
    read_a_while,
    rss_bytes,
    unique_bytes,
)
from waiting import wait_for

from mqks.server.core.routing import MAX_CACHED_EVENTS
from mqks.server.dispatch.slots import owner_of, slot_ranges

WORKERS = 2


def hello(wire: Wire) -> dict:
    wire.send(b"h hello")
    line = wire.recv_line()
    assert line.startswith(b"h ok "), line
    return json.loads(line[5:])


def direct(broker: BrokerProcess, worker: int) -> Wire:
    """A connection to worker `worker` alone."""
    wire = broker.wire()
    info = hello(wire)
    wire.close()
    entry = info["direct"][worker]
    assert entry["worker"] == worker
    found = Wire(entry["host"], entry["port"])
    assert hello(found)["worker"] == worker
    return found


def queue_on(worker: int, prefix: str = "q", workers: int = WORKERS) -> bytes:
    """A fresh queue name that worker `worker` owns."""
    return queue_owned_by(worker, workers, prefix).encode()


def stats(wire: Wire, worker: int | None = None) -> dict:
    wire.send(b"s stats" + (b" --worker=%d" % worker if worker is not None else b""))
    line = wire.recv_line()
    assert line.startswith(b"s ok "), line
    return json.loads(line[5:])


@pytest.fixture(scope="module")
def two() -> BrokerProcess:
    server = BrokerProcess("--eval", "--workers", str(WORKERS))
    yield server
    server.kill()


def test_hello_tells_the_slot_map_and_each_workers_own_port(two):
    wire = two.wire()
    info = hello(wire)
    assert info["workers"] == WORKERS and info["slots"] == 16384
    assert info["slot_map"] == slot_ranges(WORKERS)
    assert [entry["worker"] for entry in info["direct"]] == list(range(WORKERS))
    for worker in range(WORKERS):
        own = direct(two, worker)
        assert stats(own, worker)["worker"] == worker
        own.close()
    wire.close()


def test_a_publish_on_one_worker_reaches_queues_of_both(two):
    event = unique_bytes("e")
    queues = [queue_on(0), queue_on(1)]
    consumers = [direct(two, worker) for worker in range(WORKERS)]
    for worker, (consumer, queue) in enumerate(zip(consumers, queues, strict=True)):
        consumer.send(b"c%d consume --confirm %b %b" % (worker, queue, event))
        consumer.expect(b"c%d ok " % worker)
    for publisher_worker in range(WORKERS):
        publisher = direct(two, publisher_worker)
        publisher.send(b"p%d publish --confirm %b from-%d" % (publisher_worker, event, publisher_worker))
        publisher.expect(b"p%d ok " % publisher_worker)
        for worker, consumer in enumerate(consumers):
            consumer.expect(b"c%d ok p%d event=%b from-%d" % (worker, publisher_worker, event, publisher_worker))
        publisher.close()
    for consumer in consumers:
        consumer.close()


@pytest.mark.parametrize("manual_ack", [False, True], ids=["auto-ack", "manual-ack"])
def test_a_consume_on_the_worker_that_does_not_own_the_queue(two, manual_ack):
    queue, event = queue_on(1), unique_bytes("e")
    consumer = direct(two, 0)  # not the owner: deliveries and acks are relayed
    flag = b" --manual-ack" if manual_ack else b""
    consumer.send(b"c consume --confirm %b %b%b" % (queue, event, flag))
    consumer.expect(b"c ok ")
    owner = direct(two, 1)
    acked_before = stats(owner, 1)["acked"]
    owner.send(*(b"m%d publish %b body-%d" % (n, event, n) for n in range(500)))
    for n in range(500):
        consumer.expect(b"c ok m%d event=%b body-%d" % (n, event, n))
    if manual_ack:
        consumer.send(b"a ack --confirm c " + b" ".join(b"m%d" % n for n in range(500)))
        consumer.expect(b"a ok ")
        assert stats(owner, 1)["acked"] - acked_before == 500  # acked on the owner
        consumer.send(b"bad ack c nope")
        consumer.expect_error(b"bad", b"no un-acked message 'nope'")
    consumer.close()
    owner.close()


def test_masks_spanning_owners(two):
    base = unique_bytes("m")
    queues = [queue_on(0), queue_on(1)]
    consumers = [direct(two, worker) for worker in (1, 0)]  # each consumes on the other worker
    for n, (consumer, queue) in enumerate(zip(consumers, queues, strict=True)):
        consumer.send(b"c consume --confirm %b %b.*.%d" % (queue, base, n))
        consumer.expect(b"c ok ")
    publisher = two.wire()
    publisher.send(b"p0 publish %b.x.0 zero" % base, b"p1 publish %b.y.1 one" % base, b"p2 publish %b.z.2 two" % base)
    publisher.barrier()
    consumers[0].expect(b"c ok p0 event=%b.x.0 zero" % base)
    consumers[1].expect(b"c ok p1 event=%b.y.1 one" % base)
    for consumer in consumers:
        assert consumer.barrier() == []  # p2 matched nobody
        consumer.close()
    publisher.close()


def test_update_reaches_consumers_on_other_workers(two):
    queue, first, second = queue_on(1), unique_bytes("e"), unique_bytes("e")
    consumers = [direct(two, worker) for worker in range(WORKERS)]
    for worker, consumer in enumerate(consumers):
        consumer.send(b"c%d consume --confirm %b %b" % (worker, queue, first))
        consumer.expect(b"c%d ok " % worker)
    changer = direct(two, 0)
    changer.send(b"r rebind --confirm %b %b" % (queue, second))
    changer.expect(b"r ok ")
    for worker, consumer in enumerate(consumers):
        consumer.expect(b"c%d ok --update %b %b" % (worker, queue, second))
        consumer.close()
    changer.close()


def test_a_disconnect_on_the_non_owner_requeues_on_the_owner(two):
    queue, event = queue_on(0), unique_bytes("e")
    holder = direct(two, 1)
    holder.send(b"c consume --confirm %b %b --manual-ack" % (queue, event))
    holder.expect(b"c ok ")
    publisher = two.wire()
    publisher.send(b"m1 publish --confirm %b precious" % event)
    publisher.expect(b"m1 ok ")
    holder.expect(b"c ok m1 event=%b precious" % event)
    holder.close()  # never acked: the owner takes it back
    taker = direct(two, 0)
    taker.send(b"c consume %b %b --manual-ack" % (queue, event))
    taker.expect(b"c ok m1 event=%b,retry=1 precious" % event)
    taker.close()
    publisher.close()


def test_delete_queue_when_unused_across_workers(two):
    queue, event = queue_on(1), unique_bytes("e")
    consumer = direct(two, 0)
    consumer.send(b"c consume --confirm %b %b --delete-queue-when-unused" % (queue, event))
    consumer.expect(b"c ok ")
    inspector = two.wire()
    assert queue_row_on(inspector, queue) is not None
    consumer.close()

    def deleted() -> bool:
        return queue_row_on(inspector, queue) is None

    wait_for(deleted, "the owner to delete the queue its last (relayed) consumer left")
    publisher = direct(two, 0)  # the replica on the other worker forgot the binding too
    publisher.send(b"p request %b anyone" % event)
    publisher.expect_error(b"p", b"no queue is bound")
    publisher.close()
    inspector.close()


def test_stats_sum_every_worker_and_queues_lists_both(two):
    queues = [queue_on(0, "sq"), queue_on(1, "sq")]
    wire = two.wire()
    for n, queue in enumerate(queues):
        wire.send(b"c%d consume --confirm %b e-%b" % (n, queue, queue))
        wire.expect(b"c%d ok " % n)
    per_worker = [stats(wire, worker) for worker in range(WORKERS)]
    total = stats(wire)
    assert total["workers"] == WORKERS
    assert total["queues"] == sum(one["queues"] for one in per_worker) >= 2
    wire.send(b"l queues sq*")
    rows = []
    while (line := wire.recv_line()) != b"l ok --end":
        rows.append(json.loads(line[5:])["queue"].encode())
    assert [queue for queue in queues if queue in rows] == sorted(queues)
    wire.close()


def test_a_killed_worker_is_restarted_and_keeps_confirmed_messages(make_broker):
    data_dir = tempfile.mkdtemp(prefix="mqks-workers-")
    broker = make_broker("--workers", str(WORKERS), "--data-dir", data_dir)
    queue, event = queue_on(1, "kq"), unique_bytes("e")
    wire = broker.wire()
    wire.send(b"c consume --confirm %b %b --manual-ack" % (queue, event))
    wire.expect(b"c ok ")
    wire.send(b"d delete_consumer --confirm c")
    wire.expect(b"d ok ")
    wire.send(*(b"m%d publish --confirm %b body-%d" % (n, event, n) for n in range(100)))
    for n in range(100):
        wire.expect(b"m%d ok " % n)
    victim = stats(wire, 1)["pid"]
    wire.close()
    os.kill(victim, signal.SIGKILL)
    wait_restarted(broker, 1, victim)
    assert "worker 1" in broker.log() and "restarting it" in broker.log()
    consumer = broker.wire()
    consumer.send(b"c consume %b %b" % (queue, event))
    for n in range(100):
        consumer.expect(b"c ok m%d event=%b body-%d" % (n, event, n))
    consumer.close()


def test_a_consume_refused_while_its_owner_restarts_can_be_sent_again_with_the_same_id(make_broker):
    broker = make_broker("--workers", str(WORKERS))
    queue, event = queue_on(1, "rq"), unique_bytes("e")
    probe = direct(broker, 0)
    victim = stats(probe, 1)["pid"]
    probe.close()
    # the supervisor, stopped, cannot restart the worker: the refusals last until SIGCONT, where a restart of
    # 0.2 s could pass between two polls of a loaded machine
    broker.signal(signal.SIGSTOP)
    os.kill(victim, signal.SIGKILL)

    def refused() -> Wire | None:
        """A connection to worker 0 (not the owner) whose consume it refused with "try again"; None: not yet."""
        try:
            relay = direct(broker, 0)  # its hello goes to the public port, which the dying worker may answer
        except OSError:
            return None
        try:
            relay.send(b"c1 consume --confirm %b %b" % (queue, event))
            if b"is restarting: try again" in relay.recv_line():
                return relay
        except OSError:  # it reached the dying worker, whose link's loss closes it
            pass
        relay.close()
        return None

    try:
        relay = wait_for(refused, "worker 0 to refuse a consume for the killed worker's queue")
    finally:
        broker.signal(signal.SIGCONT)
    wait_restarted(broker, 1, victim)
    relay.send(b"c1 consume --confirm %b %b" % (queue, event))
    relay.expect(b"c1 ok ")  # before: "consumer 'c1' is already consuming on this connection"
    relay.send(b"m publish %b back" % event)
    relay.expect(b"c1 ok m event=" + event + b" back")
    relay.close()


def test_a_confirmed_rebind_refused_while_its_owner_restarts_is_sent_again_by_both_clients(make_broker):
    """A rebind refused with "try again" changed nothing: both clients send it again with a back-off, as they do a
    consume and a confirmed publish, and return once it is done (before, rebind() raised the refusal)."""
    import asyncio

    import gevent

    from mqks import aio
    from mqks.client import Client

    broker = make_broker("--workers", str(WORKERS))
    queue, aio_queue, event = queue_on(1, "rb"), queue_on(1, "ra"), unique_bytes("e")
    asker = direct(broker, 0)
    victim = stats(asker, 1)["pid"]
    asker.close()  # a connection that asked the dying worker anything is closed with it
    probe = direct(broker, 0)
    worker_0 = probe.sock.getpeername()[:2]  # the clients talk to worker 0, which relays to the queues' owner
    errors_before = stats(probe, 0)["errors"]
    client = Client(*worker_0, ping_timeout_seconds=30.0).connect()
    aio_outcome: dict[str, object] = {}

    def aio_rebind() -> None:
        async def main() -> None:
            async with aio.Client(*worker_0, ping_timeout_seconds=30.0) as aclient:
                await aclient.rebind(aio_queue.decode(), [event.decode()], timeout=60)
        try:
            asyncio.run(main())
            aio_outcome["done"] = True
        except Exception as e:  # reported by the assertion on aio_outcome
            aio_outcome["error"] = e

    broker.signal(signal.SIGSTOP)  # the stopped supervisor cannot restart the worker: the refusals last until SIGCONT
    try:
        os.kill(victim, signal.SIGKILL)
        rebinding = gevent.spawn(client.rebind, queue.decode(), [event.decode()], timeout=60)
        aio_thread = threading.Thread(target=aio_rebind, daemon=True)
        aio_thread.start()
        # both refused at least once: worker 0 counts the errors it answered
        wait_for(lambda: stats(probe, 0)["errors"] >= errors_before + 2, "worker 0 to refuse both rebinds", 30)
        assert not rebinding.ready() and not aio_outcome, (rebinding.exception, aio_outcome)
    finally:
        broker.signal(signal.SIGCONT)
    rebinding.get(timeout=60)
    aio_thread.join(60)
    assert aio_outcome == {"done": True}
    wait_restarted(broker, 1, victim)
    probe.send(b"p publish --confirm %b after" % event)
    probe.expect(b"p ok ")
    for name in (queue, aio_queue):
        probe.send(b"c%b consume %b" % (name, name))
        probe.expect(b"c%b ok p event=%b after" % (name, event))
    client.close()
    probe.close()


def wait_restarted(broker: BrokerProcess, worker: int, old_pid: int) -> None:
    """Until the supervisor has restarted `worker` (a new pid) and worker 0 has linked to it again."""

    def restarted() -> bool:
        try:
            own = direct(broker, worker)
        except (OSError, AssertionError, TimeoutError, ConnectionError):
            return False
        try:
            return stats(own, worker)["pid"] != old_pid
        finally:
            own.close()

    wait_for(restarted, f"the supervisor to restart worker {worker}", timeout=20)

    def linked_again() -> bool:  # until then, a line for its queues on another worker gets "try again"
        own = direct(broker, 0)
        try:
            return stats(own, 0)["worker_links"] == WORKERS - 1
        finally:
            own.close()

    wait_for(linked_again, f"worker 0 to link to the new worker {worker}")


def test_a_dead_letter_whose_owner_dies_on_the_way_arrives_once_it_is_back(make_broker):
    """A reject past --max-retries on worker 0 whose `.dead` queue is worker 1's; worker 1 is frozen
    with the dead letter in its socket, then killed. Before, the source had logged the message as
    gone and the dead letter was lost; now it waits, goes to the new worker 1, and is there once."""
    data_dir = tempfile.mkdtemp(prefix="mqks-dead-")
    broker = make_broker("--workers", str(WORKERS), "--data-dir", data_dir)
    event = unique_bytes("e")
    while True:
        queue = queue_on(0, "dq")
        if owner_of(queue + b".dead", WORKERS) == 1:
            break
    wire = direct(broker, 0)
    wire.send(b"c consume --confirm %b %b --manual-ack --max-retries=0" % (queue, event))
    wire.expect(b"c ok ")
    wire.send(b"p publish --confirm %b doomed" % event)
    got = sorted([wire.recv_line(), wire.recv_line()])
    assert got[0].startswith(b"c ok ") and got[0].endswith(b" event=%b doomed" % event) and got[1] == b"p ok ", got
    msg_id = got[0].split(b" ")[2]
    asker = direct(broker, 1)  # not `wire`: a client that asked the dying worker anything is closed with it
    owner = stats(asker, 1)["pid"]
    asker.close()
    os.kill(owner, signal.SIGSTOP)
    wire.send(b"r reject --confirm c %b" % msg_id)  # its `ok` waits until worker 1 has the dead letter...
    # ...which never comes: the frozen worker dies with it unread (SIGKILL ends a stopped process: a SIGCONT after it
    # found the process reaped by its supervisor already, in CI)
    os.kill(owner, signal.SIGKILL)
    wire.expect(b"r ok ")
    wire.send(b"d delete_consumer --confirm c")
    wire.expect(b"d ok ")
    wait_restarted(broker, 1, owner)
    dead = broker.wire()
    dead.send(b"x consume %b.dead --manual-ack" % queue)
    line = dead.recv_line()
    assert line.startswith(b"x ok ") and line.endswith(b" event=%b,retry=1 doomed" % event), line
    assert dead.barrier() == []  # once
    dead.send(b"a ack --confirm x --all")
    dead.expect(b"a ok ")
    dead.close()
    wire.close()
    # both logs agree after a restart: neither the queue nor its dead letters hold it
    assert broker.stop() == 0
    broker.restart()
    wire = broker.wire()
    for name in (queue, queue + b".dead"):
        wire.send(b"q queues %b" % name)
        rows = []
        while (line := wire.recv_line()) != b"q ok --end":
            rows.append(json.loads(line[5:]))
        assert [(row["depth"], row["unacked"]) for row in rows] == [(0, 0)], (name, rows)
    wire.close()


def test_a_different_number_of_workers_finds_every_queue(make_broker):
    data_dir = tempfile.mkdtemp(prefix="mqks-reshard-")
    broker = make_broker("--workers", "2", "--data-dir", data_dir)
    event = unique_bytes("e")
    queues = [unique_bytes("rq") for _ in range(8)]
    wire = broker.wire()
    for n, queue in enumerate(queues):
        wire.send(b"c%d consume --confirm %b %b" % (n, queue, event), b"x%d delete_consumer --confirm c%d" % (n, n))
        wire.expect(b"c%d ok " % n)
        wire.expect(b"x%d ok " % n)
    wire.send(b"m publish --confirm %b kept" % event)
    wire.expect(b"m ok ")
    wire.close()
    assert broker.stop() == 0
    for count in ("3", "1"):
        broker.args = ["--workers", count, "--data-dir", data_dir]
        broker.restart()
        for queue in queues:
            consumer = broker.wire()
            consumer.send(b"c consume %b %b --manual-ack" % (queue, event))
            line = consumer.recv_line()  # held, then requeued on close (retry raised): there again next time
            assert line.startswith(b"c ok m event=%b" % event) and line.endswith(b" kept"), (count, queue, line)
            consumer.close()
        assert broker.stop() == 0


MEMORY_LIMIT_BYTES = 192 << 20
MEMORY_OVERHEAD_BYTES = 16 << 20  # as in test_semantics: what comes in between two checks


def test_max_memory_is_shared_and_the_owner_refuses_what_other_workers_forward(make_broker):
    """Each worker holds itself to 1/N of --max-memory, and the owner of a queue refuses copies
    that arrive through the other worker (before, they were taken whatever its memory)."""
    broker = make_broker("--workers", "2", "--max-memory", str(MEMORY_LIMIT_BYTES))
    share = MEMORY_LIMIT_BYTES // WORKERS
    queue, event = queue_on(1), unique_bytes("e")
    publisher = direct(broker, 0)  # every copy crosses to worker 1
    owner_pid = stats(publisher, 1)["pid"]
    publisher.send(b"b rebind --confirm %b %b" % (queue, event))
    publisher.expect(b"b ok ")
    body = b"x" * (64 << 10)
    sent = 0
    while True:
        publisher.send(*(b"m%d publish %b %b" % (sent + i, event, body) for i in range(50)))
        sent += 50
        publisher.send(b"probe publish --confirm %b small" % event)
        line = publisher.recv_line()
        if line != b"probe ok ":
            reason = b"memory limit reached (--max-memory=%d bytes; this worker's share is %d bytes)" % (
                MEMORY_LIMIT_BYTES, share)
            assert line.startswith(b"probe error ") and reason in line, line
            break
        assert sent * len(body) < 4 * MEMORY_LIMIT_BYTES, "the owner never refused"
    assert rss_bytes(owner_pid) <= share + MEMORY_OVERHEAD_BYTES
    dropped = stats(publisher)["dropped"]
    publisher.send(b"d publish %b dropped at the owner" % event)
    wait_for(lambda: stats(publisher)["dropped"] == dropped + 1, "the forwarded copy to be dropped and counted")
    assert stats(publisher, 1)["memory_full"] is True and stats(publisher, 0)["memory_full"] is False
    consumer = direct(broker, 1)
    consumer.send(b"c consume %b" % queue)

    def drained() -> bool:
        read_a_while(consumer)
        return not stats(publisher, 1)["memory_full"]

    wait_for(drained, "the owner to accept again after the drain", timeout=60)
    publisher.send(b"after publish --confirm %b small" % event)
    publisher.expect(b"after ok ")
    publisher.close()
    consumer.close()


def test_a_frozen_worker_loses_its_link_instead_of_growing_the_others(make_broker):
    """Worker 1 stops reading (SIGSTOP) while worker 0 forwards to it: past --max-link-backlog
    worker 0 closes the link, as if worker 1 had restarted, instead of holding it all in memory;
    once worker 1 runs again they link again and a confirmed publish crosses."""
    broker = make_broker("--workers", str(WORKERS), "--max-link-backlog", "4M")
    queue, event = queue_on(1, "fq"), unique_bytes("e")
    owner = direct(broker, 1)  # the publisher's own lines never reach worker 1: it is not closed with the link
    owner.send(b"b rebind --confirm %b %b" % (queue, event))
    owner.expect(b"b ok ")
    frozen = stats(owner, 1)["pid"]
    owner.close()
    publisher = direct(broker, 0)
    body = b"x" * (64 << 10)
    os.kill(frozen, signal.SIGSTOP)
    try:
        # 32 MiB, 8 times the backlog allowed (no ping between: it would wait for the frozen worker)
        for _ in range(32):
            publisher.send(*(b"m publish %b %b" % (event, body) for _ in range(16)))
        wait_for(lambda: "past --max-link-backlog" in broker.log(), "worker 0 to give up on the frozen worker")
    finally:
        os.kill(frozen, signal.SIGCONT)

    def crosses() -> bool:
        publisher.send(b"p publish --confirm %b after" % event)
        line = publisher.recv_line(timeout=10)
        assert line == b"p ok " or (line.startswith(b"p error ") and b"worker 1" in line), line
        return line == b"p ok "

    wait_for(crosses, "a confirmed publish to reach worker 1 again", timeout=30)
    consumer = direct(broker, 1)
    consumer.send(b"c consume %b" % queue)
    while not (line := consumer.recv_line(timeout=10)).endswith(b" after"):
        assert line.startswith(b"c ok ") and line.endswith(body), line[:100]
    publisher.close()
    consumer.close()


def test_healthz_fails_while_a_worker_is_down(make_broker):
    """/healthz (served by worker 0) answers for every worker: 503 naming the one that is gone
    (the supervisor is frozen, so it stays gone), 200 once it is back and linked."""
    port = free_port()
    broker = make_broker("--workers", str(WORKERS), "--metrics-port", str(port))
    assert http_get(port, "/healthz") == (200, b"ok\n")
    asker = direct(broker, 1)
    victim = stats(asker, 1)["pid"]
    asker.close()
    broker.signal(signal.SIGSTOP)
    try:
        os.kill(victim, signal.SIGKILL)
        _, body = wait_for(lambda: (answer := http_get(port, "/healthz"))[0] == 503 and answer,
                           "/healthz to see worker 1 gone")
        assert b"worker 1 not linked" in body, body
    finally:
        broker.signal(signal.SIGCONT)
    wait_restarted(broker, 1, victim)
    wait_for(lambda: http_get(port, "/healthz") == (200, b"ok\n"), "/healthz to be ok again")


def test_a_second_broker_on_the_same_port_is_refused(two):
    result = subprocess.run([sys.executable, "-m", "mqks.server", "--port", str(two.port), "--workers", "2"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert "cannot listen" in result.stderr
    assert two.answers_ping()


def test_sigterm_stops_every_worker_and_exits_0(make_broker):
    broker = make_broker("--workers", "2")
    wire = broker.wire()
    pids = [stats(wire, worker)["pid"] for worker in range(WORKERS)]
    wire.close()
    assert broker.stop() == 0
    for pid in pids:
        wait_for(lambda pid=pid: exited(pid), f"worker {pid} to exit")


def sigterm_once_logged(args: list[str], line: bytes, log_path) -> int:
    """Start `mqksd args`, SIGTERM it as soon as its log has `line`; its exit code."""
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "mqks.server", "--port", str(free_port()), *args],
                                   stdout=subprocess.DEVNULL, stderr=log_file)
    try:
        wait_for(lambda: line in log_path.read_bytes(), f"mqksd to log {line!r}")
        process.send_signal(signal.SIGTERM)
        return process.wait(90)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_worker_stopped_while_it_waits_for_its_peers_exits_0(tmp_path):
    """A SIGTERM that comes while a worker is still linking to the others (the supervisor
    stopping right after a start): the worker never opens the public port and exits 0.
    Worker 1 never comes here, so worker 0 stays in its wait for the link."""
    log_path = tmp_path / "worker-0.log"
    args = ["--workers", "2", "--worker-index", "0", "--run-dir", str(tmp_path)]
    assert sigterm_once_logged(args, b"mqksd listening", log_path) == 0, log_path.read_text()
    assert b"not every other worker answered" not in log_path.read_bytes()


def test_sigterm_while_the_workers_start_exits_0(tmp_path):
    """A stop that comes while the workers are still importing, before any has its handler."""
    log_path = tmp_path / "mqksd.log"
    assert sigterm_once_logged(["--workers", "2"], b"mqksd supervising", log_path) == 0, log_path.read_text()


def exited(pid: int) -> bool:
    """True once `pid` is gone or a zombie (its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_readme_hello_world_on_two_workers(two):
    """The README's four terminals, each landing on whichever worker the kernel picks."""
    alice, bob, charlie, dave = (two.wire() for _ in range(4))
    greetings, byes = unique_bytes("greetings"), unique_bytes("greetings-and-byes")
    alice.send(b"Alice consume --confirm %b hi hello" % greetings)
    bob.send(b"Bob consume --confirm %b hi hello" % greetings)
    charlie.send(b"Charlie consume --confirm %b hi hello bye good-bye" % byes)
    alice.expect(b"Alice ok ")
    bob.expect(b"Bob ok ")
    charlie.expect(b"Charlie ok ")
    dave.send(b"Dave publish hello world")
    dave.barrier()
    got = alice.barrier() + bob.barrier()
    assert got in ([b"Alice ok Dave event=hello world"], [b"Bob ok Dave event=hello world"])
    charlie.expect(b"Charlie ok Dave event=hello world")
    for wire in (alice, bob, charlie, dave):
        wire.close()


def test_frames_come_out_whole_however_the_stream_is_cut():
    """The link's frame reader, fed random frames (some far larger than a read) in random pieces."""
    from mqks.server.workers.frames import FrameReader

    rng = random.Random(13)
    for _ in range(200):
        frames = [(rng.choice(b"PS>.cBK"), b"k%d" % rng.randint(0, 99),
                   rng.randbytes(rng.choice([0, 1, 5, 100, 5000, 300_000]))) for _ in range(rng.randint(1, 8))]
        stream = b"".join(b"%c%b %d\n" % (kind, key, len(payload)) + payload for kind, key, payload in frames)
        reader, got, pos = FrameReader(), [], 0
        while pos < len(stream):
            size = rng.choice([1, 2, 7, 100, 4096, 65536, 262144])
            got += reader.feed(stream[pos : pos + size])
            pos += size
        assert got == frames


def test_distinct_events_keep_the_owner_cache_bounded(two):
    # issue 31.5: the per-event owner cache grew by one entry per distinct event (ids in event
    # names) and was cleared only when a binding changed: +79 MiB per million
    wire = direct(two, 0)
    queue = queue_on(1)
    wire.send(b"r rebind --confirm %b hot" % queue)  # another worker owns it: each publish asks the replica
    wire.expect(b"r ok ")
    count = MAX_CACHED_EVENTS + 10_000
    for start in range(0, count, 10_000):
        wire.send(*(b"m publish nobody.%d.created x" % i for i in range(start, start + 10_000)))
    wire.send(b"m publish hot x")
    assert wire.barrier() == []
    size = int(eval_on(wire, b"len(process.peers.replica.cache)"))
    assert 0 < size <= MAX_CACHED_EVENTS
    assert eval_on(wire, b"process.peers.replica.cache.get(b'hot')") == b"(1,)"  # the newest stayed
    routes = int(eval_on(wire, b"len(state.routing.cache)"))
    assert routes <= MAX_CACHED_EVENTS
    wire.close()


def test_a_worker_whose_log_is_corrupt_stops_the_broker_instead_of_a_crash_loop(tmp_path):
    # issue 31.7: the worker exited 1 and the supervisor restarted it for ever, while the other
    # worker served and every line for the broken one answered "worker 1 is restarting"
    server = BrokerProcess("--workers", "2", "--data-dir", str(tmp_path))
    try:
        wire = direct(server, 1)
        queue = queue_on(1)
        wire.send(b"r rebind --confirm %b e" % queue)
        wire.expect(b"r ok ")
        wire.send(*(b"m%d publish --confirm e %b" % (i, b"x" * 200) for i in range(50)))
        for i in range(50):
            wire.expect(b"m%d ok " % i)
        wire.close()
        assert server.stop() == 0
        [segment] = sorted((tmp_path / "worker-1").glob("*.log"))[-1:]
        with open(segment, "r+b") as f:  # a bad frame with good ones after it: corruption, not a torn tail
            f.seek(segment.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(RuntimeError, match="exited 1"):
            server.restart()
        log = server.log()
        assert "--repair" in log and str(segment) in log
        assert log.count("worker 1 (pid") == 0, "the supervisor restarted the worker"
    finally:
        server.kill()


def test_healthz_and_metrics_see_a_full_disk_on_any_worker(make_broker, tmp_path):
    # issue 31.8: /healthz (served by worker 0) checked only its own log, and mqks_log_disk_full was
    # missing from /metrics with workers
    port = free_port()
    broker = make_broker("--workers", str(WORKERS), "--metrics-port", str(port), "--data-dir", str(tmp_path))
    wire = direct(broker, 1)
    queue = queue_on(1)
    wire.send(b"r rebind --confirm %b e" % queue, b"m0 publish --confirm e before")
    wire.expect(b"r ok ")
    wire.expect(b"m0 ok ")
    pid = stats(wire, 1)["pid"]
    used = sum(path.stat().st_size for path in (tmp_path / "worker-1").glob("*.log"))
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (used + 100, hard))  # worker 1's disk is "full"
    try:
        wire.send(b"m1 publish --confirm e %s" % (b"z" * 500))
        wire.expect_error(b"m1", b"disk full")
        status, body = http_get(port, "/healthz")
        assert status == 503 and b"worker 1: disk full" in body, (status, body)
        status, body = http_get(port, "/metrics")
        assert status == 200 and b"\nmqks_log_disk_full 1.0\n" in body, body[-2000:]
    finally:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard, hard))  # room again
    wait_for(lambda: http_get(port, "/healthz") == (200, b"ok\n"), "healthz back to ok once worker 1's log writes")
    assert b"\nmqks_log_disk_full 0.0\n" in http_get(port, "/metrics")[1]
    wire.close()


def test_a_stalled_consumer_on_a_worker_that_does_not_own_its_queue_loses_nothing(make_broker):
    # issue 31.4: once the stalled client read again the owner pushed the whole backlog across the
    # link, its worker buffered it past --max-output-bytes and cut the client off: 1.83M of 2M lost
    broker = make_broker("--eval", "--workers", str(WORKERS), "--max-output-bytes", str(1 << 20))
    queue = queue_on(1)
    consumer = direct(broker, 0)
    consumer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    consumer.send(b"c consume --confirm %b e" % queue)  # auto-ack: a delivery taken off the queue is gone
    consumer.expect(b"c ok ")
    publisher = direct(broker, 1)
    count, batch = 600_000, 20_000  # 17 MB of deliveries: 16x the output limit
    for start in range(0, count, batch):
        publisher.send(*(b"m%d publish e %d" % (i, i) for i in range(start, start + batch)))
    assert publisher.barrier() == []
    # the consumer has not read a byte: what the socket buffers do not hold waits in the queue
    assert queue_row(broker, queue)["depth"] > 0
    got = [consumer.recv_line(timeout=30) for _ in range(count)]
    assert got == [b"c ok m%d event=e %d" % (i, i) for i in range(count)]
    assert consumer.barrier() == []
    assert queue_row(broker, queue)["depth"] == 0
    consumer.close()
    publisher.close()


def test_a_backlog_of_big_messages_relayed_to_a_consumer_on_the_other_worker_is_held_about_once(make_broker):
    # issue 31.10: 512 KiB messages relayed between workers peaked well above what they weigh; with a
    # backlog bigger than --max-output-bytes the owner pushed it all across and the client was cut off
    # glibc raises its mmap threshold after each big free, up to 32 MiB, and then keeps freed bodies in the heap
    # for later: how much of that shows as resident depended on timing (CI, beside the cluster tier: 1.76x, alone
    # 1.50-1.59x). A fixed threshold returns each freed 512 KiB body at once: what is measured is what MQKS holds.
    broker = make_broker("--workers", str(WORKERS), env={"MALLOC_MMAP_THRESHOLD_": str(128 << 10)})
    queue = queue_on(1)
    publisher = direct(broker, 0)
    publisher.send(b"r rebind --confirm %b big" % queue)
    publisher.expect(b"r ok ")
    pids = broker.pids()[1:]  # the workers
    start = sum(rss_bytes(pid) for pid in pids)
    count, body = 200, b"y" * (512 << 10)  # 100 MiB, past the default 64 MiB output limit
    for i in range(count):
        publisher.send(b"m%d publish --confirm big %b" % (i, body))
        publisher.expect(b"m%d ok " % i)
    peak, sampling = [0], threading.Event()

    def sample() -> None:  # the workers' combined resident size, at one moment each time
        while not sampling.is_set():
            peak[0] = max(peak[0], sum(rss_bytes(pid) for pid in pids))
            sampling.wait(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        consumer = direct(broker, 0)
        consumer.send(b"c consume --confirm %b" % queue)
        consumer.expect(b"c ok ")
        for i in range(count):
            assert consumer.recv_line(timeout=30) == b"c ok m%d event=big %b" % (i, body)
    finally:
        sampling.set()
        sampler.join()
    payload = count * len(body)
    print(f"relayed big messages: the workers grew {(peak[0] - start) / payload:.2f}x the payload")
    # 1.14-1.17x with the fixed mmap threshold, beside two busy cores too (1.49x with glibc's default, 1.97x with a
    # 16 MiB window); the messages themselves are 1x: held twice would be 2x
    assert peak[0] - start <= 1.4 * payload, f"{(peak[0] - start) >> 20} MiB over the start for {payload >> 20} MiB"
    consumer.close()
    publisher.close()


def test_kill_9_of_the_supervisor_then_a_new_broker_at_once_serves_every_first_connection(make_broker):
    # issue 24.4: a client's first connection to the new broker was sometimes accepted by a worker of
    # the killed one, about to die (the port is shared with SO_REUSEPORT), and its first write failed
    port = free_port()
    broker = make_broker("--workers", str(WORKERS), port=port)
    for _ in range(8):
        old_workers = broker.pids()[1:]
        broker.proc.send_signal(signal.SIGKILL)  # no wait for its workers: they must go on their own
        broker.proc.wait()
        broker = make_broker("--workers", str(WORKERS), port=port)
        # the killed broker's workers hold no socket any more (exited, at most a zombie awaiting its reaper)
        assert not [pid for pid in old_workers if os.path.exists(f"/proc/{pid}/fd") and os.listdir(f"/proc/{pid}/fd")]
        wire = broker.wire()
        wire.send(b"p ping first", b"h hello")
        wire.expect(b"p ok first")
        line = wire.recv_line()
        assert line.startswith(b"h ok "), line
        assert json.loads(line[5:])["direct"] == hello(broker.wire())["direct"]  # the new broker's workers
        wire.close()


def two_free_ports() -> int:
    """A port P with P and P+1 free: `--direct-port P` for two workers."""
    for _ in range(100):
        base = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise AssertionError("no two free ports in a row")


def test_a_restarted_worker_confirms_no_publish_before_it_has_the_others_bindings(make_broker):
    """Worker 1 is killed while worker 0 is frozen (SIGSTOP): the new worker 1 dials worker 0 but cannot
    read the bindings worker 0 sends on accepting, and answers on its own port meanwhile. Before, it counted
    worker 0 as linked once dialled: a confirmed publish for worker 0's queue was `ok` and reached no queue
    (lost). Now it is refused with "try again" until worker 0's bindings are in; every `ok` is delivered."""
    base = two_free_ports()
    broker = make_broker("--workers", str(WORKERS), "--direct-port", str(base))
    queue, event = queue_on(0, "bq"), unique_bytes("e")
    consumer = Wire("127.0.0.1", base)  # worker 0, the queue's owner
    consumer.send(b"c consume --confirm %b %b" % (queue, event))
    consumer.expect(b"c ok ")
    probe = Wire("127.0.0.1", base + 1)
    frozen, victim = stats(probe, 0)["pid"], stats(probe, 1)["pid"]
    probe.close()

    def new_worker_1() -> Wire | None:
        try:
            wire = Wire("127.0.0.1", base + 1, timeout=2)
        except OSError:
            return None
        try:
            if stats(wire, 1)["pid"] != victim:
                return wire
        except (OSError, AssertionError, TimeoutError):
            pass
        wire.close()
        return None

    os.kill(frozen, signal.SIGSTOP)
    try:
        os.kill(victim, signal.SIGKILL)
        publisher = wait_for(new_worker_1, "the supervisor to restart worker 1", timeout=20)
        publisher.send(b"early publish --confirm %b early" % event)
        early = publisher.recv_line()
    finally:
        os.kill(frozen, signal.SIGCONT)
    confirmed = [b"early"] if early == b"early ok " else []
    assert early.startswith(b"early error ") and b"try again" in early, early

    def published() -> bool:
        publisher.send(b"late publish --confirm %b late" % event)
        answer = publisher.recv_line()
        assert answer == b"late ok " or b"try again" in answer, answer
        return answer == b"late ok "

    wait_for(published, "worker 1 to take a confirmed publish once worker 0 is back", timeout=20, interval=0.05)
    confirmed.append(b"late")
    got = [consumer.recv_line().rsplit(b" ", 1)[1] for _ in confirmed]
    assert got == confirmed
    assert "restarting it" in broker.log()
    publisher.close()
    consumer.close()

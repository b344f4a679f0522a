"""`fetch` and `settle` (issue 14): messages held under a lease that any connection settles.

Wire transcripts against a real mqksd: what a fetch answers, that a re-fetch releases first,
that an ack never covers what a lease no longer holds, expiry, byte limits, and a crash of a
durable broker returning leased messages.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port, http_get, unique_bytes
from waiting import wait_for


def publish(wire, event: bytes, count: int, data: bytes = b"x", prefix: bytes = b"m") -> None:
    wire.send(*(b"%s%d publish %s %s" % (prefix, i, event, data) for i in range(count)))
    assert wire.barrier() == []


def bind(wire, queue: bytes, event: bytes) -> None:
    wire.send(b"b rebind --confirm %s %s" % (queue, event))
    wire.expect(b"b ok ")


def fetch(wire, rid: bytes, args: bytes) -> list[tuple[bytes, bytes, bytes]]:
    """Send a fetch; return its messages as (msg_id, head, data), checked against the end line's count."""
    wire.send(b"%s fetch %s" % (rid, args))
    got = []
    while True:
        line = wire.recv_line()
        prefix, rest = line[: len(rid) + 4], line[len(rid) + 4 :]
        assert prefix == rid + b" ok ", line
        if rest.startswith(b"--end "):
            assert int(rest[6:]) == len(got), line
            return got
        msg_id, head, data = rest.split(b" ", 2)
        got.append((msg_id, head, data))


def settle(wire, args: bytes) -> int:
    wire.send(b"s settle " + args)
    line = wire.recv_line()
    assert line.startswith(b"s ok "), line
    return int(line[5:])


def depth(wire, queue: bytes) -> tuple[int, int]:
    """(waiting, un-acked) from the `queues` action."""
    wire.send(b"q queues " + queue)
    row = wire.recv_line()
    wire.expect(b"q ok --end")

    found = json.loads(row[len(b"q ok ") :])
    return found["depth"], found["unacked"]


def test_fetch_answers_messages_with_seq_then_end_and_holds_them(wire):
    queue, event = unique_bytes("lq"), unique_bytes("le")
    bind(wire, queue, event)
    publish(wire, event, 5)
    got = fetch(wire, b"f1", queue + b" --max=3 --lease=L1")
    assert [m for m, _, _ in got] == [b"m0", b"m1", b"m2"]
    assert [h for _, h, _ in got] == [b"event=%s,seq=%d" % (event, i) for i in range(3)]
    assert depth(wire, queue) == (2, 0)
    # another connection settles: the lease is not tied to the fetching connection
    other = wire.__class__(*wire.sock.getpeername())
    try:
        assert settle(other, b"L1 --ack") == 3
        assert settle(other, b"L1 --ack") == 0  # settled leases hold nothing
    finally:
        other.close()
    assert depth(wire, queue) == (2, 0)


def test_refetch_under_the_same_lease_releases_first_and_ack_covers_only_the_last_fetch(wire):
    queue, event = unique_bytes("lq"), unique_bytes("le")
    bind(wire, queue, event)
    publish(wire, event, 4)
    first = fetch(wire, b"f1", queue + b" --max=2 --lease=L2")
    assert [m for m, _, _ in first] == [b"m0", b"m1"]
    # the task is retried: same lease, the held messages go back to the front with retry+1 first
    again = fetch(wire, b"f2", queue + b" --max=3 --lease=L2")
    assert [(m, h) for m, h, _ in again] == [
        (b"m0", b"event=%s,retry=1,seq=0" % event),
        (b"m1", b"event=%s,retry=1,seq=1" % event),
        (b"m2", b"event=%s,seq=2" % event),
    ]
    assert settle(wire, b"L2 --ack") == 3
    assert depth(wire, queue) == (1, 0)
    assert [m for m, _, _ in fetch(wire, b"f3", queue + b" --max=10 --lease=L3")] == [b"m3"]
    assert settle(wire, b"L3 --release") == 1
    # a released message goes to the front with its retry raised, to a consumer as well
    wire.send(b"c1 consume --confirm %s" % queue)
    wire.expect(b"c1 ok ")
    wire.expect(b"c1 ok m3 event=%s,retry=1 x" % event)


def test_add_keeps_what_the_lease_holds(wire):
    queue, event = unique_bytes("lq"), unique_bytes("le")
    bind(wire, queue, event)
    publish(wire, event, 3)
    fetch(wire, b"f1", queue + b" --max=1 --lease=L4")
    fetch(wire, b"f2", queue + b" --max=1 --lease=L4 --add")
    assert settle(wire, b"L4 --ack") == 2
    assert depth(wire, queue) == (1, 0)


def test_max_bytes_bounds_a_fetch_but_a_bigger_message_still_goes_alone(wire):
    queue, event = unique_bytes("lq"), unique_bytes("le")
    bind(wire, queue, event)
    wire.send(b"big publish %s %s" % (event, b"y" * 5000))
    publish(wire, event, 3, data=b"z" * 100)
    got = fetch(wire, b"f1", queue + b" --max=10 --max-bytes=1000 --lease=L5")
    assert [(m, len(d)) for m, _, d in got] == [(b"big", 5000)]  # larger than the limit, alone
    got = fetch(wire, b"f2", queue + b" --max=10 --max-bytes=300 --lease=L6")
    assert [m for m, _, _ in got] == [b"m0", b"m1"]  # ~125-byte tails: two fit in 300
    # a lease that holds messages takes no more than --max-bytes on --add, not even one message
    assert fetch(wire, b"f3", queue + b" --max=10 --max-bytes=50 --lease=L6 --add") == []
    assert settle(wire, b"L5 L6 --ack") == 3


def test_an_expired_lease_returns_its_messages_and_a_late_ack_acks_nothing(wire):
    queue, event = unique_bytes("lq"), unique_bytes("le")
    bind(wire, queue, event)
    publish(wire, event, 2)
    fetch(wire, b"f1", queue + b" --max=2 --lease=L7 --lease-seconds=0.2")
    wait_for(lambda: depth(wire, queue) == (2, 0), "the lease to expire")
    assert settle(wire, b"L7 --ack") == 0
    again = fetch(wire, b"f2", queue + b" --max=2 --lease=L8")
    assert [h for _, h, _ in again] == [b"event=%s,retry=1,seq=%d" % (event, i) for i in range(2)]
    assert settle(wire, b"L8 --ack") == 2


def test_fetch_and_settle_refuse_bad_arguments_with_a_reason(wire):
    wire.send(b"e1 fetch q1 --max=2")
    wire.expect_error(b"e1", b"--lease={lease_id} is required")
    wire.send(b"e2 fetch q1 --lease=a --max=0")
    wire.expect_error(b"e2", b"--max wants 1..")
    wire.send(b"e3 fetch q1 --lease=a --lease-seconds=abc")
    wire.expect_error(b"e3", b"--lease-seconds wants a number")
    wire.send(b"e4 fetch q1 --lease=a --bogus")
    wire.expect_error(b"e4", b"unexpected '--bogus'")
    wire.send(b"e5 settle L1")
    wire.expect_error(b"e5", b"--ack|--release")
    wire.send(b"e6 settle L1 --ack --release")
    wire.expect_error(b"e6", b"--ack|--release")
    wire.send(b"e7 fetch no.such.queue --lease=a")
    wire.expect(b"e7 ok --end 0")
    assert wire.barrier() == []


def stats(wire) -> dict:
    wire.send(b"st stats")
    line = wire.recv_line()
    assert line.startswith(b"st ok "), line
    return json.loads(line[len(b"st ok ") :])


def test_stats_count_leases(wire):
    queue, event = unique_bytes("lq"), unique_bytes("le")
    bind(wire, queue, event)
    publish(wire, event, 3)
    before = stats(wire)
    fetch(wire, b"f1", queue + b" --max=3 --lease=L9")
    during = stats(wire)
    assert during["messages_leased"] - before["messages_leased"] == 3
    assert during["leases"] - before["leases"] == 1
    assert settle(wire, b"L9 --ack") == 3
    after = stats(wire)
    assert after["acked"] - during["acked"] == 3 and after["leases"] == before["leases"]


@pytest.mark.parametrize("workers_count", [1, 2])
def test_leased_messages_show_per_queue_in_queues_stats_and_metrics(make_broker, workers_count):
    # issue 24.3: a queue with messages out under a lease showed `depth 1 unacked 0` everywhere
    port = free_port()
    server = make_broker("--workers", str(workers_count), "--metrics-port", str(port))
    wire = server.wire()
    queue, event = unique_bytes("lq"), unique_bytes("le")
    bind(wire, queue, event)
    publish(wire, event, 3)
    fetch(wire, b"f1", queue + b" --max=2 --lease=L7")
    wire.send(b"q queues " + queue)
    row = json.loads(wire.recv_line()[len(b"q ok "):])
    wire.expect(b"q ok --end")
    assert (row["depth"], row["unacked"], row["leased"]) == (1, 0, 2)
    assert [queue.decode(), 2] in [list(entry) for entry in stats(wire)["top_leased_queues"]]
    status, body = http_get(port, "/metrics")
    assert status == 200 and b'mqks_queue_leased{queue="%s"} 2.0' % queue in body
    mqks = str(Path(sys.executable).parent / "mqks")
    table = subprocess.run([mqks, "queues", "--port", str(server.port), queue.decode()], capture_output=True,
                           text=True, timeout=30, check=True).stdout.splitlines()
    assert table[0].split()[:4] == ["queue", "depth", "unacked", "leased"] and table[1].split()[1:4] == ["1", "0", "2"]
    shown = subprocess.run([mqks, "stats", "--port", str(server.port)], capture_output=True, text=True, timeout=30,
                           check=True).stdout
    assert "queues with messages under lease:" in shown and f"2  {queue.decode()}" in shown
    assert settle(wire, b"L7 --ack") == 2
    assert "top_leased_queues" in stats(wire) and queue.decode() not in json.dumps(stats(wire)["top_leased_queues"])
    wire.close()


def killed_once_stored(server, wire):
    """Kill the broker once every record before now is on disk, restart it; a new wire to it (`wire` closed)."""
    try:
        wire.send(b"c publish --confirm other.event x")  # a confirm waits for every record before it
        wire.expect(b"c ok ")
    finally:
        wire.close()
    server.kill()
    server.restart()
    return server.wire()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_durable_broker_killed_returns_leased_messages_to_their_queue(make_broker, tmp_path, workers):
    server = make_broker("--data-dir", str(tmp_path / "data"), "--workers", str(workers))
    queue, event = b"lq.durable", b"le.durable"
    wire = server.wire()
    try:
        bind(wire, queue, event)
        wire.send(*(b"m%d publish --confirm %s x" % (i, event) for i in range(4)))
        for i in range(4):
            wire.expect(b"m%d ok " % i)
        fetch(wire, b"f1", queue + b" --max=3 --lease=D1")
        assert settle(wire, b"D1 --ack") == 3
        fetch(wire, b"f2", queue + b" --max=1 --lease=D2")
        wire.send(b"p ping --confirm")  # ping answers after every earlier line ran
        wire.expect(b"p ok ")
    except BaseException:
        wire.close()
        raise
    wire = killed_once_stored(server, wire)
    try:
        # the acked three are gone; the leased one is back at the front with its retry raised
        got = fetch(wire, b"f3", queue + b" --max=10 --lease=D3")
        assert [(m, h) for m, h, _ in got] == [(b"m3", b"event=%s,retry=1,seq=3" % event)]
        assert settle(wire, b"D2 D3 --ack") == 1  # D2 died with the broker
    finally:
        wire.close()


def test_a_durable_broker_killed_returns_what_fetch_runs_took_in_bulk(make_broker, tmp_path):
    """Stored runs a `fetch --runs` lease holds whole are journaled as held, seq by seq, like any other."""
    server = make_broker("--data-dir", str(tmp_path / "data"))
    queue, event, count = b"lq.runs", b"le.runs", 7000  # deep enough for stored runs (messages.py)
    wire = server.wire()
    try:
        bind(wire, queue, event)
        publish(wire, event, count)
        wire.send(b"f1 fetch %s --max=%d --max-bytes=10000000 --lease=R1 --runs" % (queue, count))
        headers = []
        while not (line := wire.recv_line()).startswith(b"f1 ok --end "):
            if line.startswith(b"f1 ok --"):
                headers.append(line.split(b" ")[2])
        assert line == b"f1 ok --end %d" % count and b"--packed" in headers
    except BaseException:
        wire.close()
        raise
    wire = killed_once_stored(server, wire)
    try:
        got = fetch(wire, b"f2", queue + b" --max=%d --max-bytes=10000000 --lease=R2" % count)
        assert [(m, h) for m, h, _ in got] == [(b"m%d" % i, b"event=%s,retry=1,seq=%d" % (event, i))
                                              for i in range(count)]
    finally:
        wire.close()


def test_a_snapshot_keeps_leased_messages(make_broker, tmp_path):
    server = make_broker("--data-dir", str(tmp_path / "data"), "--compact-min-bytes", "1")
    queue, event = b"lq.snap", b"le.snap"
    wire = server.wire()
    try:
        bind(wire, queue, event)
        wire.send(*(b"m%d publish --confirm %s x" % (i, event) for i in range(3)))
        for i in range(3):
            wire.expect(b"m%d ok " % i)
        fetch(wire, b"f1", queue + b" --max=2 --lease=S1")
        wire.send(b"c publish --confirm other.event %s" % (b"p" * 2000))  # grows the log past the limit
        wire.expect(b"c ok ")
        wait_for(lambda: stats(wire)["log"]["snapshots"] >= 1, "a snapshot")
    finally:
        wire.close()
    server.kill()
    server.restart()
    wire = server.wire()
    try:
        got = fetch(wire, b"f2", queue + b" --max=10 --lease=S2")
        assert [(m, h.endswith(b"retry=1,seq=%d" % i)) for i, (m, h, _) in enumerate(got)][:2] == [
            (b"m0", True), (b"m1", True)]
        assert [m for m, _, _ in got] == [b"m0", b"m1", b"m2"]
    finally:
        wire.close()


def test_a_released_lease_past_max_retries_goes_to_the_dead_letters(wire):
    queue, event = unique_bytes("lq"), unique_bytes("le")
    wire.send(b"b rebind --confirm %s %s --max-retries=1" % (queue, event))
    wire.expect(b"b ok ")
    publish(wire, event, 1)
    fetch(wire, b"f1", queue + b" --lease=X1")
    assert settle(wire, b"X1 --release") == 1  # retry 1: still within --max-retries=1
    fetch(wire, b"f2", queue + b" --lease=X2")
    assert settle(wire, b"X2 --release") == 1  # a second time: past it
    assert depth(wire, queue) == (0, 0)
    got = fetch(wire, b"f3", queue + b".dead --lease=X3")
    assert [m for m, _, _ in got] == [b"m0"]
    assert settle(wire, b"X3 --ack") == 1

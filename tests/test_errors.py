"""Bad input gets a clear error or a closed connection for that client alone.

After each case another client must still be served, and nothing queued is lost.
"""

import os
import socket
import time

import pytest
from conftest import Broker

pytestmark = pytest.mark.timeout(60)

MAX_LINE_BYTES = 1024
MAX_OUTPUT_BYTES = 1 << 20


@pytest.fixture(scope="module")
def broker():
    server = Broker("--eval", "--max-line-bytes", str(MAX_LINE_BYTES), "--max-output-bytes", str(MAX_OUTPUT_BYTES))
    yield server
    server.kill()


def assert_others_served(broker) -> None:
    """A fresh client can still consume what another publishes, and ping."""
    consumer, publisher = broker.wire(), broker.wire()
    try:
        consumer.send(b"c consume --confirm served-q served-e")
        consumer.expect(b"c ok ")
        publisher.send(b"m publish served-e still here")
        consumer.expect(b"c ok m event=served-e still here")
    finally:
        consumer.close()
        publisher.close()


@pytest.mark.parametrize(
    "line, rid, reason",
    [
        (b"r1 pubish e1 d", b"r1", b'unknown action "pubish"'),
        (b"r2 publish", b"r2", b"event expected"),
        (b"r3 consume", b"r3", b"queue expected"),
        (b"r4 consume q --bogus", b"r4", b"unknown flag '--bogus'"),
        (b"r5 consume q e --manual-ack --prefetch=many", b"r5", b"--prefetch wants a whole number"),
        (b"r6 consume q e --delete-queue-when-unused=-1", b"r6", b"seconds >= 0"),
        (b"r7 consume q e --prefetch=5", b"r7", b"--prefetch needs --manual-ack"),
        (b"r8 consume q --manual-ack e2", b"r8", b"after a flag"),
        (b"r9 rebind q --bogus e", b"r9", b"unknown flag"),
        (b"r10 rebind", b"r10", b"queue expected"),
        (b"r11 ack", b"r11", b"expected {consumer_id} {msg_id}|--all"),
        (b"r12 reject c1", b"r12", b"expected {consumer_id} {msg_id}|--all"),
        (b"r13 delete_consumer", b"r13", b"expected {consumer_id}"),
        (b"r14 delete_queue", b"r14", b"expected {queue}"),
        (b"r15 delete_queue --bogus", b"r15", b"queue expected"),
        (b"r16 _eval --worker=7 1", b"r16", b"no worker 7"),
        (b"r17 _eval 1/0", b"r17", b"ZeroDivisionError"),
        (b"r18 publish --confirm", b"r18", b"event expected"),
        (b"nospace", b"-", b"expected {request_id} {action} {data}"),
        (b" ping x", b"-", b"expected {request_id} {action} {data}"),
        (b"bad publish e \xff\xfe", b"bad", b"not valid UTF-8"),
    ],
)
def test_bad_line_gets_error_and_connection_stays(broker, wire, line, rid, reason):
    wire.send(line)
    got = wire.expect_error(rid, reason)
    error_id = got.split(b" ")[2].decode()
    wire.send(b"p ping alive")
    wire.expect(b"p ok alive")
    assert error_id in broker.log()  # the server logged the error id with its details
    assert_others_served(broker)


def test_ack_for_unknown_consumer_with_confirm_gets_error_not_ok(wire):
    wire.send(b"a1 ack --confirm ghost m1")
    wire.expect_error(b"a1", b"unknown consumer")
    assert wire.barrier() == []


def test_empty_lines_are_ignored(wire):
    wire.send_raw(b"\n\r\n\n")
    assert wire.barrier() == []


def test_overlong_line_is_discarded_with_error_and_connection_kept(broker, wire):
    wire.send_raw(b"big publish e " + b"x" * (MAX_LINE_BYTES * 5) + b"\n")
    wire.expect_error(b"big", b"longer than %d bytes" % MAX_LINE_BYTES)
    wire.send(b"p ping after")
    wire.expect(b"p ok after")
    assert_others_served(broker)


def test_http_request_is_closed_at_once_and_its_body_never_runs(broker, wire):
    wire.send(b"c consume http-q http-e")
    browser = broker.wire()
    browser.send_raw(b"POST / HTTP/1.1\r\nHost: localhost:25000\r\n\r\nm publish http-e from-a-web-page\n")
    assert browser.closed_by_server()
    assert wire.barrier() == []
    assert_others_served(broker)


def test_client_flooding_without_reading_is_closed_alone(broker):
    flooder = socket.create_connection((broker.host, broker.port))
    flooder.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    batch = b"p ping " + b"x" * 900 + b"\n"
    batch *= 1000
    closed = False
    deadline = time.monotonic() + 30
    flooder.settimeout(1)
    while time.monotonic() < deadline:
        try:
            flooder.sendall(batch)
        except OSError:
            closed = True
            break
    flooder.close()
    assert closed, "the server kept a client that never reads"
    assert rss_bytes(broker.proc.pid) < 512 << 20
    assert_others_served(broker)
    assert "unread" in broker.log()


def test_slow_consumer_pauses_deliveries_and_loses_nothing(broker, wire):
    slow = socket.create_connection((broker.host, broker.port))
    slow.sendall(b"c consume slow-q slow-e\n")
    wire.barrier()
    # 20 MB: more than the kernel's socket buffers and far more than the high-water mark
    count, payload = 20_000, b"y" * 1000
    wire.send_raw(b"".join(b"m%d publish slow-e %b\n" % (i, payload) for i in range(count)))
    wire.barrier()
    wire.send(b"ev _eval state.stats()['messages_waiting']")
    waiting = int(wire.recv_line().split(b" ")[2])
    assert waiting > 0, "the server buffered everything for a client that does not read"
    received = 0
    slow.settimeout(10)
    while received < count:
        chunk = slow.recv(1 << 16)
        assert chunk, "the slow consumer was disconnected"
        received += chunk.count(b"\n")
    slow.close()
    assert received == count


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_server_process_survived_everything(broker):
    assert broker.proc.poll() is None
    assert os.path.exists(f"/proc/{broker.proc.pid}")

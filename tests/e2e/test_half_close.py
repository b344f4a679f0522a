"""A client that closes its writing side (`printf ... | nc -q 1`, shutdown(SHUT_WR), a health check)
still gets every answer and every delivery its lines caused before the server closes (issue 24.2).
"""

from __future__ import annotations

import json
import socket
import tempfile
from collections.abc import Iterator

import pytest
from conftest import BrokerProcess
from helpers import unique_bytes as unique
from waiting import wait_for

pytestmark = pytest.mark.timeout(120)

ROUNDS = 15  # a race shows in a few rounds out of this many


@pytest.fixture(scope="module", params=["memory", "data-dir", "workers2", "workers2-data-dir"])
def server(request) -> Iterator[BrokerProcess]:
    with tempfile.TemporaryDirectory() as data_dir:
        # workers with a log: another worker's confirms wait for its log, and its mark must wait behind them
        args = {"memory": [], "data-dir": ["--data-dir", data_dir], "workers2": ["--workers", "2"],
                "workers2-data-dir": ["--workers", "2", "--data-dir", data_dir]}[request.param]
        server = BrokerProcess(*args)
        yield server
        server.kill()


def half_closed(server: BrokerProcess, payload: bytes) -> list[bytes]:
    """Send `payload`, shut the writing side, read to EOF: every line the server wrote."""
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    return data.split(b"\n")[:-1]


def test_a_half_closed_client_gets_its_answers_and_deliveries(server: BrokerProcess) -> None:
    for _ in range(ROUNDS):
        queue, event = unique("q"), unique("e")
        sent = b"c consume --confirm %b %b\np publish --confirm %b hello\n" % (queue, event, event)
        lines = half_closed(server, sent)
        assert sorted(lines) == sorted([b"c ok ", b"p ok ", b"c ok p event=%b hello" % event]), lines


def queue_depth(server: BrokerProcess, queue: bytes) -> int:
    wire = server.wire()
    wire.send(b"qs queues " + queue)
    line = wire.recv_line()
    wire.expect(b"qs ok --end")
    wire.close()
    return json.loads(line[len(b"qs ok "):])["depth"]


def test_a_half_closed_consumer_of_a_deep_backlog_loses_nothing(server: BrokerProcess) -> None:
    queue, event = unique("q"), unique("e")
    count, body = 5000, b"x" * 1000  # 5 MB: far more than the socket buffers
    wire = server.wire()
    wire.send(b"r rebind --confirm %b %b" % (queue, event))
    wire.expect(b"r ok ")
    wire.send(*(b"m%d publish --confirm %b %s" % (i, event, body) for i in range(count)))
    for i in range(count):
        wire.expect(b"m%d ok " % i)
    wire.close()
    lines = half_closed(server, b"c consume --confirm %b\n" % queue)  # auto-ack: what is delivered is gone
    assert lines[0] == b"c ok "
    received = [line.split(b" ")[2] for line in lines[1:]]
    assert received == [b"m%d" % i for i in range(len(received))]
    # every message was either received or is still in the queue
    wait_for(lambda: queue_depth(server, queue) == count - len(received),
             f"{count - len(received)} messages back in the queue")

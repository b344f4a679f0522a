"""The `mqks` console script and `python stats.py`, run as subprocesses the way a user runs them.

The broker's state is set up and checked with wire transcripts (conftest `Wire`); every read from a
subprocess has a deadline.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest
from conftest import Broker, free_port

REPO = Path(__file__).resolve().parent.parent
MQKS = Path(sys.executable).parent / "mqks"
STATS_PY = REPO / "stats.py"
RUN_TIMEOUT_SECONDS = 30.0
LINE_TIMEOUT_SECONDS = 10.0


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def mqks(server: Broker, *args: str) -> subprocess.CompletedProcess:
    """Run `mqks ARGS --port P` to the end."""
    if not MQKS.exists():
        pytest.fail(f"{MQKS} is missing: run `pip install -e .` in {REPO}")
    return subprocess.run([str(MQKS), *args, "--port", str(server.port)], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_SECONDS)


def stats_py(server: Broker, *args: str) -> subprocess.CompletedProcess:
    """Run `python stats.py --port P ARGS` from the repo root, as the README says."""
    return subprocess.run([sys.executable, str(STATS_PY), "--port", str(server.port), *args], capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_SECONDS, cwd=REPO)


class LineReader:
    """Lines from a subprocess pipe, each awaited with a deadline."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.fd = stream.fileno()
        self.buffer = b""

    def line(self, timeout: float = LINE_TIMEOUT_SECONDS) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no line within {timeout}s; have {self.buffer!r}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    raise AssertionError(f"stream closed; have {self.buffer!r}")
                self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode()


@pytest.fixture
def consumer_process(broker: Broker) -> Iterator[Callable[..., tuple[subprocess.Popen, LineReader]]]:
    """Start `mqks consume ...`; waits until it says it consumes; killed after the test."""
    started: list[subprocess.Popen] = []

    def start(*args: str) -> tuple[subprocess.Popen, LineReader]:
        proc = subprocess.Popen([str(MQKS), "consume", *args, "--port", str(broker.port)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        started.append(proc)
        stderr = LineReader(proc.stderr)
        deadline = time.monotonic() + LINE_TIMEOUT_SECONDS
        while "consuming queue" not in stderr.line(max(0.01, deadline - time.monotonic())):
            pass  # a log line before it, e.g. a connect retry
        return proc, LineReader(proc.stdout)

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_mqks_ping_prints_the_answer(broker: Broker) -> None:
    done = mqks(broker, "ping")
    assert (done.returncode, done.stdout) == (0, "pong\n"), done.stderr
    done = mqks(broker, "ping", "hello there")
    assert done.stdout == "hello there\n"


def test_connection_options_work_before_and_after_the_command(broker: Broker) -> None:
    before = subprocess.run([str(MQKS), "--port", str(broker.port), "ping", "before"], capture_output=True, text=True,
                            timeout=30)
    after = subprocess.run([str(MQKS), "ping", "after", "--port", str(broker.port)], capture_output=True, text=True,
                           timeout=30)
    assert (before.returncode, before.stdout) == (0, "before\n"), before.stderr
    assert (after.returncode, after.stdout) == (0, "after\n"), after.stderr


def test_mqks_consume_sees_what_mqks_publish_sends(broker: Broker, consumer_process) -> None:
    queue, event = unique("q"), unique("e")
    proc, stdout = consumer_process(queue, event, f"{event}.*.created")
    assert mqks(broker, "publish", event, "hello world").returncode == 0
    _, first_rest = stdout.line().split(" ", 1)
    assert first_rest == f"event={event} hello world"
    done = mqks(broker, "publish", f"{event}.7.created", "by mask", "--confirm")
    assert done.returncode == 0, done.stderr
    msg_id = done.stdout.strip()
    assert stdout.line() == f"{msg_id} event={event}.7.created by mask"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(RUN_TIMEOUT_SECONDS) == 0


def test_mqks_consume_manual_ack_acks_what_it_printed(broker: Broker, consumer_process) -> None:
    queue, event = unique("q"), unique("e")
    proc, stdout = consumer_process(queue, event, "--manual-ack")
    assert mqks(broker, "publish", event, "printed then acked").returncode == 0
    assert stdout.line().endswith(f"event={event} printed then acked")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(RUN_TIMEOUT_SECONDS) == 0
    wire = broker.wire()
    try:
        wire.send(f"c1 consume --confirm {queue}".encode())
        wire.expect(b"c1 ok ")
        wire.send(f"m1 publish {event} marker".encode())
        # had the ack been lost, the message would be back ahead of the marker
        wire.expect(f"c1 ok m1 event={event} marker".encode())
    finally:
        wire.close()


def test_mqks_publish_refuses_bad_input_and_reports_broker_errors(broker: Broker) -> None:
    done = mqks(broker, "publish", "has space", "data")
    assert done.returncode == 2 and "event" in done.stderr
    done = mqks(broker, "eval", "1 +")
    assert done.returncode == 1 and "error" in done.stderr


def test_mqks_says_when_the_broker_is_unreachable() -> None:
    done = subprocess.run([str(MQKS), "ping", "--port", str(free_port()), "--timeout", "0.5"],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS)
    assert done.returncode == 1 and "cannot connect" in done.stderr


def fill_queue(server: Broker, queue: str, event: str, count: int) -> None:
    """Bind `queue` to `event` and leave `count` messages waiting in it."""
    wire = server.wire()
    try:
        wire.send(f"r1 rebind --confirm {queue} {event}".encode())
        wire.expect(b"r1 ok ")
        wire.send(*(f"m{n} publish {event} waiting {n}".encode() for n in range(count)))
        wire.barrier()
    finally:
        wire.close()


def test_stats_py_prints_a_table_with_top_queues(broker: Broker) -> None:
    queue, event = unique("q"), unique("e")
    fill_queue(broker, queue, event, 3)
    done = stats_py(broker)
    assert done.returncode == 0, done.stderr
    for label in ("messages published", "messages queued", "messages consumed", "queues", "consumers",
                  "messages waiting in queues", "messages waiting for ack", "clients", "events subscribed",
                  "worker 0", "total", "top 10 queues by depth"):
        assert label in done.stdout
    top = done.stdout.split("top 10 queues by depth:")[1]
    assert any(line.split() == ["3", queue] for line in top.splitlines())


def test_stats_py_json_sums_workers(make_broker: Callable[..., Broker]) -> None:
    server = make_broker("--eval", "--workers", "2")
    queues = [unique("q") for _ in range(6)]  # enough that both workers own some
    for queue in queues:
        fill_queue(server, queue, f"{queue}-e", 2)
    done = stats_py(server, "--json")
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert [worker["worker"] for worker in figures["workers"]] == [0, 1]
    for key in ("queued", "queues", "messages_waiting", "events"):
        assert figures["total"][key] == sum(worker[key] for worker in figures["workers"])
    assert figures["total"]["messages_waiting"] == 12
    assert figures["total"]["published"] == figures["workers"][0]["published"] == 12
    assert {(row["queue"], row["depth"]) for row in figures["top_queues"]} == {(queue, 2) for queue in queues}
    table = stats_py(server).stdout
    assert "worker 0" in table and "worker 1" in table


def test_stats_py_says_how_to_enable_eval(make_broker: Callable[..., Broker]) -> None:
    server = make_broker()
    done = stats_py(server)
    assert done.returncode != 0
    assert "--eval" in done.stderr
    done = mqks(server, "stats")
    assert done.returncode != 0 and "--eval" in done.stderr


def test_mqks_stats_reuses_the_stats_view(broker: Broker) -> None:
    done = mqks(broker, "stats", "--json")
    assert done.returncode == 0, done.stderr
    assert "total" in json.loads(done.stdout)
    assert "messages waiting for ack" in mqks(broker, "stats").stdout


def test_stats_py_watch_prints_again_until_interrupted(broker: Broker) -> None:
    proc = subprocess.Popen([sys.executable, str(STATS_PY), "--port", str(broker.port), "--watch", "0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    try:
        stdout = LineReader(proc.stdout)
        headers = 0
        while headers < 2:
            headers += stdout.line().startswith("MQKS ")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(RUN_TIMEOUT_SECONDS) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()

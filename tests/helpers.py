"""Helpers the test modules share: free ports, unique names, polling with a deadline, `stats` and `queues`
readings, `_eval`, RSS, and the Python client's test doubles (an inbox callback, a client with test timeouts).

Nothing here sleeps and hopes: how to wait is waiting.py's (`wait_for`, re-exported here with
WAIT_SECONDS and `wait_until`). Readings that can be missing (an RSS, an `_eval` answer) fail loudly
instead of returning a default that an assertion would accept.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import random
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from waiting import wait_until

from mqks.client import Client, Message
from mqks.server.dispatch.slots import owner_of

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
MQKS = Path(sys.executable).parent / "mqks"  # the console script pip installed beside this Python
RUN_TIMEOUT_SECONDS = 30.0


_names = itertools.count()


_handed_out: set[int] = set()
# tests/run.sh runs two pytest processes side by side and gives them this directory: a port handed out by one is a
# file there, so the other never hands it out too (between the ask and the broker's bind, the port is free)
PORTS_DIR_ENV = "MQKS_TEST_PORTS_DIR"
# below the kernel's ephemeral range (32768-60999), and below `mqks nats up`'s (20000-32000): a cluster node on a
# port the kernel had handed out could not bind it once an outgoing connection took it first (CI, under the Spark
# tier: "cannot listen on 127.0.0.1:43999: Address already in use")
TEST_PORTS = (10000, 19999)


def free_port() -> int:
    """A port nobody listens on right now, outside the ranges the kernel and `mqks nats up` hand out, and never the
    same one twice in a run: two asks in a row may get the same port back (CI once got --tls-port equal to
    --port), and two runs side by side may too (PORTS_DIR_ENV)."""
    shared = os.environ.get(PORTS_DIR_ENV)
    while True:
        port = random.randint(*TEST_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        if shared:
            try:
                os.close(os.open(os.path.join(shared, str(port)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue
        return port


def unique(prefix: str) -> str:
    """A queue or event name no other test of this run uses: module brokers are shared."""
    return f"{prefix}-{os.getpid()}-{next(_names)}"


def unique_bytes(prefix: str) -> bytes:
    """`unique` as bytes, for wire transcripts."""
    return unique(prefix).encode()


def queue_owned_by(worker: int, workers: int, prefix: str = "q") -> str:
    """A fresh queue name that worker `worker` of `workers` owns (server/dispatch/slots.py's map)."""
    while True:
        name = unique(prefix)
        if owner_of(name.encode(), workers) == worker:
            return name


class Inbox:
    """A consumer callback that records messages; `handle` decides what to do with each (`ack=True`: ack it)."""

    def __init__(self, handle: Callable[[Message], object] | None = None, ack: bool = False) -> None:
        self.messages: list[Message] = []
        self.handle = handle
        self.ack = ack

    def __call__(self, message: Message) -> None:
        self.messages.append(message)
        if self.handle is not None:
            self.handle(message)
        if self.ack:
            message.ack()

    def wait(self, count: int) -> list[Message]:
        wait_until(lambda: len(self.messages) >= count, f"{count} messages, have {self.messages}")
        return self.messages


def make_client(server: Any, **options: Any) -> Client:
    """A connected client of `server` (a BrokerProcess, or a port on 127.0.0.1) with the tests' timeouts.

    Frequent pings exercise the keepalive; a generous pong timeout keeps a loaded CI machine from
    seeing a dead connection where there is none.
    """
    settings: dict[str, Any] = {"ping_seconds": 0.5, "ping_timeout_seconds": 5.0, "timeout_seconds": 5.0,
                                "reconnect_max_seconds": 0.2}
    settings.update(options)
    host, port = ("127.0.0.1", server) if isinstance(server, int) else (server.host, server.port)
    return Client(host, port, **settings).connect()


def eval_value(broker, code: str, worker: int | None = None, owner: str | bytes | None = None) -> Any:
    """`_eval` `code` on a fresh connection to `broker` (started with --eval) and return the value.

    `worker`: on that worker; `owner`: on the worker that owns that queue (`state` is its queues).
    """
    flag = f"--worker={worker} " if worker is not None else ""
    if owner is not None:
        flag = f"--owner={owner.decode() if isinstance(owner, bytes) else owner} "
    wire = broker.wire()
    try:
        wire.send(f"ev _eval {flag}{code}".encode())
        line = wire.recv_line()
    finally:
        wire.close()
    assert line.startswith(b"ev ok "), f"_eval {code!r} failed: {line!r}"
    return ast.literal_eval(line[len(b"ev ok "):].decode())


def eval_on(wire, code: bytes) -> bytes:
    """`_eval` `code` on an open connection and return the answer's data, raw (a barrier as well)."""
    wire.send(b"ev _eval " + code)
    line = wire.recv_line()
    assert line.startswith(b"ev ok "), f"_eval {code!r} failed: {line!r}"
    return line[len(b"ev ok "):]


def stats_on(wire, worker: int | None = None) -> dict:
    """The `stats` answer on an open connection: every worker's figures, or worker `worker`'s."""
    wire.send(b"st stats" if worker is None else b"st stats --worker=%d" % worker)
    line = wire.recv_line()
    assert line.startswith(b"st ok "), f"stats failed: {line!r}"
    return json.loads(line[len(b"st ok "):])


def server_stats(broker, worker: int | None = None) -> dict:
    """`stats_on` over a fresh connection to `broker`."""
    wire = broker.wire()
    try:
        return stats_on(wire, worker)
    finally:
        wire.close()


def queue_row_on(wire, queue: str | bytes) -> dict | None:
    """The `queues {queue}` row of one queue on an open connection (a barrier as well), or None if there is none."""
    name = queue.encode() if isinstance(queue, str) else queue
    wire.send(b"qr queues " + name)
    rows = []
    while (line := wire.recv_line()) != b"qr ok --end":
        assert line.startswith(b"qr ok "), f"queues {name!r} failed: {line!r}"
        rows.append(json.loads(line[len(b"qr ok "):]))
    assert len(rows) <= 1, rows
    return rows[0] if rows else None


def queue_row(broker, queue: str | bytes) -> dict | None:
    """`queue_row_on` over a fresh connection to `broker`."""
    wire = broker.wire()
    try:
        return queue_row_on(wire, queue)
    finally:
        wire.close()


def mqks(server: Any, *args: str) -> subprocess.CompletedProcess:
    """Run `mqks ARGS --port P` against `server` to the end."""
    if not MQKS.exists():
        raise AssertionError(f"{MQKS} is missing: run `pip install -e .` in {REPO}")
    return subprocess.run([str(MQKS), *args, "--port", str(server.port)], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_SECONDS)


def mqks_nats(*args: str) -> subprocess.CompletedProcess:
    """Run `mqks nats ARGS` (a local NATS cluster, the cluster extra) to the end."""
    return subprocess.run([str(MQKS), "nats", *args], capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS)


def rss_bytes(pid: int) -> int:
    """VmRSS of a live process; raises if there is none (a zombie or a gone process has no RSS)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}: the process has exited")


def read_a_while(wire, lines: int = 200, quiet_seconds: float = 0.5) -> None:
    """Read and drop up to `lines` lines, stopping early once none comes for `quiet_seconds`: a step of a
    `wait_for` that drains a consumer until the broker shows the effect."""
    try:
        for _ in range(lines):
            wire.recv_line(timeout=quiet_seconds)
    except TimeoutError:
        pass  # all read


def http_get(port: int, path: str) -> tuple[int, bytes]:
    """GET http://127.0.0.1:{port}{path}: (status, body), an error status included."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()

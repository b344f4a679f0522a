"""Helpers the test modules share: free ports, unique names, polling with a deadline, `_eval`, RSS.

Nothing here sleeps and hopes: `wait_for` polls a condition until a deadline and fails naming
what it waited for. Readings that can be missing (an RSS, an `_eval` answer) fail loudly
instead of returning a default that an assertion would accept.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

WAIT_SECONDS = 10.0

_names = itertools.count()


def free_port() -> int:
    """Ask the kernel for a port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def unique(prefix: str) -> str:
    """A queue or event name no other test of this run uses: module brokers are shared."""
    return f"{prefix}-{os.getpid()}-{next(_names)}"


def unique_bytes(prefix: str) -> bytes:
    """`unique` as bytes, for wire transcripts."""
    return unique(prefix).encode()


def wait_for(condition: Callable[[], T], what: str, timeout: float = WAIT_SECONDS, interval: float = 0.05) -> T:
    """Poll `condition()` until it returns something truthy and return that; fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


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


def server_stats(broker, worker: int | None = None) -> dict:
    """The `stats` answer: every worker's figures, or worker `worker`'s (`stats --worker=N`)."""
    wire = broker.wire()
    try:
        wire.send(b"st stats" if worker is None else b"st stats --worker=%d" % worker)
        line = wire.recv_line()
    finally:
        wire.close()
    assert line.startswith(b"st ok "), f"stats failed: {line!r}"
    return json.loads(line[len(b"st ok "):])


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

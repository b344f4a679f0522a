"""Shared fixtures: a real `mqksd` subprocess on a free port, and a line-level wire client.

Tests talk to the broker over TCP exactly as `nc` would. Nothing here sleeps and hopes:
every wait polls with a deadline or blocks on a socket with a timeout. Helpers that need no
fixture (free ports, unique names, polling, `_eval`, RSS) live in helpers.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_port, mqks_nats
from tls_certs import Certs, make_certs
from waiting import wait_for

__all__ = ["READY_TIMEOUT_SECONDS", "REPLY_TIMEOUT_SECONDS", "BrokerProcess", "Wire", "free_port"]

READY_TIMEOUT_SECONDS = 15.0
# a broker on a replicated log waits up to STARTING_NATS_SECONDS (30) for a NATS started a moment ago to elect
# its stream's leader; CI once took more than 15 s for that while the Spark tier shared the cores
READY_ON_NATS_SECONDS = 45.0
REPLY_TIMEOUT_SECONDS = 5.0


class Wire:
    """A blocking line client for transcripts: send a line, expect a line."""

    def __init__(self, host: str, port: int, timeout: float = REPLY_TIMEOUT_SECONDS) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.timeout = timeout
        self.buffer = b""

    def send(self, *lines: bytes) -> None:
        self.sock.sendall(b"".join(line + b"\n" for line in lines))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv_line(self, timeout: float | None = None) -> bytes:
        """The next line without its newline; raises TimeoutError after `timeout`."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no line within {timeout or self.timeout}s; have {self.buffer[:200]!r}")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                raise ConnectionError(f"server closed the connection; have {self.buffer[:200]!r}")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    def expect(self, line: bytes, timeout: float | None = None) -> None:
        got = self.recv_line(timeout)
        assert got == line, f"expected {line!r}, got {got!r}"

    def expect_error(self, rid: bytes, reason_part: bytes = b"") -> bytes:
        """Read one line, check it is `{rid} error {error_id} ...reason_part...`; return it."""
        got = self.recv_line()
        parts = got.split(b" ", 3)
        assert parts[:2] == [rid, b"error"], f"expected an error for {rid!r}, got {got!r}"
        assert len(parts) >= 3 and parts[2], f"error without an error id: {got!r}"
        assert reason_part in got, f"expected {reason_part!r} in {got!r}"
        return got

    def barrier(self, token: bytes = b"barrier") -> list[bytes]:
        """Ping and collect every line before the pong: proves what did *not* arrive."""
        self.send(b"bar " + b"ping " + token)
        lines = []
        while True:
            line = self.recv_line()
            if line == b"bar ok " + token:
                return lines
            lines.append(line)

    def closed_by_server(self, timeout: float | None = None) -> bool:
        """True once the server has closed this connection (reads and drops anything pending)."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                if not self.sock.recv(1 << 20):
                    return True
            except TimeoutError:
                continue
            except OSError:
                return True
        return False

    def close(self) -> None:
        self.sock.close()


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started (a supervisor's workers), from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        children.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return children


class BrokerProcess:
    """One `mqksd` subprocess; can be stopped, killed, frozen and restarted on the same port."""

    def __init__(self, *args: str, port: int | None = None, log_to_pipe: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.env = {**os.environ, **env} if env else None  # added to the test's environment (credentials)
        # a pipe instead of the file: a test that limits the broker's file size (a "full disk") still reads its log
        self.log_to_pipe = log_to_pipe
        self.piped_log: list[bytes] = []
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        # a file, not a pipe: a pipe nobody reads fills up and would freeze the server
        # a path, not an open file object: one left open to the end of the run warns (ResourceWarning), which the
        # tests that turn warnings into errors would blame on themselves
        with tempfile.NamedTemporaryFile(prefix="mqksd-", suffix=".log", delete=False) as log_file:
            self.log_path = log_file.name
        self.start()

    def start(self) -> None:
        cmd = [sys.executable, "-m", "mqks.server", "--port", str(self.port), *self.args]
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE if self.log_to_pipe else log_file, env=self.env)
        if self.log_to_pipe:
            threading.Thread(target=self.piped_log.extend, args=(self.proc.stderr,), daemon=True).start()
        timeout = READY_ON_NATS_SECONDS if "--log" in self.args else READY_TIMEOUT_SECONDS
        try:
            wait_for(self.answers_ping, "mqksd to answer ping", timeout, interval=0.02)
        except AssertionError as e:  # what the broker was doing is the only clue a CI run leaves
            raise AssertionError(f"{e}; its log:\n{self.log()[-4000:]}") from None

    def answers_ping(self) -> bool:
        """True once the server answers a ping; raises if it has exited."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"mqksd exited {self.proc.returncode}: {self.log()}")
        try:
            wire = self.wire()
        except OSError:
            return False
        try:
            wire.send(b"ready ping")
            wire.expect(b"ready ok ")
            return True
        except OSError:  # a broker that is stopping (a worker that cannot start) may reset it
            return False
        finally:
            wire.close()

    def log(self) -> str:
        """Everything the server has logged so far."""
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read() + b"".join(self.piped_log).decode(errors="replace")

    def wire(self) -> Wire:
        return Wire(self.host, self.port)

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        assert self.proc is not None
        workers: list[int] = []
        if self.proc.poll() is None:
            workers = child_pids(self.proc.pid)
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()
        # with --workers N the workers die with their supervisor, a moment after it
        wait_for(lambda: not any(os.path.exists(f"/proc/{pid}/fd") for pid in workers),
                 "the killed broker's workers to be gone", READY_TIMEOUT_SECONDS)

    def restart(self) -> None:
        self.start()

    def pids(self) -> list[int]:
        """The server's processes: mqksd, and with --workers N its N workers."""
        assert self.proc is not None
        return [self.proc.pid, *child_pids(self.proc.pid)]


CALL_FAILED = pytest.StashKey[bool]()

# The tiers (pytest.ini's markers), one folder each: a test's place says its tier. `pytest -m unit` runs in process in
# seconds, the others need real parts. The helpers every tier shares (helpers.py, waiting.py, cluster_harness.py, ...)
# stay here, beside this file, whose folder pytest puts on sys.path.
TIERS = ("unit", "e2e", "cluster", "spark", "browser")


def tier_of(item: pytest.Item) -> str:
    """unit (tests/unit/), e2e (real brokers), cluster (NATS servers and nodes), spark (a JVM), browser (Chromium)."""
    folder = Path(str(item.fspath)).relative_to(Path(__file__).parent).parts[0]
    if folder not in TIERS:
        raise pytest.UsageError(f"{item.fspath}: a test lives in the folder of its tier ({', '.join(TIERS)})")
    return folder


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(tier_of(item))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[pytest.TestReport]:
    """Remember whether a test's body failed, for fixtures that explain a failure in their teardown."""
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    return report


@pytest.fixture
def nats_cluster(tmp_path) -> Iterator[tuple[Path, list[str]]]:
    """Three NATS JetStream nodes on loopback through `mqks nats up` (the cluster extra): (their dir, URLs).
    Always down at the end, whatever the test did to them."""
    yield from three_nats_nodes(tmp_path)


@pytest.fixture(scope="module")
def shared_nats_cluster(tmp_path_factory) -> Iterator[tuple[Path, list[str]]]:
    """nats_cluster for a whole module whose tests kill no NATS node (each names its own MQKS cluster)."""
    yield from three_nats_nodes(tmp_path_factory.mktemp("shared"))


def three_nats_nodes(tmp_path: Path) -> Iterator[tuple[Path, list[str]]]:
    pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")
    directory = tmp_path / "nats"
    done = mqks_nats("up", "--nodes", "3", "--dir", str(directory))
    assert done.returncode == 0, done.stderr
    yield directory, done.stdout.splitlines()[0].split(",")
    if (directory / "cluster.json").exists():
        # a node that took a test's kills may spend its whole 10 s shutdown grace: its files are not read again
        mqks_nats("down", "--dir", str(directory), "--timeout", "1")


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Certs:
    """A test CA and a broker certificate for localhost (tls_certs.py), made once per run."""
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def broker(request) -> Iterator[BrokerProcess]:
    """One broker per test module, with `_eval` on (tests read its state through it).

    Every test on it runs twice: with one worker process, and with two, where any line may
    land on a worker that does not own its queue (the public port reaches either).
    """
    server = BrokerProcess("--eval", "--workers", str(request.param))
    yield server
    server.kill()


broker_per_worker_count = broker  # the older name, kept by tests that are about placement


@pytest.fixture
def make_broker() -> Iterator:
    """A factory for brokers with their own flags; all are killed after the test."""
    started: list[BrokerProcess] = []

    def make(*args: str, port: int | None = None, log_to_pipe: bool = False,
             env: dict[str, str] | None = None) -> BrokerProcess:
        server = BrokerProcess(*args, port=port, log_to_pipe=log_to_pipe, env=env)
        started.append(server)
        return server

    yield make
    errors = []
    for server in started:  # every one is killed, whatever one kill raises
        try:
            server.kill()
        except Exception as e:  # raised below, once the others are dead
            errors.append(e)
    if errors:
        raise errors[0]


@pytest.fixture
def wire(broker: BrokerProcess) -> Iterator[Wire]:
    conn = broker.wire()
    yield conn
    conn.close()

"""The `mqks` console script and `python stats.py`, run as subprocesses the way a user runs them.

The broker's state is set up and checked with wire transcripts (conftest `Wire`); every read from a
subprocess has a deadline.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO

import pytest
from conftest import BrokerProcess, free_port
from helpers import MQKS, REPO, RUN_TIMEOUT_SECONDS, mqks, queue_row, unique

STATS_PY = REPO / "stats.py"
CLIENT_DOC = REPO / "docs" / "client.md"
LINE_TIMEOUT_SECONDS = 10.0


def test_the_readme_python_example_runs_as_written(broker: BrokerProcess) -> None:
    """The README's ten lines, run against a real broker (its port in place of 25000)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    example = readme.split("## The Python client in ten lines")[1].split("```python\n")[1].split("```")[0]
    assert len(example.splitlines()) <= 10, example
    script = example.replace("25000", str(broker.port)).replace(
        "client.close()", "assert done.is_set(), 'no message within 5 s'\nclient.close()")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "user.1.created hi there\n"


def readme_example(heading: str, language: str = "python", index: int = 1) -> str:
    """The `index`-th ```language block after `heading` in the README."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    return readme.split(heading)[1].split(f"```{language}\n")[index].split("```")[0]


def test_the_readme_examples_run_in_order_beside_the_hello_world_sessions(broker: BrokerProcess) -> None:
    """Hello world's four sessions answer as printed and stay open (consuming); then the Python example and the
    asyncio one, as printed, each print their message: before issue 39 they shared the nc users' queue, and
    Alice or Bob took it (the gevent example printed nothing, the asyncio one hung)."""
    hello = readme_example("## Hello world", language="", index=1)
    sessions = {}
    for line in hello.strip().splitlines():
        name = line.split(" ")[0]
        sessions[name] = broker.wire()
        sessions[name].send(line.encode())
        if name != "Dave":  # a person types the next line once this one ran: a ping on the same session proves it
            assert sessions[name].barrier() == []
    assert sessions["Charlie"].recv_line() == b"Charlie ok Dave event=hello world"
    # Dave's publish has run (Charlie has its copy): a ping on each of Alice and Bob comes after theirs
    got = {name: sessions[name].barrier() for name in ("Alice", "Bob")}
    assert got in ({"Alice": [b"Alice ok Dave event=hello world"], "Bob": []},
                   {"Alice": [], "Bob": [b"Bob ok Dave event=hello world"]}), got
    try:
        for heading, index in (("## The Python client in ten lines", 1), ("## The Python client in ten lines", 2)):
            script = readme_example(heading, index=index).replace("25000", str(broker.port))
            done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                  timeout=RUN_TIMEOUT_SECONDS)
            assert done.returncode == 0, done.stderr
            assert done.stdout == "user.1.created hi there\n", (index, done.stdout, done.stderr)
    finally:
        for wire in sessions.values():
            wire.close()


def stats_py(server: BrokerProcess, *args: str) -> subprocess.CompletedProcess:
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
def consumer_process(broker: BrokerProcess) -> Iterator[Callable[..., tuple[subprocess.Popen, LineReader]]]:
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


def test_mqks_ping_prints_the_answer(broker: BrokerProcess) -> None:
    done = mqks(broker, "ping")
    assert (done.returncode, done.stdout) == (0, "pong\n"), done.stderr
    done = mqks(broker, "ping", "hello there")
    assert done.stdout == "hello there\n"


def test_mqks_ping_takes_the_rest_of_the_line_as_data(broker: BrokerProcess) -> None:
    done = mqks(broker, "ping", "hello", "there")
    assert (done.returncode, done.stdout) == (0, "hello there\n"), done.stderr


def test_mqks_version_is_the_package_version() -> None:
    done = subprocess.run([str(MQKS), "--version"], capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS)
    assert (done.returncode, done.stdout) == (0, f"mqks {importlib.metadata.version('mqks')}\n"), done.stderr


def test_connection_options_work_before_and_after_the_command(broker: BrokerProcess) -> None:
    before = subprocess.run([str(MQKS), "--port", str(broker.port), "ping", "before"], capture_output=True, text=True,
                            timeout=30)
    after = subprocess.run([str(MQKS), "ping", "after", "--port", str(broker.port)], capture_output=True, text=True,
                           timeout=30)
    assert (before.returncode, before.stdout) == (0, "before\n"), before.stderr
    assert (after.returncode, after.stdout) == (0, "after\n"), after.stderr


def test_mqks_consume_sees_what_mqks_publish_sends(broker: BrokerProcess, consumer_process) -> None:
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


def test_mqks_consume_manual_ack_acks_what_it_printed(broker: BrokerProcess, consumer_process) -> None:
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


def test_mqks_publish_refuses_bad_input_and_reports_broker_errors(broker: BrokerProcess) -> None:
    done = mqks(broker, "publish", "has space", "data")
    assert done.returncode == 2 and "event" in done.stderr
    done = mqks(broker, "eval", "1 +")
    assert done.returncode == 1 and "error" in done.stderr


def test_mqks_says_when_the_broker_is_unreachable() -> None:
    done = subprocess.run([str(MQKS), "ping", "--port", str(free_port()), "--timeout", "0.5"],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS)
    assert done.returncode == 1 and "cannot connect" in done.stderr


def test_mqks_ping_a_closed_port_says_connection_refused_without_verbose() -> None:
    port = free_port()
    # the default --timeout (10 s): the refusal is reported as it happens, not after the timeout
    done = subprocess.run([str(MQKS), "ping", "--port", str(port)], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_SECONDS)
    assert done.returncode == 1
    assert done.stderr == f"mqks ping: cannot connect to 127.0.0.1:{port}: Connection refused\n"


@pytest.fixture
def http_server() -> Iterator[int]:
    """A port that answers any line like an HTTP server refusing it, then closes: not an MQKS broker."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(LINE_TIMEOUT_SECONDS)
                try:
                    conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/html\r\nContent-Length: 11\r\n"
                                 b"Connection: close\r\n\r\nBad Request")
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(LINE_TIMEOUT_SECONDS)
    listener.close()


def test_mqks_says_in_one_line_when_the_peer_does_not_speak_mqks(http_server: int) -> None:
    done = subprocess.run([str(MQKS), "ping", "--port", str(http_server)], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_SECONDS)
    assert done.returncode == 1
    assert done.stderr == (f"mqks ping: 127.0.0.1:{http_server} does not speak MQKS "
                           "(it answered 'HTTP/1.1 400 Bad Request')\n")


def test_mqks_eval_with_eval_off_exits_3(make_broker: Callable[..., BrokerProcess]) -> None:
    server = make_broker()
    done = mqks(server, "eval", "1 + 1")
    assert done.returncode == 3 and "--eval" in done.stderr, done.stderr


def test_the_docs_document_every_exit_code_of_mqks() -> None:
    from mqks.client import cli

    codes = {value for name, value in vars(cli).items() if name.startswith("EXIT_")}
    section = CLIENT_DOC.read_text(encoding="utf-8").split("## The `mqks` command")[1].split("\n## ")[0]
    documented = {int(code) for code in re.findall(r"^\| `(\d+)` \|", section, re.MULTILINE)}
    assert documented == codes


def test_mqks_publish_json_sends_data_with_newlines_as_one_line(broker: BrokerProcess, consumer_process) -> None:
    queue, event = unique("q"), unique("e")
    _, stdout = consumer_process(queue, event)
    done = mqks(broker, "publish", event, "a\nb")
    assert done.returncode == 2
    assert "--json" in done.stderr and "json=True" not in done.stderr
    done = mqks(broker, "publish", event, '{"text": "a\\nb",\n "n": 1}', "--json", "--confirm")
    assert done.returncode == 0, done.stderr
    msg_id = done.stdout.strip()
    line = stdout.line()
    prefix = f"{msg_id} event={event} "
    assert line.startswith(prefix) and json.loads(line[len(prefix):]) == {"text": "a\nb", "n": 1}
    done = mqks(broker, "publish", event, "not json", "--json")
    assert done.returncode == 2 and "JSON" in done.stderr


def test_mqks_consume_exits_once_stdout_is_closed_and_leaves_later_messages_queued(
        broker: BrokerProcess, consumer_process) -> None:
    queue, event = unique("q"), unique("e")
    proc, stdout = consumer_process(queue, event)
    assert mqks(broker, "publish", event, "first").returncode == 0
    assert stdout.line().endswith(f"event={event} first")
    proc.stdout.close()  # what `| head -1` does once it has its line
    assert proc.wait(RUN_TIMEOUT_SECONDS) == 0
    assert b"Traceback" not in proc.stderr.read()
    assert mqks(broker, "publish", event, "after").returncode == 0
    wire = broker.wire()
    try:
        wire.send(f"c1 consume --confirm {queue}".encode())
        wire.expect(b"c1 ok ")
        # the consumer gone with the pipe did not swallow it
        assert wire.recv_line().endswith(f" event={event} after".encode())
    finally:
        wire.close()


def test_mqks_consume_manual_ack_never_acks_what_was_not_printed(broker: BrokerProcess, consumer_process) -> None:
    queue, event = unique("q"), unique("e")
    proc, stdout = consumer_process(queue, event, "--manual-ack")
    assert mqks(broker, "publish", event, "printed").returncode == 0
    assert stdout.line().endswith(f"event={event} printed")
    proc.stdout.close()
    # published while the pipe closes: delivered to the consumer or not, it is never printed
    assert mqks(broker, "publish", event, "unprinted").returncode == 0
    assert proc.wait(RUN_TIMEOUT_SECONDS) == 0
    wire = broker.wire()
    try:
        wire.send(f"c1 consume --confirm {queue}".encode())
        wire.expect(b"c1 ok ")
        # "printed" was acked; "unprinted" is back (retry=1 if it had been delivered), and alone
        parts = wire.recv_line().split(b" ")
        assert parts[3].split(b",")[0] == f"event={event}".encode() and parts[4:] == [b"unprinted"]
        assert wire.barrier() == []
    finally:
        wire.close()


def test_stats_py_run_by_a_python_without_mqks_says_what_to_run() -> None:
    # -S: no site-packages, so neither mqks nor gevent, as with the system python3 in a checkout
    done = subprocess.run([sys.executable, "-S", str(STATS_PY)], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_SECONDS, cwd=REPO)
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith("stats.py: ") and "cannot import" in line and "stats.py" in line.split(";")[1]


def fill_queue(server: BrokerProcess, queue: str, event: str, count: int) -> None:
    """Bind `queue` to `event` and leave `count` messages waiting in it."""
    wire = server.wire()
    try:
        wire.send(f"r1 rebind --confirm {queue} {event}".encode())
        wire.expect(b"r1 ok ")
        wire.send(*(f"m{n} publish {event} waiting {n}".encode() for n in range(count)))
        wire.barrier()
    finally:
        wire.close()


def test_stats_py_prints_a_table_with_top_queues(broker: BrokerProcess) -> None:
    queue, event = unique("q"), unique("e")
    fill_queue(broker, queue, event, 3)
    done = stats_py(broker)
    assert done.returncode == 0, done.stderr
    for label in ("messages published", "messages queued", "messages consumed", "queues", "consumers",
                  "messages waiting in queues", "messages waiting for ack", "clients", "events subscribed",
                  "connections", "bytes received", "bytes sent", "errors answered", "version", "total",
                  "top 10 queues by depth"):
        assert label in done.stdout
    top = done.stdout.split("top 10 queues by depth:")[1]
    assert any(line.split() == ["3", queue] for line in top.splitlines())


def test_stats_py_json_is_the_brokers_sum_of_its_workers(make_broker: Callable[..., BrokerProcess]) -> None:
    server = make_broker("--workers", "2")  # no --eval: the stats action needs none
    queues = [unique("q") for _ in range(6)]  # enough that both workers own some
    for queue in queues:
        fill_queue(server, queue, f"{queue}-e", 2)
    done = stats_py(server, "--json")
    assert done.returncode == 0, done.stderr
    total = json.loads(done.stdout)
    per_worker = [json.loads(stats_py(server, "--json", "--worker", str(n)).stdout) for n in (0, 1)]
    assert [figures["worker"] for figures in per_worker] == [0, 1]
    for key in ("queued", "queues", "messages_waiting"):
        assert total[key] == sum(figures[key] for figures in per_worker)
    assert total["messages_waiting"] == 12
    assert total["published"] == 12
    assert {(queue, depth) for queue, depth in total["top_queues"]} == {(queue, 2) for queue in queues}
    table = stats_py(server).stdout
    assert "worker 0" in table and "worker 1" in table


STATS_KEYS = {"published", "queued", "consumed", "acked", "rejected", "queues", "consumers", "messages_waiting",
              "messages_unacked", "clients", "events", "top_queues", "workers", "version", "uptime_seconds",
              "connections", "bytes_in", "bytes_out", "errors"}


def test_mqks_stats_json_works_on_a_default_broker(make_broker: Callable[..., BrokerProcess]) -> None:
    server = make_broker()  # no --eval
    queue, event = unique("q"), unique("e")
    fill_queue(server, queue, event, 2)
    done = mqks(server, "stats", "--json")
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures.keys() >= STATS_KEYS
    assert (figures["messages_waiting"], figures["top_queues"]) == (2, [[queue, 2]])
    table = stats_py(server)
    assert table.returncode == 0 and "messages waiting for ack" in table.stdout, table.stderr


def test_mqks_stats_json_prints_an_error_object_on_failure() -> None:
    port = free_port()
    for args in (["stats", "--json"], ["stats", "--json", "--watch", "0"], ["stats", "--json", "--bogus"]):
        done = subprocess.run([str(MQKS), *args, "--port", str(port)], capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_SECONDS)
        assert done.returncode != 0, args
        assert list(json.loads(done.stdout)) == ["error"], (args, done.stdout)
    assert "Connection refused" in json.loads(subprocess.run(
        [str(MQKS), "stats", "--json", "--port", str(port)], capture_output=True, text=True,
        timeout=RUN_TIMEOUT_SECONDS).stdout)["error"]


def test_mqks_queues_prints_a_table_after_traffic(broker: BrokerProcess) -> None:
    prefix = unique("tq")
    waiting, consumed = f"{prefix}.waiting", f"{prefix}.consumed"
    fill_queue(broker, waiting, f"{prefix}-e1", 3)
    wire = broker.wire()
    try:
        # one message delivered and held un-acked by a consumer of a delete-when-unused queue
        wire.send(f"c1 consume --confirm {consumed} {prefix}-e2 --manual-ack --delete-queue-when-unused".encode())
        wire.expect(b"c1 ok ")
        wire.send(f"m1 publish {prefix}-e2 one".encode())
        wire.expect(f"c1 ok m1 event={prefix}-e2 one".encode())
        done = mqks(broker, "queues", f"{prefix}.*")
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0].split() == ["queue", "depth", "unacked", "leased", "consumers", "bindings", "flags"]
        rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
        assert rows == {waiting: ["3", "0", "0", "0", "1"],
                        consumed: ["0", "1", "0", "1", "1", "--delete-queue-when-unused"]}
        [detail] = json.loads(mqks(broker, "queues", "--detail", consumed, "--json").stdout)
        assert detail["events"] == [f"{prefix}-e2"] and detail["newest"] == []
        assert [(c["manual_ack"], c["unacked"]) for c in detail["consumer_list"]] == [(True, 1)]
        shown = mqks(broker, "queues", "--detail", waiting).stdout
        assert f"{waiting}:" in shown and f"bindings: {prefix}-e1" in shown and "consumers: (none)" in shown
        assert shown.count("(retry 0)") == 3  # its three waiting messages, newest first, with event and data
        assert f"(retry 0) event={prefix}-e1 " in shown, shown
    finally:
        wire.close()
    as_json = json.loads(mqks(broker, "queues", waiting, "--json").stdout)
    assert as_json == [{"queue": waiting, "depth": 3, "unacked": 0, "leased": 0, "consumers": 0, "bindings": 1,
                        "flags": []}]


def test_stats_py_watch_prints_again_until_interrupted(broker: BrokerProcess) -> None:
    proc = subprocess.Popen([sys.executable, str(STATS_PY), "--port", str(broker.port), "--watch", "0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    try:
        stdout = LineReader(proc.stdout)
        headers = 0
        while headers < 2:
            headers += stdout.line().startswith("MQKS ")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(RUN_TIMEOUT_SECONDS) == 0
        assert proc.stderr.read() == b""  # no stray KeyboardInterrupt, no traceback
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize("command", ["stats.py", "mqks stats"])
def test_ctrl_c_on_a_watch_of_a_frozen_broker_ends_at_once_and_quietly(make_broker, command: str) -> None:
    # issue 24.3: Ctrl-C printed a stray KeyboardInterrupt, and with a broker that stopped answering
    # the watch waited out its timeout; with --timeout 120 it must end long before that could
    server = make_broker()
    program = [sys.executable, str(STATS_PY)] if command == "stats.py" else [str(MQKS), "stats"]
    proc = subprocess.Popen([*program, "--port", str(server.port), "--watch", "0.1", "--timeout", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    try:
        stdout = LineReader(proc.stdout)
        while not stdout.line().startswith("MQKS "):
            pass
        server.signal(signal.SIGSTOP)  # frozen: the next stats is never answered
        try:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(RUN_TIMEOUT_SECONDS) == 0
        finally:
            server.signal(signal.SIGCONT)
        assert proc.stderr.read() == b""
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


ANSI = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[()][0-9A-B]|\x1b[=>]")


class Terminal:
    """`mqks top` in a pseudo-terminal of 120x40: its screen as text, keys sent to it."""

    def __init__(self, server: BrokerProcess, *args: str) -> None:
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        env = {name: value for name, value in os.environ.items() if name not in ("COLUMNS", "LINES")}
        env["TERM"] = "xterm-256color"
        self.proc = subprocess.Popen([str(MQKS), "top", "--port", str(server.port), *args], stdin=self.slave,
                                     stdout=self.slave, stderr=self.slave, env=env)
        self.screen = b""

    def frames(self) -> list[str]:
        """Every frame drawn so far, without escape codes; each starts at the header."""
        return ANSI.sub(b"", self.screen).decode(errors="replace").split("MQKS 127.0.0.1:")[1:]

    def wait_for_frame(self, condition: Callable[[str], object], what: str) -> str:
        """Read the screen until a frame satisfies `condition`; that frame."""
        deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
        seen = 0
        while True:
            frames = self.frames()
            for frame in frames[max(0, seen - 1):]:  # the last one may have been partial
                if condition(frame):
                    return frame
            seen = len(frames)
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                tail = frames[-1] if frames else self.screen[-2000:].decode(errors="replace")
                raise AssertionError(f"no frame with {what} (exit {self.proc.poll()}); last:\n{tail}")
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    self.screen += os.read(self.master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    pass

    def press(self, key: bytes) -> None:
        os.write(self.master, key)

    def wait(self) -> int:
        """The exit code, reading the screen meanwhile (a full pty would block the child)."""
        deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
        while self.proc.poll() is None and time.monotonic() < deadline:
            ready, _, _ = select.select([self.master], [], [], 0.05)
            if ready:
                try:
                    self.screen += os.read(self.master, 65536)
                except OSError:
                    pass
        return self.proc.wait(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.close(self.master)
        os.close(self.slave)


@pytest.fixture
def terminal(broker: BrokerProcess) -> Iterator[Callable[..., Terminal]]:
    started: list[Terminal] = []

    def start(server: BrokerProcess, *args: str) -> Terminal:
        started.append(Terminal(server, *args))
        return started[-1]

    yield start
    for term in started:
        term.close()


def rate_of(frame: str, label: str) -> float | None:
    """The per-second figure of a totals row (`published  30  60.5/s ...`), None while it is "-"."""
    match = re.search(rf"^{label}\s+\S+(?: \S+)?\s+([\d,.]+)(?: \S+)?/s", frame, re.MULTILINE)
    return float(match.group(1).replace(",", "")) if match else None


def test_mqks_purge_and_requeue_dead(broker: BrokerProcess) -> None:
    queue, event = unique("pq"), unique("e")
    wire = broker.wire()
    try:
        wire.send(f"c1 consume --confirm {queue} {event} --manual-ack --max-retries=0".encode())
        wire.expect(b"c1 ok ")
        for i in range(2):
            wire.send(f"m{i} publish {event} x".encode())
            wire.expect(f"c1 ok m{i} event={event} x".encode())
            wire.send(f"r{i} reject --confirm c1 m{i}".encode())
            wire.expect(f"r{i} ok ".encode())
        wire.send(b"d1 delete_consumer --confirm c1")
        wire.expect(b"d1 ok ")
        done = mqks(broker, "requeue-dead", queue, "m1")
        assert (done.returncode, done.stdout) == (0, f"moved 1 dead letters from {queue}.dead back to {queue}\n")
        done = mqks(broker, "purge", queue)
        assert (done.returncode, done.stdout) == (0, f"purged 1 messages from {queue}\n")
        assert mqks(broker, "requeue-dead", queue, "--limit", "5").stdout.startswith("moved 1 ")
        done = mqks(broker, "requeue-dead", queue, "m0", "--limit", "1")
        assert done.returncode == 2 and "not both" in done.stderr
    finally:
        wire.close()


def test_mqks_rebind_and_delete_queue_and_a_missing_queue_exits_1(broker: BrokerProcess) -> None:
    """`mqks rebind` makes a queue and sets (or adds to) its bindings, `mqks delete-queue` removes it; a
    delete-queue of a queue that is not there says so and exits 1 (a typo is not "deleted")."""
    queue = unique("mq")
    done = mqks(broker, "rebind", queue, "a.e", "b.*")
    assert (done.returncode, done.stdout) == (0, f"{queue}: 2 bindings\n"), done.stderr
    done = mqks(broker, "rebind", queue, "c.e", "--add")
    assert (done.returncode, done.stdout) == (0, f"{queue}: 3 bindings\n"), done.stderr
    assert queue_row(broker, queue)["bindings"] == 3
    done = mqks(broker, "delete-queue", queue)
    assert (done.returncode, done.stdout) == (0, f"deleted {queue}\n"), done.stderr
    assert queue_row(broker, queue) is None
    done = mqks(broker, "delete-queue", queue)
    assert (done.returncode, done.stdout) == (1, ""), done.stdout
    assert done.stderr == f"mqks delete-queue: no queue {queue!r} on the broker (mqks queues lists them)\n"


def test_mqks_purge_and_requeue_dead_of_a_missing_queue_move_0_as_the_client_does(broker: BrokerProcess) -> None:
    """One rule for the client and the CLI (issue 55): the broker answers 0 for a queue that is not there, and
    client.purge_queue returned 0 where `mqks purge` exited 1; `mqks requeue-dead orders` before any message died
    exited 1 ("no queue 'orders.dead'"). Both print 0 and exit 0, with a note naming the missing queue."""
    queue = unique("mq")
    done = mqks(broker, "purge", queue)
    assert (done.returncode, done.stdout) == (0, f"purged 0 messages from {queue} (there is no queue {queue!r})\n"), \
        done.stderr
    done = mqks(broker, "requeue-dead", queue)
    assert (done.returncode, done.stdout) == (
        0, f"moved 0 dead letters from {queue}.dead back to {queue} (there is no queue '{queue}.dead')\n"), done.stderr
    assert mqks(broker, "rebind", queue, "some.event").returncode == 0
    done = mqks(broker, "purge", queue)
    assert (done.returncode, done.stdout) == (0, f"purged 0 messages from {queue}\n"), done.stderr


@pytest.mark.parametrize("command, missing", [("publish", "EVENT"), ("consume", "QUEUE"), ("request", "EVENT"),
                                              ("rebind", "QUEUE")])
def test_a_missing_argument_names_only_what_is_required(command: str, missing: str) -> None:
    """argparse lists a positional with nargs="*" as required unless it has a default: `mqks publish` said
    "EVENT, DATA are required" though DATA may be empty."""
    done = subprocess.run([str(MQKS), command], capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS)
    assert done.returncode == 2
    assert done.stderr.rstrip().endswith(f"the following arguments are required: {missing}"), done.stderr


def test_mqks_top_shows_rates_and_busiest_queues_and_quits_on_q(broker: BrokerProcess, terminal) -> None:
    prefix = unique("top")
    deep, shallow = f"{prefix}-z", f"{prefix}-a"
    term = terminal(broker, prefix + "-*", "--interval", "0.5")
    # the first sample read (before it, every figure is "-"): no queue of this test yet
    term.wait_for_frame(lambda frame: "queues: 0 of 0" in frame and "up -" not in frame, "a first sample")
    fill_queue(broker, shallow, f"{shallow}-e", 1)
    fill_queue(broker, deep, f"{deep}-e", 30)

    def rates_shown(frame: str) -> bool:
        # in the same frame: the messages counted in the rates and the queues with their depth change
        return ((rate_of(frame, "published") or 0) > 0 and re.search(rf"^{deep}\s+30\s+\+[\d,.]+", frame, re.M)
                is not None and frame.index(deep) < frame.index(shallow))

    term.wait_for_frame(rates_shown, "a published rate and the queues by depth")
    term.press(b"n")
    term.wait_for_frame(lambda frame: "sort: name" in frame and shallow in frame and deep in frame
                        and frame.index(shallow) < frame.index(deep), "the queues by name")
    term.press(b"q")
    assert term.wait() == 0
    mode = termios.tcgetattr(term.slave)[3]
    assert mode & termios.ICANON and mode & termios.ECHO  # the terminal is back in its own mode


def test_mqks_top_quits_on_ctrl_c(make_broker: Callable[..., BrokerProcess], terminal) -> None:
    server = make_broker()  # a default broker: top needs no --eval
    term = terminal(server)
    term.wait_for_frame(lambda frame: "per second" in frame and "up -" not in frame, "a first sample")
    term.proc.send_signal(signal.SIGINT)
    assert term.wait() == 0


def test_mqks_top_without_rich_says_how_to_install_it(broker: BrokerProcess) -> None:
    code = ("import sys; sys.modules['rich'] = None; from mqks.client.cli import main; "
            f"sys.exit(main(['top', '--port', '{broker.port}']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS)
    assert done.returncode == 3
    assert '.venv/bin/pip install -e ".[top]"' in done.stderr  # from a clone: there is no mqks on the index


def test_mqks_tries_the_seeds_when_its_broker_is_away(broker: BrokerProcess) -> None:
    """`--seeds`: a cluster's other nodes, tried in turn when --host:--port cannot be reached."""
    gone = free_port()
    done = subprocess.run([str(MQKS), "ping", "--port", str(gone), "--seeds", f"127.0.0.1:{broker.port}"],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS)
    assert (done.returncode, done.stdout) == (0, "pong\n"), done.stderr
    done = subprocess.run([str(MQKS), "ping", "--seeds", "127.0.0.1"], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_SECONDS)
    assert done.returncode == 2 and "--seeds: '127.0.0.1' is not host:port" in done.stderr

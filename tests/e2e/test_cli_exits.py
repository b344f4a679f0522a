"""How an `mqks` command ends (issue 55): a refusal by the broker exits 1 whether the command waited for its answer
or not, and a reader that closes the output (`| head -1`) ends a command quietly with 0. Run as subprocesses the
way a user runs them; every read from a subprocess has a deadline.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from conftest import BrokerProcess
from helpers import MQKS, REPO, RUN_TIMEOUT_SECONDS, mqks, server_stats, unique
from waiting import wait_for

ORDERS = "orders-s3cret-0123456789"
ADMIN = "admin-s3cret-0123456789"
TOKENS_TOML = f"""
[[token]]
name = "orders"
secret = "{ORDERS}"
publish = ["orders.*"]
consume = ["orders-*"]
manage = false

[[token]]
name = "admin"
secret = "{ADMIN}"
publish = ["*"]
consume = ["*"]
manage = true
"""


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def scoped(request, tmp_path_factory) -> Iterator[BrokerProcess]:
    """A broker with scoped tokens (docs/security.md): `orders` may publish orders.* and consume orders-*, no more."""
    path = tmp_path_factory.mktemp("tokens") / "tokens.toml"
    path.write_text(TOKENS_TOML)
    server = BrokerProcess("--auth-token-file", str(path), "--workers", str(request.param))
    yield server
    server.kill()


def test_every_command_the_broker_refuses_exits_1_with_its_reason(scoped: BrokerProcess) -> None:
    """Each command below gets an error answer, and exits 1 naming it. Before issue 55 a publish without --confirm
    (refused by scope, or `--mandatory` with no queue bound) logged a WARNING and exited 0: its error came while
    close() waited for its barrier, and nothing made it the exit code."""
    queue = unique("payments")  # a queue `orders` may not touch, made by `admin`
    for made in (queue, f"{queue}.dead"):
        done = mqks(scoped, "rebind", made, f"{made}.e", "--token", ADMIN)
        assert done.returncode == 0, done.stderr
    refusals = {
        "publish": ["publish", "payments.x", "y"],
        "publish --mandatory": ["publish", f"orders.{unique('unbound')}", "y", "--mandatory"],
        "publish --confirm": ["publish", "--confirm", "payments.x", "y"],
        "consume": ["consume", queue, "payments.x"],
        "request": ["request", "payments.x", "y"],
        "schedule": ["schedule", "s1", "payments.x", "y", "--every", "5"],
        "unschedule": ["unschedule", "s1"],
        "rebind": ["rebind", queue, "payments.x"],
        "delete-queue": ["delete-queue", queue],
        "purge": ["purge", queue],
        "requeue-dead": ["requeue-dead", queue],
    }
    ended = {name: mqks(scoped, *command, "--token", ORDERS) for name, command in refusals.items()}
    codes = {name: done.returncode for name, done in ended.items()}
    assert codes == dict.fromkeys(refusals, 1), {name: done.stderr for name, done in ended.items()}
    for name, done in ended.items():
        reason = "no queue is bound to" if name == "publish --mandatory" else "permission denied: token 'orders'"
        assert done.stderr.startswith(f"mqks {refusals[name][0]}: 127.0.0.1:{scoped.port} answered error "), done.stderr
        assert reason in done.stderr and "WARNING" not in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("watch", [False, True], ids=["once", "watch"])
@pytest.mark.parametrize("command", ["stats.py", "mqks stats"])
def test_stats_into_a_closed_pipe_exits_0_without_a_traceback(broker: BrokerProcess, command: str,
                                                               watch: bool) -> None:
    """`stats.py | head -1` and `mqks stats --watch 1 | head -1` (issue 55): the print that meets the closed pipe
    ran in a greenlet, whose BrokenPipeError gevent's hub printed as a traceback; stats.py then exited 1. Once,
    the reader is gone before the first print (what `| head` wins one run in two); with --watch, after a line."""
    program = [sys.executable, str(REPO / "stats.py")] if command == "stats.py" else [str(MQKS), "stats"]
    read_end, write_end = os.pipe()
    proc = subprocess.Popen([*program, "--port", str(broker.port), *(["--watch", "0.1"] if watch else [])],
                            stdout=write_end, stderr=subprocess.PIPE, cwd=REPO)
    os.close(write_end)
    try:
        if watch:
            ready, _, _ = select.select([read_end], [], [], RUN_TIMEOUT_SECONDS)
            assert ready and os.read(read_end, 65536).startswith(b"MQKS 127.0.0.1:")
        os.close(read_end)  # what `head` does once it has what it wanted
        _, stderr = proc.communicate(timeout=RUN_TIMEOUT_SECONDS)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (proc.returncode, stderr) == (0, b"")


def test_the_commands_say_their_own_names_and_flags_in_their_errors(scoped: BrokerProcess) -> None:
    """Issue 55's wording: a token is `--token` on a command line, not `token=`; stats.py's errors began `stats:`
    (neither program's name); DATA split by an option ended in the top-level usage and "unrecognized arguments"."""
    env = {key: value for key, value in os.environ.items() if key != "MQKS_AUTH_TOKEN"}
    where = f"127.0.0.1:{scoped.port}"
    for program, name in (([str(MQKS), "stats"], "mqks stats"), ([str(MQKS), "queues"], "mqks queues"),
                          ([sys.executable, str(REPO / "stats.py")], "stats.py")):
        done = subprocess.run([*program, "--port", str(scoped.port)], capture_output=True, text=True, env=env,
                              timeout=RUN_TIMEOUT_SECONDS, cwd=REPO)
        assert (done.returncode, done.stderr) == (
            1, f"{name}: cannot connect to {where}: the broker requires a token: give --token or set "
               "MQKS_AUTH_TOKEN\n")
    done = mqks(scoped, "publish", "orders.x", "hello", "--confirm", "world", "--token", ORDERS)
    assert done.returncode == 2 and done.stderr.startswith("usage: mqks publish "), done.stderr
    assert done.stderr.endswith("mqks publish: error: DATA comes in one piece, before the options: 'world' came "
                                "after one; quote DATA that has spaces (mqks publish EVENT 'hello world' "
                                "--confirm)\n"), done.stderr


def test_stats_of_one_worker_heads_its_column_with_it(scoped: BrokerProcess) -> None:
    """`mqks stats --worker 0` headed worker 0's figures "total" (issue 55)."""
    done = mqks(scoped, "stats", "--worker", "0", "--token", ADMIN)
    assert done.returncode == 0, done.stderr
    heading = done.stdout.splitlines()[1]
    assert heading.split() == ["worker", "0"], done.stdout


def test_every_option_of_mqks_eval_says_what_it_does() -> None:
    done = subprocess.run([str(MQKS), "eval", "--help"], capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS)
    assert "--worker N            evaluate it in worker N of mqksd --workers" in done.stdout, done.stdout


@pytest.fixture
def deaf_link(make_broker) -> Iterator[tuple[BrokerProcess, SimpleNamespace]]:
    """A real broker behind a link that carries the client's lines to it, and its answers back only until the client
    sends its first publish: a network that died halfway."""
    broker = make_broker("--eval")
    listener = socket.create_server(("127.0.0.1", 0))
    deaf = threading.Event()

    def pump(source: socket.socket, sink: socket.socket, answers: bool) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:
                return
            if not answers and b" publish " in data:
                deaf.set()  # set before the line goes on: its answer and the barrier's are swallowed
            if not (answers and deaf.is_set()):
                sink.sendall(data)

    def serve() -> None:
        client, _ = listener.accept()
        upstream = socket.create_connection((broker.host, broker.port))
        threading.Thread(target=pump, args=(upstream, client, True), daemon=True).start()
        pump(client, upstream, False)

    threading.Thread(target=serve, daemon=True).start()
    yield broker, SimpleNamespace(port=listener.getsockname()[1])
    listener.close()


def test_a_command_whose_lines_the_broker_cannot_confirm_reading_exits_1(deaf_link) -> None:
    """`mqks publish` without --confirm waits for no answer; its close's barrier said whether the broker read the line,
    and a barrier that never came was only a log line: the command exited 0 whatever happened (issue 55's leftover)."""
    broker, link = deaf_link
    event = unique("deaf-e")
    done = subprocess.run([str(MQKS), "publish", event, "hello", "--port", str(link.port), "--timeout", "1"],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS)
    assert done.returncode == 1, done
    assert "did not say within 1s that it read every line sent" in done.stderr
    # the line itself went through: the broker counted it (only its answers were lost)
    wait_for(lambda: server_stats(broker).get("published", 0) >= 1, "the broker to count the publish")

"""The mqksd process: flags, safe defaults, signals, logs and workers."""

import os
import re
import shutil
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest
from helpers import queue_owned_by, stats_on

from mqks.server.cli import parse_args
from mqks.server.dispatch import actions

pytestmark = pytest.mark.timeout(60)


def test_sigterm_flushes_what_is_owed_and_exits_zero(make_broker):
    server = make_broker()
    consumer, publisher = server.wire(), server.wire()
    consumer.send(b"c consume q e")
    consumer.barrier()
    publisher.send_raw(b"".join(b"m%d publish e %d\n" % (i, i) for i in range(3000)))
    publisher.barrier()
    assert server.stop() == 0
    for i in range(3000):
        consumer.expect(b"c ok m%d event=e %d" % (i, i))
    assert consumer.closed_by_server()
    assert "stopping" in server.log()


def test_sigint_exits_zero(make_broker):
    server = make_broker()
    server.signal(signal.SIGINT)
    assert server.proc.wait(10) == 0


def test_eval_is_off_by_default_and_the_refusal_names_the_flag(make_broker):
    wire = make_broker().wire()
    wire.send(b"ev _eval len(state.queues)")
    wire.expect_error(b"ev", b"--eval")


def test_eval_refuses_peers_that_are_not_loopback():
    assert b"_eval" in actions.actions_for(eval_enabled=True, peer_is_loopback=True)
    assert b"_eval" not in actions.actions_for(eval_enabled=True, peer_is_loopback=False)
    assert b"_eval" not in actions.actions_for(eval_enabled=False, peer_is_loopback=True)

    table = actions.actions_for(eval_enabled=True, peer_is_loopback=False)
    table_handlers = actions.handlers_for(eval_enabled=True, peer_is_loopback=False)

    class RemoteSession:
        """What run_lines uses of a connection from another host (no loopback peer exists in CI)."""

        peer = "192.0.2.7:4242"
        eval_enabled = True
        eval_refusal = None
        authenticated = True
        closed = False
        actions = table
        handlers = table_handlers

        def __init__(self):
            self.errors = []

        def error(self, rid, reason, line):
            self.errors.append((rid, reason))

    session = RemoteSession()
    actions.run_lines(session, [b"ev _eval 1+1"], deque())
    assert session.errors == [(b"ev", "_eval answers loopback clients only")]


def test_eval_answers_repr_on_one_line(broker, wire):
    wire.send(b"ev _eval 'a\\nb'", b"ev2 _eval --worker=0 process.worker")
    wire.expect(b"ev ok 'a\\nb'")
    wire.expect(b"ev2 ok 0")


def test_logs_have_timestamps_and_one_line_per_connect_and_disconnect(make_broker):
    server = make_broker()
    wire = server.wire()
    wire.send(b"p ping")
    wire.expect(b"p ok ")
    wire.close()
    probe = server.wire()
    probe.barrier()  # the earlier disconnect was logged before this connection's ping answer
    log = server.log()
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO .*connected 127\.0\.0\.1:\d+", log, re.M)
    assert "disconnected 127.0.0.1:" in log
    assert "ping" not in log  # nothing per message at info


def test_mqksd_defaults_are_safe():
    config = parse_args([])  # what `mqksd` with no flags runs with
    assert config.host == "127.0.0.1"  # loopback only
    assert config.eval_enabled is False  # _eval is remote code execution
    # the console script is installed and its help names the defaults and the flags
    mqksd = shutil.which("mqksd") or str(Path(sys.executable).with_name("mqksd"))
    out = subprocess.run([mqksd, "--help"], capture_output=True, text=True, timeout=30).stdout
    assert "default: 127.0.0.1" in out and "--eval" in out and "--max-line-bytes" in out


@pytest.mark.parametrize(("flags", "reason"), [
    (["--workers", "0"], "--workers must be at least 1"),
    (["--max-memory", "lots"], "not a size in bytes: 'lots'"),
    (["--max-memory", "1K"], "--max-memory must be at least 1048576"),
    (["--max-link-backlog", "1K"], "--max-link-backlog must be at least 1048576"),
    (["--cluster", "c"], "--cluster needs --log nats://"),
    (["--log", ""], "--log needs the NATS servers' URLs"),
    (["--cluster", "c", "--log", "nats://127.0.0.1:4222"], "--cluster needs --node ID"),
    (["--cluster", "c", "--node", "a b", "--log", "nats://127.0.0.1:4222"], "--cluster needs --node ID"),
    (["--cluster", "c", "--node", "a", "--log", "nats://127.0.0.1:4222", "--workers", "2"],
     "--workers has no meaning with --cluster"),
    (["--cluster", "c", "--node", "a", "--log", "nats://127.0.0.1:4222", "--takeover"],
     "--takeover has no meaning with --cluster"),
    (["--cluster", "c", "--node", "a", "--log", "nats://127.0.0.1:4222", "--lease", "1"], "--lease must be at least 3"),
    (["--node", "a"], "--node and --advertise need --cluster"),
    (["--processes", "2"], "--processes needs --cluster"),
    (["--cluster", "c", "--node", "a", "--log", "nats://127.0.0.1:4222", "--processes", "-1"],
     "--processes must be at least 0"),
    (["--cluster", "c", "--node", "a", "--log", "nats://127.0.0.1:4222", "--processes", "some"],
     "not a number of workers: 'some'"),
    (["--streams", "2"], "--streams needs --cluster"),
    (["--cluster", "c", "--node", "a", "--log", "nats://127.0.0.1:4222", "--streams", "0"],
     "--streams must be at least 1"),
    (["--cluster", "c", "--node", "a", "--log", "nats://127.0.0.1:4222", "--groups", "4", "--streams", "5"],
     "--streams must be at most --groups (4), not 5"),
])
def test_bad_flag_value_exits_with_usage_error(flags, reason):
    result = subprocess.run([sys.executable, "-m", "mqks.server", *flags], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2 and reason in result.stderr


def test_a_cluster_node_holds_its_groups_in_a_process_per_core_and_names_its_streams_after_the_cluster():
    node = ["--cluster", "prod", "--node", "a", "--log", "nats://n1:4222,nats://n2:4222", "--groups", "8"]
    config = parse_args(node)
    assert (config.workers, config.log_stream, config.node, config.lease_seconds) == (8, "prod", "a", 12.0)
    assert config.processes == min(len(os.sched_getaffinity(0)), 8)  # auto: one per core, never more than groups
    assert parse_args([*node, "--processes", "3"]).processes == 3
    assert parse_args([*node, "--processes", "20"]).processes == 8
    assert (config.streams, parse_args([*node, "--streams", "8"]).streams) == (1, 8)  # one shared; or one each


def test_max_memory_reads_sizes_with_units():
    assert parse_args(["--max-memory", "512M"]).max_memory_bytes == 512 << 20
    assert parse_args(["--max-memory", "2G"]).max_memory_bytes == 2 << 30
    assert parse_args(["--max-memory", "1048576"]).max_memory_bytes == 1 << 20
    assert parse_args([]).max_memory_bytes is None


def queues_one_per_worker(wire, prefix: str) -> list[bytes]:
    """A queue name for each worker of the broker behind `wire`, in worker order."""
    workers = stats_on(wire)["workers"]
    return [queue_owned_by(worker, workers, prefix).encode() for worker in range(workers)]


def test_queues_live_on_their_slot_owner_and_publish_reaches_all(broker_per_worker_count):
    wire = broker_per_worker_count.wire()
    names = queues_one_per_worker(wire, "workerq")
    workers = len(names)
    for n, name in enumerate(names):
        wire.send(b"c%d consume %b worker.*.event" % (n, name))
    wire.send(b"m1 publish worker.1.event hi")
    got = sorted(wire.barrier())
    assert got == [b"c%d ok m1 event=worker.1.event hi" % n for n in range(workers)]
    for worker, name in enumerate(names):
        wire.send(b"ev _eval --worker=%d sorted(q.decode() for q in state.queues)" % worker)
        line = wire.recv_line()
        assert name.decode() in line.decode()
        others = [other for other in names if other != name]
        assert not any(other.decode() in line.decode() for other in others)


def test_manual_ack_across_workers(broker_per_worker_count):
    wire = broker_per_worker_count.wire()
    names = queues_one_per_worker(wire, "ackq")
    workers = len(names)
    for n, name in enumerate(names):
        wire.send(b"c%d consume %b ack-e --manual-ack" % (n, name))
    wire.send(b"m1 publish ack-e x")
    assert len(wire.barrier()) == workers
    for n in range(workers):
        wire.send(b"a%d ack --confirm c%d m1" % (n, n))
        wire.expect(b"a%d ok " % n)


def test_the_tls_recipe_writes_its_keys_and_tokens_only_where_git_ignores_them() -> None:
    # issue 24.3: the recipe wrote a private key and a token file into the checkout, and one
    # `git add .` would have published them
    repo = Path(__file__).resolve().parents[2]
    guide = (repo / "docs" / "security.md").read_text(encoding="utf-8")
    recipe = guide[guide.index("openssl req -x509"):guide.index("--client-ttl 60")]
    written = re.findall(r"(?:-keyout|-out|>)\s+(\S+)", recipe)
    assert len(written) == 3, written  # the key, the certificate, the tokens
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=repo, capture_output=True,
                             text=True, check=False).stdout.split()
    assert sorted(ignored) == sorted(written), f"not ignored: {sorted(set(written) - set(ignored))}"

"""Observability (issue 12, the server's side): `stats`, `queues`, /metrics, /healthz and mqksd's rough edges."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import resource
import signal
import subprocess
import sys

import pytest
from conftest import Wire
from helpers import free_port, http_get, unique
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_for

pytestmark = pytest.mark.timeout(60)

VERSION = importlib.metadata.version("mqks")
STATS_KEYS = {"version", "uptime_seconds", "workers", "published", "queued", "consumed", "acked", "rejected",
              "queues", "consumers", "messages_waiting", "messages_unacked", "clients", "events", "top_queues",
              "connections", "bytes_in", "bytes_out", "errors", "refused_by_scope", "ack_timeouts", "touched",
              "dead_lettered", "purged", "dead_requeued", "dropped", "unrouted",
              "delayed", "requests", "requests_waiting", "replies", "replies_late", "request_timeouts", "schedules",
              "schedule_firings", "memory_full", "leases", "messages_leased", "top_leased_queues"}
SUMMED = ("queued", "consumed", "acked", "rejected", "queues", "consumers", "messages_waiting", "messages_unacked",
          "leases", "messages_leased")
ACTION_NAMES = ("publish consume ack reject touch rebind delete_consumer delete_queue purge_queue requeue_dead "
                "request reply schedule unschedule schedules ping sync stats queues auth hello fetch settle")


class CountingWire(Wire):
    """A Wire that counts the bytes it sends and the lines it reads, as the server should count them."""

    sent = 0
    received = 0

    def send(self, *lines: bytes) -> None:
        super().send(*lines)
        self.sent += sum(len(line) + 1 for line in lines)

    def recv_line(self, timeout: float | None = None) -> bytes:
        line = super().recv_line(timeout)
        self.received += len(line) + 1
        return line


def counting_wire(server) -> CountingWire:
    return CountingWire(server.host, server.port)


def stats_on(wire: Wire, flags: bytes = b"") -> dict:
    wire.send(b"st stats" + flags)
    line = wire.recv_line()
    assert line.startswith(b"st ok {"), line
    return json.loads(line[len(b"st ok "):])


def queue_lines(wire: Wire, mask: bytes = b"") -> list[bytes]:
    """The `queues` answer up to its `--end`, checked to be one `ok` line per queue."""
    wire.send(b"qs queues " + mask if mask else b"qs queues")
    lines = []
    while (line := wire.recv_line()) != b"qs ok --end":
        assert line.startswith(b"qs ok {"), line
        lines.append(line[len(b"qs ok "):])
    return lines


def run_mqksd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mqks.server", *args], capture_output=True, text=True, timeout=30)


def test_stats_counts_known_traffic_over_every_worker(broker_per_worker_count):
    server = broker_per_worker_count
    wire, consumer = counting_wire(server), counting_wire(server)
    wait_for(lambda: stats_on(wire)["connections"] == 2, "the earlier tests' connections to be gone")
    prefix = unique("st")
    q1, q2, q3 = (f"{prefix}.{name}".encode() for name in ("q1", "q2", "q3"))
    event, mask = f"{prefix}.e".encode(), f"{prefix}.*".encode()

    wire.send(b"st stats")
    wire.sent = consumer.sent = wire.received = consumer.received = 0  # from here the server counts as we do
    before = json.loads(wire.recv_line()[len(b"st ok "):])
    consumer.send(b"c1 consume --confirm %b %b" % (q1, event), b"c3 consume --confirm %b %b --manual-ack" % (q3, mask))
    consumer.expect(b"c1 ok ")
    consumer.expect(b"c3 ok ")
    wire.send(b"rb rebind --confirm %b %b" % (q2, event))
    wire.expect(b"rb ok ")
    for n in range(3):
        wire.send(b"m%d publish --confirm %b x" % (n, event))
        wire.expect(b"m%d ok " % n)
    wire.send(b"u publish --confirm %b-none x" % prefix.encode())  # no queue is bound to it: counted unrouted
    wire.expect(b"u ok ")
    got = consumer.barrier()
    assert sorted(got) == sorted([b"c1 ok m%d event=%b x" % (n, event) for n in range(3)]
                                 + [b"c3 ok m%d event=%b x" % (n, event) for n in range(3)])
    consumer.send(b"a ack --confirm c3 m0", b"r reject --confirm c3 m1")
    consumer.expect(b"a ok ")
    consumer.expect(b"c3 ok m1 event=%b,retry=1 x" % event)  # rejected, back to the only consumer at once
    consumer.expect(b"r ok ")
    wire.send(b"bad")
    wire.expect_error(b"bad")
    wire.send(b"st stats")
    answer = wire.recv_line()
    after = json.loads(answer[len(b"st ok "):])

    assert set(after) == STATS_KEYS
    assert after["version"] == VERSION and after["workers"] == int(server.args[server.args.index("--workers") + 1])
    assert after["uptime_seconds"] >= before["uptime_seconds"] >= 0
    assert {key: after[key] - before[key] for key in (*SUMMED, "published", "events", "errors", "connections",
                                                      "unrouted")} == {
        "published": 4, "unrouted": 1, "queued": 9, "consumed": 7, "acked": 1, "rejected": 1, "queues": 3,
        "consumers": 2, "messages_waiting": 3, "messages_unacked": 2, "events": 2, "errors": 1, "connections": 0,
        "leases": 0, "messages_leased": 0}
    assert after["clients"] == after["connections"] == 2
    assert [q2.decode(), 3] in after["top_queues"]
    # one add per read and per write: exactly the bytes that crossed the two connections
    assert after["bytes_in"] - before["bytes_in"] == wire.sent + consumer.sent
    assert after["bytes_out"] - before["bytes_out"] == wire.received - len(answer) - 1 + consumer.received

    per_worker = [stats_on(wire, b" --worker=%d" % n) for n in range(after["workers"])]
    # worker processes: each also tells its pid, its links and the bindings it knows of the others
    own_keys = {"worker"} | ({"pid", "worker_links", "replica_queues", "dropped_unlinked"} if len(per_worker) > 1
                             else set())
    for n, one in enumerate(per_worker):
        assert set(one) == STATS_KEYS | own_keys and one["worker"] == n and one["workers"] == after["workers"]
    # a publish is counted by the worker its client sent it to
    assert sum(one["published"] for one in per_worker) == after["published"]
    for key in (*SUMMED, "unrouted"):
        assert sum(one[key] for one in per_worker) == after[key], key
    wire.close()
    consumer.close()


def test_stats_worker_out_of_range_names_the_range(broker_per_worker_count):
    wire = broker_per_worker_count.wire()
    workers = stats_on(wire)["workers"]
    for value in (b"%d" % workers, b"-1", b"x"):
        wire.send(b"s stats --worker=" + value)
        wire.expect_error(b"s", b"this server has %d (0..%d)" % (workers, workers - 1))
    wire.send(b"s stats --bogus")
    wire.expect_error(b"s", b"stats [--worker=N]")
    wire.close()


def test_queues_lists_every_worker_sorted_with_a_mask_filter(broker_per_worker_count):
    wire = broker_per_worker_count.wire()
    p = unique("qs").encode()
    wire.send(b"c1 consume --confirm %b.b %b.e --manual-ack --delete-queue-when-unused=5" % (p, p),
              b"r1 rebind --confirm %b.a %b.e %b.*.x" % (p, p, p), b"r2 rebind --confirm %b.b.c" % p,
              b"c2 consume --confirm %b.d --delete-queue-when-unused" % p)
    for line in (b"c1 ok ", b"r1 ok ", b"r2 ok ", b"c2 ok "):
        wire.expect(line)
    wire.send(b"m1 publish --confirm %b.e x" % p, b"m2 publish --confirm %b.e y" % p)
    got = wire.barrier()
    deliveries, confirms = [b"c1 ok m1 event=%b.e x" % p, b"c1 ok m2 event=%b.e y" % p], [b"m1 ok ", b"m2 ok "]
    assert sorted(got) == sorted(deliveries + confirms)
    # with worker processes a confirm that waits for two owners may come after the next message's delivery;
    # each still comes after its own message's, and each kind keeps its order
    assert [line for line in got if line in deliveries] == deliveries
    assert [line for line in got if line in confirms] == confirms
    assert got.index(deliveries[0]) < got.index(confirms[0]) and got.index(deliveries[1]) < got.index(confirms[1])
    a = b'{"queue":"%b.a","depth":2,"unacked":0,"leased":0,"consumers":0,"bindings":2,"flags":[]}' % p
    b = (b'{"queue":"%b.b","depth":0,"unacked":2,"leased":0,"consumers":1,"bindings":1,'
         b'"flags":["--delete-queue-when-unused=5.0"]}' % p)
    bc = b'{"queue":"%b.b.c","depth":0,"unacked":0,"leased":0,"consumers":0,"bindings":0,"flags":[]}' % p
    d = (b'{"queue":"%b.d","depth":0,"unacked":0,"leased":0,"consumers":1,"bindings":0,'
         b'"flags":["--delete-queue-when-unused"]}' % p)
    assert queue_lines(wire, p + b".*") == [a, b, d]  # `*` never spans a dot
    assert queue_lines(wire, p + b".*.c") == [bc]
    assert queue_lines(wire, p + b".b.c") == [bc]  # no `*`: the exact name
    assert queue_lines(wire, p) == []
    everything = queue_lines(wire)
    assert [a, b, bc, d] == [line for line in everything if line.startswith(b'{"queue":"%b.' % p)]
    names = [json.loads(line)["queue"] for line in everything]
    assert names == sorted(names)
    wire.send(b"q queues one two")
    wire.expect_error(b"q", b"queues [--detail] [{mask}]")
    wire.close()


def test_queues_detail_lists_bindings_consumers_and_the_newest_messages(broker_per_worker_count):
    wire = broker_per_worker_count.wire()
    queue = unique("qd").encode()
    wire.send(b"c1 consume --confirm %b x.* audit --manual-ack --prefetch=1" % queue)
    wire.expect(b"c1 ok ")
    wire.send(*(b"m%d publish --confirm x.y data" % n for n in range(4)))
    got = wire.barrier()
    assert sorted(got) == [b"c1 ok m0 event=x.y data", b"m0 ok ", b"m1 ok ", b"m2 ok ", b"m3 ok "]  # prefetch 1
    [row] = [json.loads(line) for line in queue_lines(wire, b"--detail " + queue)]
    assert row["events"] == ["audit", "x.*"]
    assert row["consumer_list"] == [{"consumer": "c1", "manual_ack": True, "prefetch": 1, "unacked": 1,
                                     "ack_timeout": None}]
    assert row["newest"] == [{"msg_id": f"m{n}", "event": "x.y", "retry": 0, "data": "data"} for n in (3, 2, 1)]
    wire.send(b"big publish --confirm x.z %b" % (b"y" * 300))  # the data shown is cut at 200 bytes
    wire.expect(b"big ok ")
    [row] = [json.loads(line) for line in queue_lines(wire, b"--detail " + queue)]
    assert row["newest"][0] == {"msg_id": "big", "event": "x.z", "retry": 0, "data": "y" * 200 + "…"}
    [plain] = [json.loads(line) for line in queue_lines(wire, queue)]
    assert "events" not in plain and plain["depth"] == 4  # without --detail: the row as before
    wire.close()


def test_stats_with_a_data_dir_shows_the_log_and_needs_no_eval(make_broker, tmp_path):
    server = make_broker("--data-dir", str(tmp_path), "--fsync", "no")
    wire = server.wire()
    wire.send(b"r rebind --confirm q some-event", b"m publish --confirm some-event x")
    wire.expect(b"r ok ")
    wire.expect(b"m ok ")
    stats = stats_on(wire)
    assert set(stats) == STATS_KEYS | {"log"}
    assert stats["log"]["commits"] >= 1 and stats["log"]["disk_full"] is False
    assert "log" in stats_on(wire, b" --worker=0")  # one log serves every worker
    wire.close()


def test_metrics_scrape_shows_the_figures_and_the_deepest_queues(make_broker):
    port = free_port()
    server = make_broker("--workers", "2", "--metrics-port", str(port), "--metrics-max-queues", "2")
    wire = server.wire()
    wire.send(b"c consume --confirm held e --manual-ack", b"r1 rebind --confirm deep e",
              b"r2 rebind --confirm deeper e f")
    for line in (b"c ok ", b"r1 ok ", b"r2 ok "):
        wire.expect(line)
    wire.send(b"m1 publish --confirm e 1", b"m2 publish --confirm e 2", b"m3 publish --confirm f 3", b"oops")
    wire.barrier()
    status, body = http_get(port, "/metrics")
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    expected = {
        "mqks_published_total": 3, "mqks_queued_total": 7, "mqks_consumed_total": 2, "mqks_acked_total": 0,
        "mqks_rejected_total": 0, "mqks_queues": 3, "mqks_consumers": 1, "mqks_messages_waiting": 5,
        "mqks_messages_unacked": 2, "mqks_events": 2, "mqks_connections": 1, "mqks_errors_total": 1,
        "mqks_workers": 2,
    }
    assert {name: samples[name, ()] for name in expected} == expected
    assert samples["mqks_build_info", (("version", VERSION),)] == 1
    assert samples["mqks_bytes_in_total", ()] > 0 and samples["mqks_bytes_out_total", ()] > 0
    depth = {labels[0][1]: value for (name, labels), value in samples.items() if name == "mqks_queue_depth"}
    unacked = {labels[0][1]: value for (name, labels), value in samples.items() if name == "mqks_queue_unacked"}
    assert depth == {"deeper": 3, "deep": 2} and unacked == {"deeper": 0, "deep": 0}  # the 2 deepest only
    assert ("process_resident_memory_bytes", ()) in samples
    wire.close()


def test_healthz_answers_ok_and_other_paths_are_not_found(make_broker, tmp_path):
    port = free_port()
    make_broker("--metrics-port", str(port), "--data-dir", str(tmp_path))
    assert http_get(port, "/healthz") == (200, b"ok\n")
    assert http_get(port, "/")[0] == 200  # the web console
    assert http_get(port, "/nope")[0] == 404
    assert http_get(port, "/api/nope")[0] == 404


def test_no_console_leaves_the_port_to_metrics_and_health(make_broker, tmp_path):
    port = free_port()
    make_broker("--metrics-port", str(port), "--no-console")
    assert http_get(port, "/healthz") == (200, b"ok\n")
    assert http_get(port, "/")[0] == 404 and http_get(port, "/api/stats")[0] == 404


@pytest.mark.parametrize("args", [
    ("--port", "99999"), ("--port", "-1"), ("--workers", "0"), ("--max-output-bytes", "-5"),
    ("--log-segment-bytes", "-1"), ("--metrics-port", "70000"), ("--metrics-port", "0"), ("--metrics-port", "web"),
    ("--metrics-max-queues", "-1"),
])
def test_a_bad_flag_value_is_one_line_and_exit_2(args):
    result = run_mqksd(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mqksd: error: ") and args[0] in lines[0], result.stderr


def test_advertise_with_a_port_is_refused_with_what_to_give_instead():
    """--advertise 127.0.0.1:PORT (other tools take host:port) made the map hold `host:port:port` addresses and
    every forwarded line fail for as long as one waited; it is refused at start, with the flags to give."""
    result = run_mqksd("--cluster", "c", "--node", "a", "--log", "nats://127.0.0.1:1", "--advertise", "10.0.0.5:4000")
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["mqksd: error: --advertise takes a host, not host:port ('10.0.0.5:4000'): "
                                          "the port others dial is --port, so give --advertise 10.0.0.5 --port 4000 "
                                          "(mqksd --help lists the flags)"]


@pytest.mark.parametrize("host", ["10.0.0.5", "node-a.example", "::1", "fe80::1"])
def test_advertise_takes_names_and_ip_addresses_ipv6_included(host):
    from mqks.server.cli import parse_args

    assert parse_args(["--cluster", "c", "--node", "a", "--log", "nats://127.0.0.1:1", "--advertise", host]).advertise \
        == host


def test_version_prints_the_package_version():
    result = run_mqksd("--version")
    assert result.returncode == 0 and result.stdout.startswith(f"mqksd {VERSION}, hot path "), result.stdout


def test_a_busy_port_exits_1_with_one_line(make_broker):
    server = make_broker()
    result = run_mqksd("--port", str(server.port))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"cannot listen on 127.0.0.1:{server.port}" in result.stderr
    result = run_mqksd("--port", str(free_port()), "--metrics-port", str(server.port))
    assert result.returncode == 1 and "cannot listen for metrics" in result.stderr


def test_help_and_unknown_actions_list_the_actions_a_session_may_run(make_broker, broker):
    wire = make_broker().wire()
    wire.send(b"help")
    line = wire.expect_error(b"-")
    assert line.split(b" ", 3)[3] == b'unknown action "help"; actions: ' + ACTION_NAMES.encode()
    wire.send(b"h help")
    assert wire.expect_error(b"h").endswith(b"; actions: " + ACTION_NAMES.encode())
    wire.send(b"s stats")  # read-only: no --eval needed
    assert wire.recv_line().startswith(b"s ok {")
    wire.close()
    with_eval = broker.wire()  # --eval, and we are a loopback client: _eval is allowed, so listed
    with_eval.send(b"h help")
    assert with_eval.expect_error(b"h").endswith(b"; actions: " + ACTION_NAMES.encode() + b" _eval")
    with_eval.close()


def test_sigterm_logs_clean_disconnects(make_broker):
    server = make_broker()
    wires = [server.wire() for _ in range(3)]
    for n, wire in enumerate(wires):
        wire.send(b"c%d consume --confirm %b e --manual-ack" % (n, unique("sig").encode()))
        wire.expect(b"c%d ok " % n)
    wires[0].send(b"m publish e x")
    wires[0].barrier()
    assert server.stop() == 0
    log = server.log()
    assert "File descriptor was closed" not in log and "failed" not in log, log
    assert log.count("INFO mqks.connection: disconnected") >= 3
    assert log.rindex("disconnected") < log.index("mqksd stopped")
    for wire in wires:
        assert wire.closed_by_server()


def test_healthz_answers_503_while_the_disk_is_full_and_200_once_it_has_room(make_broker, tmp_path):
    port = free_port()
    server = make_broker("--metrics-port", str(port), "--data-dir", str(tmp_path))
    wire = server.wire()
    wire.send(b"rb rebind --confirm hq he", b"m0 publish --confirm he before")
    wire.expect(b"rb ok ")
    wire.expect(b"m0 ok ")
    used = sum(os.path.getsize(os.path.join(tmp_path, name)) for name in os.listdir(tmp_path))
    _, hard = resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE)
    resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (used + 100, hard))  # the disk is "full"
    wire.send(b"m1 publish --confirm he %s" % (b"z" * 500))
    wire.expect_error(b"m1", b"disk full")
    status, body = http_get(port, "/healthz")
    assert status == 503 and b"disk" in body, (status, body)
    resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (hard, hard))  # room again
    wait_for(lambda: http_get(port, "/healthz") == (200, b"ok\n"), "healthz back to ok once the log writes")
    wire.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_sigusr1_logs_every_greenlets_stack_and_the_broker_serves_on(make_broker, workers):
    """`kill -USR1` (docs/observability.md): what each greenlet waits on, from each worker, for a broker that seems
    stuck; an unhandled SIGUSR1 would have killed it."""
    broker = make_broker("--workers", str(workers))
    wire = broker.wire()
    wire.send(b"c consume --confirm idle-q idle.e")  # a connection whose reader waits in recv: its stack shows it
    wire.expect(b"c ok ")
    broker.signal(signal.SIGUSR1)
    dumps = re.compile(r"WARNING mqks\.server[^:]*: SIGUSR1: the greenlets of process \d+:")
    wait_for(lambda: len(dumps.findall(broker.log())) == workers, "a dump from each worker")
    assert "_read_loop" in broker.log()
    wire.send(b"p ping after")
    wire.expect(b"p ok after")

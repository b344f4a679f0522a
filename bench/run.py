"""MQKS beside Redis, NATS and beanstalkd: one command, one table, one JSON file.

    .venv/bin/python -m bench.run [--quick] [--pinned|--unpinned|--both] [--workloads w1,w2,w3,w4,w5]
                                  [--json PATH] [--profile] [--compare BEFORE.json AFTER.json]

(from the repository root: `bench` is a package).

Starts every server itself on 127.0.0.1 (a fresh one per run, stopped by pid), measures the
load generator's ceiling against a trivial sink, runs each cell `--reps` times, prints medians
with ranges and the MQKS/peer ratios the issue targets, and writes the same as JSON into
bench/results/. `--profile` runs mqksd under cProfile through w1 and w2 instead (with
`--workloads w5`: through the confirmed w5 flow, in memory and with each --fsync policy);
`--compare` prints two result files side by side.

w1 also runs MQKS over TLS (`--tls-port`, a certificate made by openssl for the run): the
ratio rows "MQKS over TLS / MQKS plain" are the cost of encryption on the batched hot path.

w5 (durable; only when asked for, ~2 min) runs each server with its persistence on, into a
fresh temporary data directory per run: w1ack-confirmed (one producer pipelining confirmed
publishes, at most `--window` unconfirmed, one consumer acking everything, msg/s from the
first publish until the last confirm and the last ack the server shows taken), w4-disk
(`--w4-messages` queued, no consumer: bytes of the data directory per message after a clean
stop) and recovery (a restart on that directory: seconds from spawn until it answers).
"""

from __future__ import annotations

import argparse
import ast
import base64
import io
import json
import os
import platform
import pstats
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import loadgen, peers
from .loadgen import Beanstalkd, Flow, Mqks, Nats, RedisPubSub, RedisStreams

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
LOG_DIR = os.path.join(RESULTS_DIR, "logs")
SERVER_CORE, GENERATOR_CORE = 0, 1
WORKLOADS = ("w1", "w2", "w3", "w4", "w5")
DEFAULT_WORKLOADS = "w1,w2,w3,w4"  # w5 (durable) takes ~2 min more: only when asked for
PEER_BINARIES = {"redis": "redis-server", "nats": "nats-server", "beanstalkd": "beanstalkd"}


@dataclass(frozen=True, slots=True)
class Config:
    quick: bool
    modes: tuple[str, ...]
    workloads: tuple[str, ...]
    reps: int
    w4_reps: int
    w1_messages: int
    w2_events: int
    w3_seconds: float
    w3_rates: tuple[int, ...]
    w4_messages: int
    window: int
    timeout_seconds: float
    json_path: str
    install: bool
    profile: bool
    compare: tuple[str, ...] = ()
    counter_binary: str | None = None


def build_config(argv: list[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(prog="python -m bench.run",
                                     description="MQKS benchmark beside Redis, NATS and beanstalkd.")
    parser.add_argument("--quick", action="store_true", help="small counts, one repetition (smoke run)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--pinned", dest="modes", action="store_const", const=("pinned",),
                      help="server on core 0, generator on core 1 (default)")
    mode.add_argument("--unpinned", dest="modes", action="store_const", const=("unpinned",),
                      help="no taskset: the kernel places everything")
    mode.add_argument("--both", dest="modes", action="store_const", const=("pinned", "unpinned"),
                      help="pinned, then unpinned")
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS,
                        help="comma list of w1,w2,w3,w4,w5 (default %(default)s; w5 is the durable one)")
    parser.add_argument("--reps", type=int, help="repetitions per cell (default 3, quick 1)")
    parser.add_argument("--w4-reps", type=int, help="repetitions of the 1M-message memory cells (default 3, quick 1)")
    parser.add_argument("--messages", type=int,
                        help="w1 (and w5 w1ack-confirmed) messages per run (default 500000, quick 100000); "
                             "w2 publishes a tenth as many events (quick: 25000), each delivered 20 times")
    parser.add_argument("--w4-messages", type=int,
                        help="w4 (and w5 w4-disk) queued messages (default 1000000, quick 200000)")
    parser.add_argument("--window", type=int, default=50_000, help="max messages the producer runs ahead")
    parser.add_argument("--timeout", type=float, help="seconds one run may take (default 60, quick 30)")
    parser.add_argument("--json", dest="json_path", help="where to write the JSON (default bench/results/...)")
    parser.add_argument("--no-install", action="store_true", help="skip peers that are missing instead of apt-get")
    parser.add_argument("--profile", action="store_true",
                        help="profile mqksd under cProfile through w1 and w2 (with --workloads w5: its durable flow)")
    parser.add_argument("--py-consumer", action="store_true",
                        help="count push deliveries in Python too, not with the gcc-built bench/bin/count")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                        help="print two result JSON files side by side and exit (runs nothing)")
    a = parser.parse_args(argv)
    quick = a.quick
    modes = a.modes or ("pinned",)
    if "pinned" in modes and (not shutil.which("taskset") or (os.cpu_count() or 1) < 2):
        print("# pinned mode needs taskset and 2 cores: running unpinned only", flush=True)
        modes = ("unpinned",)
    workloads = tuple(w.strip() for w in a.workloads.split(",") if w.strip())
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        parser.error(f"unknown workloads: {bad}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Config(
        quick=quick,
        modes=modes,
        workloads=workloads,
        reps=a.reps or (1 if quick else 3),
        w4_reps=a.w4_reps or (1 if quick else 3),
        w1_messages=a.messages or (100_000 if quick else 500_000),
        w2_events=(a.messages or (250_000 if quick else 500_000)) // 10,
        w3_seconds=1.0 if quick else 2.0,
        w3_rates=(5_000, 20_000),
        w4_messages=a.w4_messages or (200_000 if quick else 1_000_000),
        window=a.window,
        timeout_seconds=a.timeout or (30.0 if quick else 60.0),
        json_path=a.json_path or os.path.join(RESULTS_DIR, f"bench-{stamp}{'-quick' if quick else ''}.json"),
        install=not a.no_install,
        profile=a.profile,
        compare=tuple(a.compare or ()),
        counter_binary=None if a.py_consumer or a.compare else loadgen.build_counter(),
    )


def say(text: str = "") -> None:
    print(text, flush=True)


# Servers


class Servers:
    """Starts a fresh server of a kind on demand; knows which peers were skipped and why."""

    def __init__(self, cfg: Config) -> None:
        self.finder = peers.PeerFinder(install=cfg.install, log=say)
        self.finder.resolve(list(PEER_BINARIES.values()))
        self.skipped = {kind: self.finder.skipped[b] for kind, b in PEER_BINARIES.items() if b in self.finder.skipped}
        self.versions = {kind: _version(self.finder.paths[b]) for kind, b in PEER_BINARIES.items()
                         if b in self.finder.paths}
        self.mqks_python = peers.mqks_python()
        if self.mqks_python is None:
            self.skipped["mqks"] = (f"{sys.executable} cannot import mqks.server: "
                                    "run with the repo's venv (.venv/bin/python) or `pip install -e .`")
        self.versions["mqks"] = _mqks_version(self.mqks_python or sys.executable)
        self._tls_files: tuple[str, str] | None = None

    def available(self, kind: str) -> bool:
        return kind not in self.skipped

    def tls_files(self) -> tuple[str, str]:
        """(certificate, key) for 127.0.0.1, made once per run by openssl; the certificate is its own CA."""
        if self._tls_files is None:
            directory = tempfile.mkdtemp(prefix="bench-tls-")
            cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
            subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                            "-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1",
                            "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
            self._tls_files = (cert, key)
        return self._tls_files

    def start(self, kind: str, core: int | None, data_dir: str | None = None, persist: str = "",
              wait: bool = True, tls_port: int | None = None, pure: bool = False) -> peers.Server:
        """A fresh server; with `data_dir` (w5) its persistence on there, `persist` being MQKS's --fsync,
        Redis's appendfsync or beanstalkd's -f milliseconds; with `tls_port`, MQKS listens for TLS there too."""
        if tls_port is not None:
            cert, key = self.tls_files()
            return peers.start_mqks(core, LOG_DIR, python=self.mqks_python,
                                    extra_args=("--tls-port", str(tls_port), "--tls-cert", cert, "--tls-key", key))
        if data_dir is not None:
            if kind == "mqks":
                return peers.start_mqks(core, LOG_DIR, python=self.mqks_python, data_dir=data_dir, fsync=persist,
                                        wait=wait)
            path = self.finder.paths[PEER_BINARIES[kind]]
            if kind == "redis":
                return peers.start_redis(path, core, LOG_DIR, data_dir=data_dir, appendfsync=persist, wait=wait)
            if kind == "beanstalkd":
                return peers.start_beanstalkd(path, core, LOG_DIR, data_dir=data_dir, fsync_ms=int(persist),
                                              wait=wait)
            raise ValueError(f"no persistence for {kind}")
        if kind == "mqks":
            return peers.start_mqks(core, LOG_DIR, python=self.mqks_python, pure=pure)
        path = self.finder.paths[PEER_BINARIES[kind]]
        return {"redis": peers.start_redis, "nats": peers.start_nats,
                "beanstalkd": peers.start_beanstalkd}[kind](path, core, LOG_DIR)


def _version(path: str) -> str:
    flag = "-v" if path.endswith("beanstalkd") else "--version"
    try:
        out = subprocess.run([path, flag], capture_output=True, timeout=5).stdout.decode(errors="replace")
        return out.strip().splitlines()[0][:80] if out.strip() else "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def _mqks_version(python: str) -> str:
    try:
        out = subprocess.run([python, "-m", "mqks.server", "--version"], capture_output=True, timeout=30, cwd="/tmp",
                             env={**os.environ, "MQKS_PURE": ""})
        return out.stdout.decode().strip().replace("mqksd", "mqks", 1)  # and which hot path runs
    except (OSError, subprocess.TimeoutExpired):
        return "mqks ?"


def mqks_stats(server: peers.Server) -> dict:
    """`state.stats()` through `_eval` on a fresh connection."""
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(b"e _eval state.stats()\n")
        buf = loadgen.read_until(sock, b"\n")
    line = buf.split(b"\n", 1)[0]
    if not line.startswith(b"e ok "):
        raise RuntimeError(f"_eval failed: {line[:300]!r}")
    return ast.literal_eval(line[5:].decode())


def mqks_check(server: peers.Server, n: int, fanout: int, manual_ack: bool) -> Callable[[], str]:
    """A post-run check of the broker's own counters; returns '' when they add up."""

    def check() -> str:
        deadline = time.monotonic() + 3
        while True:
            try:
                st = mqks_stats(server)
            except Exception as e:  # report, do not crash the benchmark
                return f"stats unavailable: {e}"
            problems = []
            if st.get("published") != n:
                problems.append(f"published={st.get('published')} (sent {n})")
            if st.get("messages_waiting"):
                problems.append(f"messages_waiting={st.get('messages_waiting')}")
            if st.get("consumed") != n * fanout:
                problems.append(f"consumed={st.get('consumed')} (expected {n * fanout})")
            if manual_ack and (st.get("messages_unacked") or st.get("acked") != n * fanout):
                problems.append(f"acked={st.get('acked')} unacked={st.get('messages_unacked')}")
            if not problems or time.monotonic() > deadline:
                return ("stats: " + ", ".join(problems)) if problems else ""
            time.sleep(0.1)  # acks are fire-and-forget: give the last batch a moment

    return check


# Cells


@dataclass
class Cell:
    workload: str
    server: str
    variant: str
    make: Callable[[], loadgen.Proto]
    fanout: int = 1
    manual_ack: bool = False
    rate: int = 0
    divisor: int = 1  # a slow peer runs fewer messages so a cell stays within seconds
    # w5 only: what the run measures (flow: msg/s confirmed and acked; disk: bytes/msg; recovery:
    # seconds, measured by the disk run of the same server, named by `recovery` there), and the
    # persistence setting (MQKS --fsync, Redis appendfsync, beanstalkd -f ms; "" = none)
    measure: str = "flow"
    persist: str = ""
    recovery: str = ""
    tls: bool = False  # MQKS only: every connection of the flow over TLS
    pure: bool = False  # MQKS only: the hot path's plain sources (MQKS_PURE=1) beside the compiled build

    @property
    def key(self) -> str:
        rate = f"@{self.rate // 1000}k" if self.rate else ""
        return f"{self.workload}{rate} {self.server} {self.variant}"


def cells_for(workload: str, cfg: Config) -> list[Cell]:
    if workload == "w1":
        return [
            Cell("w1", "mqks", "auto-ack", lambda: Mqks()),
            Cell("w1", "mqks", "manual-ack", lambda: Mqks(manual_ack=True), manual_ack=True),
            Cell("w1", "mqks", "manual-ack, an ack line per message", lambda: Mqks(manual_ack=True, ack_each=True),
                 manual_ack=True),
            Cell("w1", "mqks", "auto-ack over TLS", lambda: Mqks(), tls=True),
            Cell("w1", "mqks", "manual-ack over TLS", lambda: Mqks(manual_ack=True), manual_ack=True, tls=True),
            Cell("w1", "mqks", f"auto-ack, {PLAIN}", lambda: Mqks(), pure=True),
            Cell("w1", "mqks", f"manual-ack, an ack line per message, {PLAIN}",
                 lambda: Mqks(manual_ack=True, ack_each=True), manual_ack=True, pure=True),
            Cell("w1", "redis", "pubsub", lambda: RedisPubSub()),
            Cell("w1", "redis", "streams", lambda: RedisStreams(ack=False)),
            Cell("w1", "redis", "streams+xack", lambda: RedisStreams(ack=True)),
            Cell("w1", "redis", "streams+xack per message", lambda: RedisStreams(ack=True, ack_each=True)),
            Cell("w1", "nats", "core", lambda: Nats()),
            Cell("w1", "beanstalkd", "put/reserve/delete", lambda: Beanstalkd(), divisor=5),
        ]
    if workload == "w2":
        return [
            Cell("w2", "mqks", "10 exact + 10 mask queues", lambda: Mqks(), fanout=20),
            Cell("w2", "mqks", f"10 exact + 10 mask queues, {PLAIN}", lambda: Mqks(), fanout=20, pure=True),
            Cell("w2", "redis", "10 SUBSCRIBE + 10 PSUBSCRIBE", lambda: RedisPubSub(), fanout=20),
            Cell("w2", "nats", "10 exact + 10 * subs", lambda: Nats(), fanout=20),
        ]
    if workload == "w3":
        out = []
        for rate in cfg.w3_rates:
            out += [
                Cell("w3", "mqks", "auto-ack", lambda: Mqks(), rate=rate),
                Cell("w3", "mqks", "manual-ack", lambda: Mqks(manual_ack=True), manual_ack=True, rate=rate),
                Cell("w3", "redis", "pubsub", lambda: RedisPubSub(), rate=rate),
                Cell("w3", "redis", "streams", lambda: RedisStreams(ack=False), rate=rate),
                Cell("w3", "nats", "core", lambda: Nats(), rate=rate),
                Cell("w3", "beanstalkd", "put/reserve/delete", lambda: Beanstalkd(), rate=rate),
            ]
        return out
    if workload == "w4":
        return [
            Cell("w4", "mqks", "1 queue, no consumer", lambda: Mqks(event=b"bench.w4")),
            Cell("w4", "redis", "streams XADD", lambda: RedisStreams()),
            Cell("w4", "beanstalkd", "put", lambda: Beanstalkd()),
            Cell("w4", "mqks", W4_RANDOM, lambda: MqksRandom(event=b"bench.w4")),
            Cell("w4", "redis", f"streams XADD, {RANDOM_PAYLOAD}", lambda: RedisStreamsRandom()),
        ]
    if workload == "w5":
        mqks_flow = lambda: Mqks(manual_ack=True, confirm=True)
        return [
            Cell("w5", "mqks", W5_MQKS_MEMORY, mqks_flow, manual_ack=True),
            Cell("w5", "mqks", W5_MQKS_ALWAYS, mqks_flow, manual_ack=True, persist="always"),
            Cell("w5", "mqks", W5_MQKS_EVERYSEC, mqks_flow, manual_ack=True, persist="everysec"),
            Cell("w5", "redis", W5_REDIS_ALWAYS, lambda: RedisStreams(ack=True), persist="always"),
            Cell("w5", "redis", W5_REDIS_EVERYSEC, lambda: RedisStreams(ack=True), persist="everysec"),
            # -f 0 is an fsync per put and per delete, one client after another: ~100x slower
            Cell("w5", "beanstalkd", "w1ack-confirmed put/reserve/delete, binlog -f 0", lambda: Beanstalkd(),
                 persist="0", divisor=BEANSTALKD_SYNC_DIVISOR),
            Cell("w5", "beanstalkd", "w1ack-confirmed put/reserve/delete, binlog -f 50", lambda: Beanstalkd(),
                 persist="50", divisor=5),
            Cell("w5", "mqks", "w4-disk, fsync everysec", lambda: Mqks(event=b"bench.w4", confirm=True),
                 measure="disk", persist="everysec", recovery="recovery, fsync everysec"),
            Cell("w5", "redis", "w4-disk streams XADD, AOF everysec", lambda: RedisStreams(),
                 measure="disk", persist="everysec", recovery="recovery, AOF everysec"),
            Cell("w5", "beanstalkd", "w4-disk put, binlog -f 50", lambda: Beanstalkd(),
                 measure="disk", persist="50", recovery="recovery, binlog -f 50"),
            Cell("w5", "mqks", "recovery, fsync everysec", mqks_flow, measure="recovery"),
            Cell("w5", "redis", "recovery, AOF everysec", lambda: RedisStreams(), measure="recovery"),
            Cell("w5", "beanstalkd", "recovery, binlog -f 50", lambda: Beanstalkd(), measure="recovery"),
        ]
    raise ValueError(workload)


RANDOM_PAYLOAD = "random 100-byte payload"
W4_RANDOM = f"1 queue, no consumer, {RANDOM_PAYLOAD}"


def random_payload() -> bytes:
    """100 random printable bytes, a new draw per message: what no store can squeeze as it can the bench's
    filler (75 random bytes in base64: one line, valid UTF-8, no space)."""
    return base64.b64encode(os.urandom(75))


class MqksRandom(Mqks):
    """w4's MQKS publishes, each with a random payload."""

    def publish(self, start: int, count: int, ts_ns: int = 0) -> bytes:
        event = self.event
        return b"".join([b"m%d publish %b %b\n" % (i, event, random_payload()) for i in range(start, start + count)])


class RedisStreamsRandom(RedisStreams):
    """w4's XADDs, each with a random payload."""

    def publish(self, start: int, count: int, ts_ns: int = 0) -> bytes:
        return b"".join([loadgen.resp(b"XADD", self.stream, b"*", b"p", random_payload()) for _ in range(count)])


W5_MQKS_MEMORY = "w1ack-confirmed, in memory"
W5_MQKS_ALWAYS = "w1ack-confirmed, fsync always"
W5_MQKS_EVERYSEC = "w1ack-confirmed, fsync everysec"
W5_REDIS_ALWAYS = "w1ack-confirmed streams+xack, appendfsync always"
W5_REDIS_EVERYSEC = "w1ack-confirmed streams+xack, appendfsync everysec"
BEANSTALKD_SYNC_DIVISOR = 100


def percentile(sorted_values: list[int], q: float) -> float:
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


def run_cell(cell: Cell, cfg: Config, servers: Servers, pinned: bool) -> dict:
    """One repetition of one cell on a fresh server; returns a sample dict."""
    if cell.measure == "disk":
        return run_disk(cell, cfg, servers, pinned)
    server_core = SERVER_CORE if pinned else None
    gen_core = GENERATOR_CORE if pinned else None
    data_dir = tempfile.mkdtemp(prefix=f"bench-{cell.server}-data-") if cell.persist else None  # fresh per run
    tls_port = peers.free_port() if cell.tls else None
    try:
        server = servers.start(cell.server, server_core, data_dir, cell.persist, tls_port=tls_port, pure=cell.pure)
    except BaseException:
        if data_dir:
            shutil.rmtree(data_dir, ignore_errors=True)
        raise
    try:
        proto = cell.make()
        if cell.workload == "w4":
            n = cfg.w4_messages
            r = loadgen.run_memory(proto, server.host, server.port, n, gen_core, server.pid,
                                   cfg.timeout_seconds * 2)
            if "error" in r:
                return {"ok": False, "note": r["error"] + f" | server log: {server.log_tail(300)}"}
            note = ""
            if cell.server == "mqks":
                st = mqks_stats(server)
                if st.get("messages_waiting") != n:
                    note = f"stats: messages_waiting={st.get('messages_waiting')} (sent {n})"
            if r.get("errors"):
                note += f" {r['errors']} error replies"
            return {"ok": not note, "value": (r["rss1"] - r["rss0"]) / n, "rss0": r["rss0"], "rss1": r["rss1"],
                    "seconds": r["seconds"], "note": note.strip()}
        if cell.workload == "w3":
            n = int(cell.rate * cfg.w3_seconds)
        elif cell.workload == "w2":
            n = cfg.w2_events
        else:
            n = cfg.w1_messages
        n //= cell.divisor
        flow = Flow(proto=proto, host=server.host, port=tls_port or server.port, n=n, fanout=cell.fanout,
                    window=cfg.window, core=gen_core, timeout_s=cfg.timeout_seconds, rate=cell.rate,
                    counter_binary=cfg.counter_binary, confirm=cell.workload == "w5",
                    tls_ca=servers.tls_files()[0] if cell.tls else None)
        check = mqks_check(server, n, cell.fanout, cell.manual_ack) if cell.server == "mqks" else None
        # the server's CPU per message: w5, and MQKS's w1 (plain beside TLS, steadier than msg/s on a busy machine)
        measure_cpu = cell.workload == "w5" or (cell.workload == "w1" and cell.server == "mqks")
        cpu0 = process_cpu_seconds(server.pid) if measure_cpu else 0.0
        kernel0 = process_cpu_seconds(server.pid, kernel_only=True) if measure_cpu else 0.0
        r = loadgen.run_flow(flow, latency=cell.workload == "w3", check=check)
        cpu = process_cpu_seconds(server.pid) - cpu0 if measure_cpu else 0.0
        kernel = process_cpu_seconds(server.pid, kernel_only=True) - kernel0 if measure_cpu else 0.0
        if not server.alive():
            r.note = (r.note + "; " if r.note else "") + f"server died: {server.log_tail(300)}"
            r.ok = False
        sample = {"ok": r.ok and not r.errors, "value": r.rate, "got": r.got, "target": r.target,
                  "seconds": r.seconds, "send_rate": r.send_rate, "note": r.note}
        if measure_cpu:  # where the time went: the server's CPU (all its threads) per message
            sample.update(server_cpu_seconds=cpu, server_cpu_us_per_msg=1e6 * cpu / max(1, n),
                          server_kernel_us_per_msg=1e6 * kernel / max(1, n))
        if cell.workload == "w3":
            lat = sorted(r.latencies_ns)
            sample.update(value=percentile(lat, 0.5) / 1e6, p50_ms=percentile(lat, 0.5) / 1e6,
                          p99_ms=percentile(lat, 0.99) / 1e6, max_ms=(lat[-1] / 1e6 if lat else float("nan")),
                          samples=len(lat))
        return sample
    except Exception as e:
        return {"ok": False, "note": f"{type(e).__name__}: {e}"}
    finally:
        code = server.stop()
        if cell.server == "mqks" and code not in (0, None):
            say(f"  ! mqksd exited {code} on SIGTERM (expected 0)")
        if data_dir:
            shutil.rmtree(data_dir, ignore_errors=True)


PROBES = {"mqks": peers.MQKS_PROBE, "redis": peers.REDIS_PROBE, "beanstalkd": peers.BEANSTALKD_PROBE}
RECOVERY_LOG_LINES = {  # what each server logs about its own load, for the notes
    "mqks": re.compile(r"recovered (\d+) queues and (\d+) messages .* in ([\d.]+) s"),
    "redis": re.compile(r"DB loaded from (?:append only|disk)[^:]*: ([\d.]+) seconds"),
}


def run_disk(cell: Cell, cfg: Config, servers: Servers, pinned: bool) -> dict:
    """w5 w4-disk, and the recovery cell it names: `--w4-messages` queued with no consumer into a fresh
    data dir; a clean stop (SIGTERM: each server flushes its log); the bytes of the dir per message;
    then a restart on that dir, timed from spawn until it answers, and a count of what it holds."""
    server_core = SERVER_CORE if pinned else None
    gen_core = GENERATOR_CORE if pinned else None
    n = cfg.w4_messages
    recovery_key = f"{cell.workload} {cell.server} {cell.recovery}"
    recovery: dict = {"ok": False, "note": "not run: its w4-disk run failed"}
    data_dir = tempfile.mkdtemp(prefix=f"bench-{cell.server}-data-")
    server: peers.Server | None = None
    try:
        try:
            server = servers.start(cell.server, server_core, data_dir, cell.persist)
            r = loadgen.run_memory(cell.make(), server.host, server.port, n, gen_core, server.pid,
                                   cfg.timeout_seconds * 2)
            if "error" in r:
                return {"ok": False, "note": r["error"] + f" | server log: {server.log_tail(300)}",
                        "also": {recovery_key: recovery}}
            notes = [f"{r['errors']} error replies"] if r.get("errors") else []
            held = queued(server, cell.server)
            if held != n:
                notes.append(f"{held} queued (sent {n})")
            if cell.server == "redis":
                notes += wait_aof_rewrite(server, cfg.timeout_seconds)
            code = server.stop(grace_seconds=cfg.timeout_seconds)
            server = None
            if cell.server == "mqks" and code != 0:
                notes.append(f"mqksd exited {code} on SIGTERM (expected 0)")
            size, files = dir_bytes(data_dir)
            sample = {"ok": not notes, "value": size / n, "bytes": size, "files": len(files), "seconds": r["seconds"],
                      "fill_rate": n / max(1e-9, r["seconds"]), "note": "; ".join(notes),
                      "largest": ", ".join(f"{name} {nbytes / 2**20:.1f} MiB" for name, nbytes in files[:3])}
        except Exception as e:
            return {"ok": False, "note": f"{type(e).__name__}: {e}", "also": {recovery_key: recovery}}
        try:
            server = servers.start(cell.server, server_core, data_dir, cell.persist, wait=False)
            seconds = peers.seconds_until_answer(server, *PROBES[cell.server], timeout=cfg.timeout_seconds * 2)
            held = queued(server, cell.server)
            recovery = {"ok": held == n, "value": seconds, "note": "" if held == n else f"{held} recovered of {n}"}
            pattern = RECOVERY_LOG_LINES.get(cell.server)
            found = pattern.search(server.log_tail(20_000)) if pattern else None
            if found:
                recovery["logged_seconds"] = float(found.group(found.lastindex or 0))
                recovery["logged"] = found.group(0)
        except Exception as e:
            recovery = {"ok": False, "note": f"{type(e).__name__}: {e}"}
        sample["also"] = {recovery_key: recovery}
        return sample
    finally:
        if server is not None:
            server.stop(grace_seconds=cfg.timeout_seconds)
        shutil.rmtree(data_dir, ignore_errors=True)


def queued(server: peers.Server, kind: str) -> int:
    """Messages waiting in the w4 queue (MQKS), stream (Redis) or tube (beanstalkd)."""
    if kind == "mqks":
        return mqks_stats(server).get("messages_waiting", -1)
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        if kind == "redis":
            reply = loadgen.ask(sock, loadgen.resp(b"XLEN", b"bench.ev"), b"\r\n")
            return int(reply[1:reply.index(b"\r\n")]) if reply.startswith(b":") else -1
        return int(loadgen.tube_stats(sock).get(b"current-jobs-ready", b"-1"))


def wait_aof_rewrite(server: peers.Server, timeout: float) -> list[str]:
    """Let an AOF rewrite Redis started on its own (auto-aof-rewrite-*) finish before the stop; [] or why not."""
    deadline = time.monotonic() + timeout
    with socket.create_connection((server.host, server.port), timeout=timeout) as sock:
        while time.monotonic() < deadline:
            info = loadgen.ask(sock, loadgen.resp(b"INFO", b"persistence") + loadgen.resp(b"PING"), b"+PONG\r\n")
            if b"aof_rewrite_in_progress:0" in info and b"aof_rewrite_scheduled:0" in info:
                return []
            time.sleep(0.05)
    return ["an AOF rewrite was still running at the stop"]


def dir_bytes(path: str) -> tuple[int, list[tuple[str, int]]]:
    """(bytes in every file under `path`, [(file, bytes)] largest first): apparent sizes, so preallocated
    space (beanstalkd's binlog files) counts."""
    files = []
    for folder, _dirs, names in os.walk(path):
        for name in names:
            try:
                files.append((name, os.path.getsize(os.path.join(folder, name))))
            except OSError:
                pass
    files.sort(key=lambda f: -f[1])
    return sum(size for _, size in files), files


def summarize(values: list[float]) -> dict:
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def unit_of(cell: Cell) -> str:
    if cell.workload == "w5":
        return {"flow": "msg/s", "disk": "bytes/msg", "recovery": "s"}[cell.measure]
    return {"w1": "msg/s", "w2": "deliveries/s", "w3": "ms", "w4": "bytes/msg"}[cell.workload]


def idle_percent(seconds: float = 0.5) -> float:
    """How idle the machine is right now (others share it): 100 = nothing else runs."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields)

    idle0, total0 = sample()
    time.sleep(seconds)
    idle1, total1 = sample()
    return 100.0 * (idle1 - idle0) / max(1, total1 - total0)


def process_cpu_seconds(pid: int, kernel_only: bool = False) -> float:
    """utime + stime of a process, all its threads, from /proc (0.0 once it is gone); stime alone with
    `kernel_only`."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[12]) + (0 if kernel_only else int(fields[11]))) / os.sysconf("SC_CLK_TCK")


def busy_seconds() -> tuple[float, float]:
    """(CPU seconds every process on the machine has used, CPU seconds we and our children used)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    machine = (fields[0] + fields[1] + fields[2]) / tick  # user, nice, system: no irq/softirq, no steal
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        own += r.ru_utime + r.ru_stime
    return machine, own


def run_mode(mode: str, cfg: Config, servers: Servers) -> dict:
    pinned = mode == "pinned"
    idle = idle_percent()
    say(f"\n## mode: {mode}" + (" (server: taskset -c 0, generator: core 1)" if pinned else "")
        + f"; machine {idle:.0f}% idle before it, load average {os.getloadavg()[0]:.2f}")
    if idle < 80:
        say("  ! other work is running on this machine: expect wide ranges")
    machine0, own0 = busy_seconds()
    wall0 = time.monotonic()
    out = {"ceiling": measure_ceiling(cfg, pinned), "cells": [], "idle_percent_before": idle}
    for workload in cfg.workloads:
        cells = [c for c in cells_for(workload, cfg) if servers.available(c.server)]
        samples: dict[str, list[dict]] = {c.key: [] for c in cells}
        by_key = {c.key: c for c in cells}
        # w5: the 1M-message disk and recovery cells repeat --w4-reps times, the rest --reps times
        heavy = [c for c in cells if workload == "w4" or c.measure != "flow"]
        light = [c for c in cells if c not in heavy]
        for group, reps in ((light, cfg.reps), (heavy, cfg.w4_reps)):
            for rep in range(reps):  # interleaved, so a noisy minute hits every server alike
                for cell in group:
                    if cell.measure == "recovery":
                        continue  # its sample comes from the disk run of its server
                    s = run_cell(cell, cfg, servers, pinned)
                    also = s.pop("also", {})
                    samples[cell.key].append(s)
                    say(f"  {mode} rep {rep + 1}/{reps} {cell.key:<48} {_sample_text(cell, s)}")
                    for key, s2 in also.items():
                        samples[key].append(s2)
                        say(f"  {mode} rep {rep + 1}/{reps} {key:<48} {_sample_text(by_key[key], s2)}")
        for cell in cells:
            ss = samples[cell.key]
            good = [s for s in ss if s.get("ok")]
            entry = {"key": cell.key, "workload": cell.workload, "server": cell.server, "variant": cell.variant,
                     "rate": cell.rate, "unit": unit_of(cell), "samples": ss,
                     "failed": len(ss) - len(good),
                     "notes": sorted({s["note"] for s in ss if s.get("note")})}
            if cell.workload == "w3":
                entry["p50_ms"] = summarize([s["p50_ms"] for s in good])
                entry["p99_ms"] = summarize([s["p99_ms"] for s in good])
            entry.update(summarize([s["value"] for s in good]))
            out["cells"].append(entry)
    out["ratios"] = ratios(out["cells"], cells_not_run(cfg, servers))
    machine1, own1 = busy_seconds()
    cores = os.cpu_count() or 1
    foreign = max(0.0, (machine1 - machine0) - (own1 - own0)) / max(1e-9, time.monotonic() - wall0) / cores
    out["foreign_cpu_percent"] = 100 * foreign
    say(f"  other processes used {100 * foreign:.0f}% of the machine's {cores} cores during this mode")
    return out


def _sample_text(cell: Cell, s: dict) -> str:
    if not s.get("ok") and "value" not in s:
        return f"FAILED {s.get('note', '')}"
    if cell.workload == "w3":
        text = f"p50 {s['p50_ms']:.3f} ms  p99 {s['p99_ms']:.3f} ms  max {s['max_ms']:.1f} ms  ({s['samples']} msgs)"
    elif cell.workload == "w4":
        text = f"{s['value']:.1f} bytes/msg (RSS {s['rss0'] / 2**20:.1f} -> {s['rss1'] / 2**20:.1f} MiB)"
    elif cell.measure == "disk":
        text = (f"{s['value']:.1f} bytes/msg ({s['bytes'] / 2**20:.1f} MiB in {s['files']} files, largest: "
                f"{s['largest']}; queued at {s['fill_rate']:,.0f} msg/s)")
    elif cell.measure == "recovery":
        text = f"{s['value']:.3f} s from spawn to answer" + (f" (its log: {s['logged']})" if s.get("logged") else "")
    else:
        text = f"{s['value']:>12,.0f} {unit_of(cell)}  (producer wrote {s['send_rate']:,.0f} msg/s)"
        if "server_cpu_us_per_msg" in s:
            text += (f"  server CPU {s['server_cpu_us_per_msg']:.2f} us/msg "
                     f"({s.get('server_kernel_us_per_msg', 0):.2f} in the kernel)")
    if s.get("note"):
        text += f"  [{s['note'][:200]}]"
    return text


# Generator ceiling

# the shapes the ceiling is measured for; print_tables compares each w1/w2 cell with one of them
CEILING_PUSH, CEILING_PARSED, CEILING_FANOUT = "w1 auto-ack", "w1 manual-ack", "w2 fan-out 20"


def measure_ceiling(cfg: Config, pinned: bool) -> dict:
    """The generator against a sink that does nothing: the most any server could show here."""
    server_core = SERVER_CORE if pinned else None
    gen_core = GENERATOR_CORE if pinned else None
    n = cfg.w1_messages * 2  # long enough that start-up is noise
    shapes = [(CEILING_PUSH, Mqks(), 1, n), (CEILING_PARSED, Mqks(manual_ack=True), 1, n),
              (CEILING_FANOUT, Mqks(), 20, cfg.w2_events * 2)]
    result = {}
    for label, proto, fanout, count in shapes:
        values = []
        for _ in range(max(1, min(cfg.reps, 2))):
            sink = peers.start_sink(server_core, LOG_DIR, deliver=count)
            try:
                flow = Flow(proto=proto, host=sink.host, port=sink.port, n=count, fanout=fanout,
                            window=10**12, core=gen_core, timeout_s=cfg.timeout_seconds,
                            counter_binary=cfg.counter_binary)
                r = loadgen.run_flow(flow)
                if r.ok:
                    values.append(r.rate)
                else:
                    say(f"  ! ceiling {label}: {r.note}")
            finally:
                sink.stop()
        result[label] = summarize(values)
        s = result[label]
        if s["n"]:
            say(f"  generator ceiling {label:<16} {s['median']:>12,.0f} /s  [{s['min']:,.0f} .. {s['max']:,.0f}]")
    return result


# Ratios


PLAIN = "plain Python"  # the variant suffix of MQKS cells run with MQKS_PURE=1

RATIOS = [
    # label, numerator key, denominator key, target, higher_is_better
    ("w1 auto-ack: MQKS / Redis Streams (no ack)", "w1 mqks auto-ack", "w1 redis streams", 1.0, True),
    ("w1 manual-ack: MQKS / Redis Streams + XACK", "w1 mqks manual-ack", "w1 redis streams+xack", 1.0, True),
    ("w1 manual-ack, an ack per message: MQKS / Redis Streams + one XACK per message",
     "w1 mqks manual-ack, an ack line per message", "w1 redis streams+xack per message", 1.5, True),
    ("w1 auto-ack: MQKS / Redis pub/sub", "w1 mqks auto-ack", "w1 redis pubsub", 1.0, True),
    ("w2: MQKS / Redis pub/sub (PSUBSCRIBE)", "w2 mqks 10 exact + 10 mask queues",
     "w2 redis 10 SUBSCRIBE + 10 PSUBSCRIBE", 0.8, True),
    ("w4 bytes/msg: MQKS / Redis Streams", "w4 mqks 1 queue, no consumer", "w4 redis streams XADD", 1.0, False),
    (f"w4 bytes/msg, {RANDOM_PAYLOAD}: MQKS / Redis Streams", f"w4 mqks {W4_RANDOM}",
     f"w4 redis streams XADD, {RANDOM_PAYLOAD}", 1.0, False),
    # the compiled hot path (setup.py, server/build.py) against its own plain sources, same run
    ("w1 auto-ack: MQKS compiled / MQKS plain Python", "w1 mqks auto-ack", f"w1 mqks auto-ack, {PLAIN}", None, True),
    ("w1 an ack per message: MQKS compiled / MQKS plain Python", "w1 mqks manual-ack, an ack line per message",
     f"w1 mqks manual-ack, an ack line per message, {PLAIN}", None, True),
    ("w2: MQKS compiled / MQKS plain Python", "w2 mqks 10 exact + 10 mask queues",
     f"w2 mqks 10 exact + 10 mask queues, {PLAIN}", None, True),
    ("w1 auto-ack, plain Python: MQKS / Redis pub/sub", f"w1 mqks auto-ack, {PLAIN}", "w1 redis pubsub", None, True),
    ("w1 auto-ack: MQKS / beanstalkd", "w1 mqks auto-ack", "w1 beanstalkd put/reserve/delete", 1.0, True),
    ("w1 manual-ack: MQKS / beanstalkd", "w1 mqks manual-ack", "w1 beanstalkd put/reserve/delete", 1.0, True),
    ("w3@5k p99: MQKS / beanstalkd", "w3@5k mqks auto-ack", "w3@5k beanstalkd put/reserve/delete", 1.0, False),
    ("w3@20k p99: MQKS / beanstalkd", "w3@20k mqks auto-ack", "w3@20k beanstalkd put/reserve/delete", 1.0, False),
    ("w4 bytes/msg: MQKS / beanstalkd", "w4 mqks 1 queue, no consumer", "w4 beanstalkd put", 1.0, False),
    # the plain auto-ack cell is counted by bench/bin/count in C, the TLS one in Python: the manual-ack
    # ratio (both parsed in Python) is the like-for-like cost of TLS
    ("w1 manual-ack: MQKS over TLS / MQKS plain", "w1 mqks manual-ack over TLS", "w1 mqks manual-ack", None, True),
    ("w1 auto-ack: MQKS over TLS / MQKS plain", "w1 mqks auto-ack over TLS", "w1 mqks auto-ack", None, True),
    ("w1 auto-ack: MQKS / NATS core", "w1 mqks auto-ack", "w1 nats core", None, True),
    ("w2: MQKS / NATS", "w2 mqks 10 exact + 10 mask queues", "w2 nats 10 exact + 10 * subs", None, True),
    ("w5 confirmed+ack, always: MQKS / Redis Streams", f"w5 mqks {W5_MQKS_ALWAYS}", f"w5 redis {W5_REDIS_ALWAYS}",
     1.2, True),
    ("w5 confirmed+ack: MQKS fsync always / MQKS in memory", f"w5 mqks {W5_MQKS_ALWAYS}",
     f"w5 mqks {W5_MQKS_MEMORY}", 0.7, True),
    ("w5 confirmed+ack, everysec: MQKS / Redis Streams", f"w5 mqks {W5_MQKS_EVERYSEC}",
     f"w5 redis {W5_REDIS_EVERYSEC}", 1.0, True),
    ("w5 recovery seconds: MQKS / Redis AOF", "w5 mqks recovery, fsync everysec", "w5 redis recovery, AOF everysec",
     None, False),
    ("w5 disk bytes/msg: MQKS / Redis AOF", "w5 mqks w4-disk, fsync everysec",
     "w5 redis w4-disk streams XADD, AOF everysec", None, False),
    ("w5 confirmed+ack, everysec: MQKS / MQKS in memory", f"w5 mqks {W5_MQKS_EVERYSEC}",
     f"w5 mqks {W5_MQKS_MEMORY}", None, True),
    ("w5 confirmed+ack, fsync each: MQKS always / beanstalkd -f 0", f"w5 mqks {W5_MQKS_ALWAYS}",
     "w5 beanstalkd w1ack-confirmed put/reserve/delete, binlog -f 0", None, True),
    ("w5 confirmed+ack: MQKS everysec / beanstalkd -f 50", f"w5 mqks {W5_MQKS_EVERYSEC}",
     "w5 beanstalkd w1ack-confirmed put/reserve/delete, binlog -f 50", None, True),
    ("w5 disk bytes/msg: MQKS / beanstalkd binlog", "w5 mqks w4-disk, fsync everysec",
     "w5 beanstalkd w4-disk put, binlog -f 50", None, False),
]


class MissingCellError(LookupError):
    """A ratio names a cell that no workload defines, or that this run should have measured and did not."""


def check_ratio_cells(cfg: Config) -> None:
    """Every cell a ratio names is one the workloads define; checked before any run, so a renamed cell
    fails in a second, not after the measurements."""
    known = {c.key for w in WORKLOADS for c in cells_for(w, cfg)}
    for label, num, den, _target, _higher in RATIOS:
        for key in (num, den):
            if key not in known:
                raise MissingCellError(f"the ratio {label!r} names the cell {key!r}, which no workload defines; "
                                       f"the cells are: {', '.join(map(repr, sorted(known)))}")


def cells_not_run(cfg: Config, servers: Servers) -> dict[str, str]:
    """The cells this run leaves out on purpose (workload not asked for, peer skipped): key -> why."""
    not_run = {}
    for workload in WORKLOADS:
        for cell in cells_for(workload, cfg):
            if workload not in cfg.workloads:
                not_run[cell.key] = f"{workload} not in --workloads"
            elif not servers.available(cell.server):
                not_run[cell.key] = f"{cell.server} skipped"
    return not_run


def ratios(cells: list[dict], not_run: dict[str, str]) -> list[dict]:
    """One row per RATIOS entry. A cell left out on purpose gives a row without a ratio that says why;
    any other cell that is not among `cells` raises MissingCellError naming it."""
    by_key = {c["key"]: c for c in cells}
    out = []
    for label, num, den, target, higher in RATIOS:
        for key in (num, den):
            if key not in by_key and key not in not_run:
                raise MissingCellError(f"the ratio {label!r} needs the cell {key!r}, which this run did not "
                                       f"measure; measured: {', '.join(map(repr, sorted(by_key))) or 'nothing'}")
        why = sorted({not_run[key] for key in (num, den) if key not in by_key})
        if why:
            out.append({"label": label, "ratio": None, "target": target, "higher_is_better": higher, "met": None,
                        "not_run": "; ".join(why)})
            continue
        a, b = by_key[num], by_key[den]
        if a["workload"] == "w3":
            va, vb = a["p99_ms"]["median"], b["p99_ms"]["median"]
        else:
            va, vb = a["median"], b["median"]
        if va is None or not vb:
            out.append({"label": label, "ratio": None, "target": target, "met": None})
            continue
        ratio = va / vb
        met = None if target is None else (ratio >= target if higher else ratio <= target)
        out.append({"label": label, "ratio": ratio, "target": target, "higher_is_better": higher, "met": met})
    return out


# Output


def fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit in ("ms", "s"):
        return f"{v:.3f}"
    if unit == "bytes/msg":
        return f"{v:.1f}"
    return f"{v:,.0f}"


def print_tables(results: dict, cfg: Config) -> None:
    for mode, res in results["modes"].items():
        say(f"\n### {mode}  (other processes used {res.get('foreign_cpu_percent', 0):.0f}% of the CPUs meanwhile)\n")
        ceil = res["ceiling"]
        say("generator ceiling (trivial sink, MQKS protocol): " + ", ".join(
            f"{k} {fmt(v['median'], 'msg/s')}/s" for k, v in ceil.items() if v["n"]))
        say("")
        say("| workload | server | variant | unit | median | range (min .. max) | runs | notes |")
        say("|---|---|---|---|---:|---|---:|---|")
        for c in res["cells"]:
            wl = c["workload"] + (f"@{c['rate'] // 1000}k/s" if c["rate"] else "")
            runs = f"{c['n']}" + (f" (+{c['failed']} failed)" if c["failed"] else "")
            notes = "; ".join(c["notes"])[:160]
            if c["workload"] == "w3":
                for q in ("p50_ms", "p99_ms"):
                    s = c[q]
                    say(f"| {wl} | {c['server']} | {c['variant']} | {q[:3]} ms | {fmt(s['median'], 'ms')} | "
                        f"{fmt(s['min'], 'ms')} .. {fmt(s['max'], 'ms')} | {runs} | {notes} |")
                continue
            u = c["unit"]
            say(f"| {wl} | {c['server']} | {c['variant']} | {u} | {fmt(c['median'], u)} | "
                f"{fmt(c['min'], u)} .. {fmt(c['max'], u)} | {runs} | {notes} |")
        say("")
        say("| ratio (medians) | value | target | verdict |")
        say("|---|---:|---|---|")
        for r in res["ratios"]:
            if r.get("not_run"):
                say(f"| {r['label']} | - | - | not run ({r['not_run']}) |")
                continue
            if r["ratio"] is None:
                say(f"| {r['label']} | - | - | no data |")
                continue
            tgt = "-" if r["target"] is None else ("≥ " if r["higher_is_better"] else "≤ ") + f"{r['target']:.1f}"
            verdict = "info" if r["met"] is None else ("met" if r["met"] else "MISSED")
            say(f"| {r['label']} | {r['ratio']:.2f}x | {tgt} | {verdict} |")
        near = []
        for c in res["cells"]:
            if c["workload"] == "w2":
                shape = CEILING_FANOUT
            elif c["workload"] == "w1":
                # push deliveries are counted like auto-ack; the rest are parsed in Python like acks
                push = c["variant"] in ("auto-ack", "pubsub", "core")
                shape = CEILING_PUSH if push else CEILING_PARSED
            else:
                continue
            top = ceil[shape]["median"]  # measure_ceiling measures every shape, even when its runs fail
            if c["median"] and top and c["median"] > 0.7 * top:
                near.append(f"{c['key']} ({c['median'] / top:.0%} of {shape})")
        if near:
            say(f"\nnote: within 70% of the generator ceiling (figures are a floor): {', '.join(near)}")


def print_ratio_summary(results: dict) -> None:
    """Pinned and unpinned side by side, for the targets."""
    modes = list(results["modes"])
    if len(modes) < 2:
        return
    say("\n### targets, " + " vs ".join(modes) + "\n")
    say("| ratio (medians) | " + " | ".join(modes) + " | target |")
    say("|---|" + "---:|" * len(modes) + "---|")
    by_mode = {m: {r["label"]: r for r in results["modes"][m]["ratios"]} for m in modes}
    for label, _num, _den, target, higher in RATIOS:
        cells = []
        for m in modes:
            r = by_mode[m][label]  # ratios() gives every label a row
            if r["ratio"] is None:
                cells.append("-")
            else:
                mark = "" if r["met"] is None else (" met" if r["met"] else " MISSED")
                cells.append(f"{r['ratio']:.2f}x{mark}")
        if all(c == "-" for c in cells):
            continue
        tgt = "-" if target is None else ("≥ " if higher else "≤ ") + f"{target:.1f}"
        say(f"| {label} | " + " | ".join(cells) + f" | {tgt} |")


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "-C", BENCH_DIR, "describe", "--always", "--dirty"],
                             capture_output=True, timeout=10).stdout.decode().strip()
        return rev or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def run_benchmark(cfg: Config) -> int:
    shutil.rmtree(LOG_DIR, ignore_errors=True)  # logs of the last run only
    os.makedirs(LOG_DIR, exist_ok=True)
    say(f"# MQKS benchmark  {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  quick={cfg.quick}  "
        f"modes={','.join(cfg.modes)}  workloads={','.join(cfg.workloads)}")
    say(f"# w1 {cfg.w1_messages:,} msgs, w2 {cfg.w2_events:,} events x 20, w3 {cfg.w3_seconds:g}s at "
        f"{'/'.join(str(r) for r in cfg.w3_rates)} msg/s, w4 {cfg.w4_messages:,} msgs; "
        f"reps {cfg.reps} (w4 {cfg.w4_reps}); payload 100 bytes")
    if "w5" in cfg.workloads:
        say(f"# w5 (durable): w1ack-confirmed {cfg.w1_messages:,} msgs, at most {cfg.window:,} unconfirmed; "
            f"w4-disk and recovery {cfg.w4_messages:,} msgs; data dirs under {tempfile.gettempdir()}")
    servers = Servers(cfg)
    if servers.mqks_python and servers.mqks_python != sys.executable:
        say(f"# mqksd runs under {servers.mqks_python} ({sys.executable} cannot import mqks.server)")
    for kind, why in servers.skipped.items():
        say(f"# SKIPPED peer {kind}: {why}")
    servers.versions["mqks"] += f" (git {git_revision()})"
    say("# versions: " + "; ".join(f"{k}: {v}" for k, v in servers.versions.items()))
    say("# push deliveries (MQKS auto-ack, Redis pub/sub, NATS) counted by "
        + (f"{cfg.counter_binary} (bench/count.c)" if cfg.counter_binary else "Python (no gcc, or --py-consumer)")
        + "; acks, XREADGROUP, reserve/delete and w3 timestamps are parsed in Python")
    started = time.monotonic()
    results = {"meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
                        "cpus": os.cpu_count(), "python": sys.version.split()[0], "config": cfg.__repr__(),
                        "versions": servers.versions, "skipped": servers.skipped},
               "modes": {}}
    for mode in cfg.modes:
        results["modes"][mode] = run_mode(mode, cfg, servers)
    results["meta"]["seconds"] = time.monotonic() - started
    print_tables(results, cfg)
    print_ratio_summary(results)
    os.makedirs(os.path.dirname(os.path.abspath(cfg.json_path)), exist_ok=True)
    for res in results["modes"].values():
        for c in res["cells"]:
            for s in c["samples"]:
                s.pop("latencies_ns", None)
    with open(cfg.json_path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, default=str)
    say(f"\n# done in {results['meta']['seconds']:.0f}s; JSON: {cfg.json_path}")
    return 0


# Profile


def run_profile(cfg: Config) -> int:
    """mqksd under cProfile through w1 auto-ack, w1 manual-ack and w2; prints the top 15 by tottime."""
    os.makedirs(LOG_DIR, exist_ok=True)
    pinned = cfg.modes[0] == "pinned"
    gen_core = GENERATOR_CORE if pinned else None
    prof_path = os.path.join(RESULTS_DIR, f"mqksd-{time.strftime('%Y%m%d-%H%M%S')}.prof")
    python = peers.mqks_python()
    if python is None:
        say(f"! {sys.executable} cannot import mqks.server: run with the repo's venv (.venv/bin/python)")
        return 1
    server = peers.start_mqks(SERVER_CORE if pinned else None, LOG_DIR, python=python, profile_path=prof_path)
    n = cfg.w1_messages
    runs = [("w1 auto-ack", Mqks(event=b"p1.ev"), 1, n),
            ("w1 manual-ack", Mqks(manual_ack=True, event=b"p2.ev"), 1, n),
            ("w2 10 exact + 10 mask", Mqks(event=b"p3.ev"), 20, max(1, n // 20))]
    try:
        for label, proto, fanout, count in runs:
            flow = Flow(proto=proto, host=server.host, port=server.port, n=count, fanout=fanout,
                        window=cfg.window, core=gen_core, timeout_s=cfg.timeout_seconds * 2,
                        counter_binary=cfg.counter_binary)
            r = loadgen.run_flow(flow)
            say(f"  profiled {label:<24} {r.rate:>12,.0f} /s under cProfile" + (f"  [{r.note}]" if r.note else ""))
    finally:
        code = server.stop(grace_seconds=30)
    if code != 0 or not os.path.exists(prof_path):
        say(f"! mqksd exited {code} on SIGTERM; profile written: {os.path.exists(prof_path)}")
        say(server.log_tail(1500))
        if not os.path.exists(prof_path):
            return 1
    text = io.StringIO()
    stats = pstats.Stats(prof_path, stream=text)
    stats.strip_dirs().sort_stats("tottime").print_stats(15)
    say(text.getvalue())
    say(f"# profile: {prof_path}  (python -m pstats {prof_path})")
    return 0


def run_profile_w5(cfg: Config) -> int:
    """mqksd under cProfile through the w5 w1ack-confirmed flow: in memory, --fsync always, --fsync everysec,
    one server each; the top 15 by tottime of each, and the CPU seconds of each of the server's threads
    (cProfile sees only the event loop's thread; the log's writer thread shows up there)."""
    os.makedirs(LOG_DIR, exist_ok=True)
    pinned = cfg.modes[0] == "pinned"
    gen_core = GENERATOR_CORE if pinned else None
    python = peers.mqks_python()
    if python is None:
        say(f"! {sys.executable} cannot import mqks.server: run with the repo's venv (.venv/bin/python)")
        return 1
    stamp = time.strftime("%Y%m%d-%H%M%S")
    code = 0
    for fsync in ("", "always", "everysec"):
        label = f"fsync {fsync}" if fsync else "in memory"
        prof_path = os.path.join(RESULTS_DIR, f"mqksd-w5-{fsync or 'memory'}-{stamp}.prof")
        data_dir = tempfile.mkdtemp(prefix="bench-mqks-data-") if fsync else None
        server = peers.start_mqks(SERVER_CORE if pinned else None, LOG_DIR, python=python, profile_path=prof_path,
                                  data_dir=data_dir, fsync=fsync or "always")
        threads: dict[str, float] = {}
        try:
            flow = Flow(proto=Mqks(manual_ack=True, confirm=True), host=server.host, port=server.port,
                        n=cfg.w1_messages, window=cfg.window, core=gen_core, timeout_s=cfg.timeout_seconds * 2,
                        counter_binary=cfg.counter_binary, confirm=True)
            r = loadgen.run_flow(flow)
            threads = thread_cpu_seconds(server.pid)
            say(f"\n## w5 w1ack-confirmed, {label}: {r.rate:,.0f} msg/s under cProfile"
                + (f"  [{r.note}]" if r.note else ""))
        finally:
            exit_code = server.stop(grace_seconds=30)
            if data_dir:
                shutil.rmtree(data_dir, ignore_errors=True)
        say("server CPU seconds by thread (whole life, start-up included): "
            + ", ".join(f"{name} {sec:.2f}" for name, sec in threads.items()))
        if exit_code != 0 or not os.path.exists(prof_path):
            say(f"! mqksd exited {exit_code} on SIGTERM; profile written: {os.path.exists(prof_path)}")
            say(server.log_tail(1500))
            code = 1
            continue
        text = io.StringIO()
        pstats.Stats(prof_path, stream=text).strip_dirs().sort_stats("tottime").print_stats(15)
        say(text.getvalue().strip())
        say(f"# profile: {prof_path}")
    return code


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """utime + stime of each thread of `pid`, by `tid:comm`, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[f"{tid}:{comm}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def compare(before_path: str, after_path: str) -> int:
    """Medians of two runs side by side, per mode and cell, with after/before."""
    with open(before_path, encoding="utf-8") as f:
        before = json.load(f)
    with open(after_path, encoding="utf-8") as f:
        after = json.load(f)
    for mode, res in after["modes"].items():
        old = {c["key"]: c for c in before.get("modes", {}).get(mode, {}).get("cells", [])}
        say(f"\n### {mode}: {before_path} -> {after_path}\n")
        say("| cell | unit | before | after | after/before |")
        say("|---|---|---:|---:|---:|")
        for c in res["cells"]:
            b = old.get(c["key"])
            for q in (("p50_ms", "p99_ms") if c["workload"] == "w3" else (None,)):
                va = c[q]["median"] if q else c["median"]
                vb = (b[q]["median"] if q else b["median"]) if b else None
                unit = f"{q[:3]} ms" if q else c["unit"]
                change = f"{va / vb:.2f}x" if va is not None and vb else "-"
                say(f"| {c['key']} | {unit} | {fmt(vb, c['unit'])} | {fmt(va, c['unit'])} | {change} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = build_config(argv)
    if cfg.compare:
        return compare(*cfg.compare)
    if cfg.profile:
        return run_profile_w5(cfg) if "w5" in cfg.workloads else run_profile(cfg)
    try:
        check_ratio_cells(cfg)
        return run_benchmark(cfg)
    except MissingCellError as e:
        say(f"bench.run: error: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Multi-worker scaling (issue 13): 64 queues spread over `mqksd --workers 1` and `--workers 2`, in one run.

    .venv/bin/python -m bench.workers [--quick] [--workers 1,2] [--variants auto-ack,manual-ack]
                                      [--queues 64] [--groups 4] [--messages N] [--reps N] [--json PATH]

(from the repository root; ~25 s with the defaults, one repetition of 8 cells: take `--reps 3` for
figures to quote, `--quick` for a smoke run of a few seconds). Spread cells: the queues are split
into `--groups` groups whose queues share an owner (server/dispatch/slots.py `owner_of`); each group gets one
producer connection (publishing to its queues in turn, each queue bound to its own event) and one
consumer connection (consuming all of them), each driven by its own generator process, connected to
the owner's direct port when `hello` lists one, else to the public port. Every cell runs on a fresh,
unpinned server (N workers need N cores). The table gives aggregate deliveries/s, the server's CPU
per delivery and cores used, and the generator's share of the cores (CPU seconds of the generator
processes / wall / cores); where server and generator together keep every core busy, the machine,
not the broker, bounds the ratio, and a note says so. The ratios are N workers / 1 worker (target >=
1.6x for 2) and w1 on one queue (loadgen's own flow) through a non-owner worker / through the owner
(target >= 0.8x; "n/a" while `hello` has no "direct" addresses). The table, then one JSON line on
stdout; the same JSON goes to bench/results/workers-*.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import operator
import os
import re
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from mqks.server.dispatch.slots import owner_of

from . import loadgen, peers
from .loadgen import ConsumerState, Flow, Mqks, MqksAutoState
from .run import LOG_DIR, RESULTS_DIR, busy_seconds, git_revision, idle_percent, summarize

SPREAD_TARGET, NON_OWNER_TARGET = 1.6, 0.8
VARIANTS = ("auto-ack", "manual-ack")
ONE_QUEUE = b"bench.qx0"  # the queue loadgen.Mqks consumes: the one-queue cells reuse its w1 flow as is


@dataclass(frozen=True, slots=True)
class Config:
    workers: tuple[int, ...]
    variants: tuple[str, ...]
    queues: int
    groups: int
    messages: int          # per spread cell, over all groups
    one_queue_messages: int
    reps: int
    window: int
    timeout_seconds: float
    json_path: str
    counter_binary: str | None


def build_config(argv: list[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(prog="python -m bench.workers",
                                     description="mqksd --workers scaling: 64 queues spread, and one queue via a "
                                                 "non-owner worker vs the owner.")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny counts, well under a second a cell")
    parser.add_argument("--workers", default="1,2", help="worker counts to compare with 1 (default %(default)s)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="w1 variants (default %(default)s)")
    parser.add_argument("--queues", type=int, default=64, help="queues spread over the workers (default 64)")
    parser.add_argument("--groups", type=int, default=4,
                        help="queue groups, each with one producer and one consumer connection and process; "
                             "a multiple of every worker count (default 4)")
    parser.add_argument("--messages", type=int,
                        help="messages per spread cell, over all groups (default 1000000, quick 20000); "
                             "the one-queue cells run half as many")
    parser.add_argument("--reps", type=int, default=1, help="repetitions per cell, interleaved (default 1)")
    parser.add_argument("--window", type=int, default=50_000, help="max messages a producer runs ahead of its group")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds one cell may take (default 60)")
    parser.add_argument("--json", dest="json_path", help="where to write the JSON (default bench/results/...)")
    parser.add_argument("--py-consumer", action="store_true",
                        help="count and ack deliveries in Python too, not with the gcc-built bench/bin/count and ack")
    a = parser.parse_args(argv)
    workers = tuple(sorted({int(w) for w in a.workers.split(",") if w.strip()} | {1}))
    variants = tuple(v.strip() for v in a.variants.split(",") if v.strip())
    if any(w < 1 for w in workers):
        parser.error("--workers: counts are 1 or more")
    if bad := [v for v in variants if v not in VARIANTS]:
        parser.error(f"unknown variants {bad}; known: {', '.join(VARIANTS)}")
    if bad_w := [w for w in workers if a.groups % w]:
        parser.error(f"--groups {a.groups} is not a multiple of the worker counts {bad_w}: "
                     "every worker should drive as many groups")
    if a.queues < a.groups:
        parser.error("--queues must be at least --groups")
    messages = a.messages or (20_000 if a.quick else 1_000_000)
    suffix = time.strftime("%Y%m%d-%H%M%S") + ("-quick" if a.quick else "")
    return Config(workers=workers, variants=variants, queues=a.queues, groups=a.groups, messages=messages,
                  one_queue_messages=max(1, messages // 2), reps=a.reps, window=a.window,
                  timeout_seconds=a.timeout,
                  json_path=a.json_path or os.path.join(RESULTS_DIR, f"workers-{suffix}.json"),
                  counter_binary=None if a.py_consumer else loadgen.build_counter())


def say(text: str = "") -> None:
    print(text, flush=True)


# Where the workers are


@dataclass(frozen=True, slots=True)
class Topology:
    """What `hello` told: the worker count and each worker's direct (host, port), or None without "direct"."""

    workers: int
    direct: dict[int, tuple[str, int]] | None

    def address(self, worker: int, public: tuple[str, int]) -> tuple[str, int]:
        return self.direct[worker] if self.direct else public


def topology(host: str, port: int) -> Topology:
    with loadgen.connect(host, port) as sock:
        line = loadgen.ask(sock, b"h hello\n", b"\n").split(b"\n", 1)[0]
    if not line.startswith(b"h ok "):
        raise RuntimeError(f"hello failed: {line[:300]!r}")
    hello = json.loads(line[5:])
    direct = hello.get("direct")
    return Topology(workers=hello.get("workers", 1),
                    direct={d["worker"]: (d["host"], d["port"]) for d in direct} if direct else None)


def wait_direct(topo: Topology, timeout: float = peers.READY_TIMEOUT_SECONDS) -> None:
    """Until every direct address accepts: the public port answering says only that one worker is up."""
    deadline = time.monotonic() + timeout
    for host, port in (topo.direct or {}).values():
        while True:
            try:
                socket.create_connection((host, port), timeout=2).close()
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"direct port {host}:{port} not accepting in {timeout:.0f}s: {e}") from e
                time.sleep(0.03)


def queue_groups(queues: list[bytes], workers: int, groups: int) -> list[tuple[int, list[bytes]]]:
    """(owner, queues) for `groups` groups: each worker's queues dealt into groups // workers groups."""
    by_owner: dict[int, list[bytes]] = {w: [] for w in range(workers)}
    for queue in queues:
        by_owner[owner_of(queue, workers)].append(queue)
    per_worker = groups // workers
    out = []
    for owner, owned in by_owner.items():
        out += [(owner, owned[i::per_worker]) for i in range(per_worker) if owned[i::per_worker]]
    return out


# One queue group's dialect


class GroupAckState(ConsumerState):
    """Manual-ack deliveries of several consumers on one connection: one batch ack per consumer per chunk
    (bench/ack.c does the same in C when gcc is there; this is its fallback, and `--py-consumer`)."""

    push_only = False
    acks_in_c = True
    ID_RE = re.compile(rb"(c\d+) ok (\S+) event=")

    def feed(self, data: bytes, start: int, end: int) -> tuple[int, bytes]:
        if data.find(b" error ", start, end) >= 0:
            self.errors += data.count(b" error ", start, end)
        pairs = self.ID_RE.findall(data, start, end)
        if not pairs:
            return 0, b""
        pairs.sort()  # sort + groupby run in C: no Python step per delivery
        second = operator.itemgetter(1)
        acks = [b"a ack " + consumer_id + b" " + b" ".join(map(second, same)) + b"\n"
                for consumer_id, same in itertools.groupby(pairs, operator.itemgetter(0))]
        return len(pairs), b"".join(acks)


class MqksGroup(Mqks):
    """Publishes to a group's queues in turn (each bound to an event named as the queue); one connection
    consumes them all, consumer `c{j}` on queue j."""

    def __init__(self, queues: list[bytes], manual_ack: bool = False) -> None:
        super().__init__(manual_ack=manual_ack)
        self.queues = queues

    def publish(self, start: int, count: int, ts_ns: int = 0) -> bytes:
        queues, k, body = self.queues, len(self.queues), loadgen.payload(ts_ns)
        return b"".join([b"m%d publish %s %s\n" % (i, queues[i % k], body) for i in range(start, start + count)])

    def consumer_setup(self, sock: socket.socket, index: int) -> tuple[ConsumerState, bytes]:
        flags = b" --manual-ack" if self.manual_ack else b""
        sock.sendall(b"".join(b"c%d consume --confirm %s %s%s\n" % (j, q, q, flags)
                              for j, q in enumerate(self.queues)))
        buf, confirmed = b"", 0
        while confirmed < len(self.queues):
            buf = loadgen.read_until(sock, b"\n", buf)
            line, _, buf = buf.partition(b"\n")
            if b" error " in line:
                raise RuntimeError(f"mqks consume failed: {line!r}")
            confirmed += line.rstrip().endswith(b" ok")
        return (GroupAckState() if self.manual_ack else MqksAutoState()), b""


# Measuring


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid`, its reaped children (cutime, cstime) and its live descendants; 0.0 once gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        children = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                children += [int(c) for c in f.read().split()]
    except OSError:
        return 0.0
    own = sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return own + sum(tree_cpu_seconds(child) for child in children)


def broker_check(host: str, port: int, n: int, manual_ack: bool) -> Callable[[], str]:
    """After a cell: the broker's `stats` (summed over the workers) add up to `n` published and consumed
    (and acked); returns '' or what did not. Acks are fire-and-forget: the last batch gets 3 s."""

    def check() -> str:
        deadline = time.monotonic() + 3
        while True:
            try:
                with loadgen.connect(host, port) as sock:
                    line = loadgen.ask(sock, b"s stats\n", b"\n").split(b"\n", 1)[0]
                st = json.loads(line[5:]) if line.startswith(b"s ok ") else {}
            except (OSError, ValueError) as e:
                return f"stats unavailable: {e}"
            problems = [f"{key}={st.get(key)} (expected {want})"
                        for key, want in (("published", n), ("consumed", n), ("messages_waiting", 0),
                                          *((("acked", n), ("messages_unacked", 0)) if manual_ack else ()))
                        if st.get(key) != want]
            if not problems or time.monotonic() > deadline:
                return ("stats: " + ", ".join(problems)) if problems else ""
            time.sleep(0.1)

    return check


@dataclass
class SpreadRun:
    ok: bool
    rate: float = 0.0           # deliveries/s over all groups, first publish to last delivery
    got: int = 0
    seconds: float = 0.0
    generator_cpu_seconds: float = 0.0
    wall_seconds: float = 0.0   # the window both CPU figures cover: go to the last result
    server_cpu_seconds: float = 0.0
    note: str = ""


def run_groups(flows: list[Flow], server_pid: int, check: Callable[[], str]) -> SpreadRun:
    """loadgen's producer and consumer processes for every flow at once, started by one `go`; the
    aggregate rate, and the CPU of the generator processes and of the server over the same window."""
    ctx = mp.get_context("fork")
    go, stop = ctx.Event(), ctx.Event()
    deadline_ns = ctx.RawValue("q", 0)
    procs, waits = [], []
    for flow in flows:
        counter = ctx.RawValue("q", 0)
        pipes = [ctx.Pipe(False) for _ in range(4)]  # consumer ready, consumer result, producer ready, result
        procs += [ctx.Process(target=loadgen.consumer_main, daemon=True,
                              args=(flow, counter, deadline_ns, pipes[0][1], stop, pipes[1][1], False)),
                  ctx.Process(target=loadgen.producer_main, daemon=True,
                              args=(flow, counter, pipes[2][1], go, stop, pipes[3][1]))]
        waits += [(pipes[0][0], pipes[1][0], "consumer"), (pipes[2][0], pipes[3][0], "producer")]
    timeout = flows[0].timeout_s
    try:
        for proc, (ready_r, res_r, what) in zip(procs, waits, strict=True):
            note = loadgen._start_and_wait_ready(proc, ready_r, res_r, what)
            if note:
                return SpreadRun(ok=False, note=note)
        generator0, server0, wall0 = sum(tree_cpu_seconds(p.pid or 0) for p in procs), tree_cpu_seconds(
            server_pid), time.monotonic()
        deadline_ns.value = loadgen.now_ns() + int(timeout * 1e9)
        go.set()
        consumed = [loadgen._recv(res_r, timeout + 10) for _, res_r, what in waits if what == "consumer"]
        produced = [loadgen._recv(res_r, 10) for _, res_r, what in waits if what == "producer"]
        run = SpreadRun(ok=False, wall_seconds=time.monotonic() - wall0,
                        generator_cpu_seconds=sum(tree_cpu_seconds(p.pid or 0) for p in procs) - generator0,
                        server_cpu_seconds=tree_cpu_seconds(server_pid) - server0)
        failed = [r["error"] for r in consumed + produced if "error" in r]
        if failed:
            run.note = "; ".join(failed)
            return run
        run.got = sum(c["got"] for c in consumed)
        target = sum(flow.n for flow in flows)
        t_end = max(c["t_end"] for c in consumed)
        run.seconds = max(1e-9, (t_end - min(p["t0"] for p in produced)) / 1e9) if t_end else 0.0
        run.rate = run.got / run.seconds if run.seconds else 0.0
        run.ok = run.got >= target
        notes = [] if run.ok else [f"timeout: {run.got}/{target} delivered"]
        notes.append(check())
        stop.set()
        errors = sum(c["consumer_errors"] for c in consumed) + sum(
            loadgen._recv(res_r, 10).get("producer_errors", 0) for _, res_r, what in waits if what == "producer")
        if errors:
            notes.append(f"{errors} error replies")
        run.note = "; ".join(n for n in notes if n)
        run.ok = run.ok and not errors  # as bench.run: a stats mismatch is a note, not a lost sample
        return run
    finally:
        stop.set()
        go.set()
        for proc in procs:
            if proc.pid is not None:
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
                    proc.join(2)


# Cells


def start_server(workers: int, python: str) -> tuple[peers.Server, Topology]:
    server = peers.start_mqks(None, LOG_DIR, python=python, extra_args=("--workers", str(workers)))
    try:
        topo = topology(server.host, server.port)
        wait_direct(topo)
        return server, topo
    except BaseException:
        server.stop()
        raise


def spread_cell(workers: int, variant: str, cfg: Config, python: str) -> dict:
    """One repetition: `cfg.queues` queues in `cfg.groups` owner-sharing groups on a fresh server."""
    server, topo = start_server(workers, python)
    try:
        queues = [b"bench.wq%d" % i for i in range(cfg.queues)]
        groups = queue_groups(queues, topo.workers, cfg.groups)
        per_group, extra = divmod(cfg.messages, len(groups))
        public = (server.host, server.port)
        flows = []
        for g, (owner, owned) in enumerate(groups):
            host, port = topo.address(owner, public)
            flows.append(Flow(proto=MqksGroup(owned, manual_ack=variant == "manual-ack"), host=host, port=port,
                              n=per_group + (g < extra), window=cfg.window, timeout_s=cfg.timeout_seconds,
                              counter_binary=cfg.counter_binary))
        r = run_groups(flows, server.pid, broker_check(server.host, server.port, cfg.messages,
                                                       variant == "manual-ack"))
        if not server.alive():
            r.ok, r.note = False, f"{r.note}; server died: {server.log_tail(300)}".lstrip("; ")
        cores = os.cpu_count() or 1
        wall = max(1e-9, r.wall_seconds)
        return {"ok": r.ok, "value": r.rate, "got": r.got, "seconds": r.seconds, "note": r.note,
                "generator_share": r.generator_cpu_seconds / wall / cores,
                "server_cores": r.server_cpu_seconds / wall,
                "server_cpu_us_per_delivery": 1e6 * r.server_cpu_seconds / max(1, r.got),
                "groups": [[owner, len(owned)] for owner, owned in groups],
                "via": "direct" if topo.direct else "public port", "hello_workers": topo.workers}
    except Exception as e:
        return {"ok": False, "note": f"{type(e).__name__}: {e}"}
    finally:
        server.stop()


def one_queue_cells(workers: int, variant: str, cfg: Config, python: str, rep: int = 0) -> dict[str, dict]:
    """w1 on one queue, producer and consumer both on the owner and both on a non-owner, on one server
    (the owner first in even reps, last in odd ones, so neither always runs on a warm server).

    Without "direct" in `hello` only the public port is reachable: the owner cell runs there and the
    non-owner cell is reported as not run."""
    server, topo = start_server(workers, python)
    out: dict[str, dict] = {}
    try:
        owner = owner_of(ONE_QUEUE, topo.workers)
        public = (server.host, server.port)
        paths = [("owner", owner)] + ([("non-owner", (owner + 1) % topo.workers)]
                                      if topo.direct and topo.workers > 1 else [])
        if rep % 2:
            paths.reverse()
        manual = variant == "manual-ack"
        published = 0
        for path, worker in paths:
            host, port = topo.address(worker, public)
            flow = Flow(proto=Mqks(manual_ack=manual), host=host, port=port, n=cfg.one_queue_messages,
                        window=cfg.window, timeout_s=cfg.timeout_seconds, counter_binary=cfg.counter_binary)
            published += flow.n  # the same server's stats count both paths
            cpu0 = tree_cpu_seconds(server.pid)
            r = loadgen.run_flow(flow, check=broker_check(server.host, server.port, published, manual))
            cpu = tree_cpu_seconds(server.pid) - cpu0
            out[path] = {"ok": r.ok and not r.errors, "value": r.rate, "got": r.got,
                         "seconds": r.seconds, "note": r.note, "worker": worker, "owner": owner,
                         "server_cpu_us_per_delivery": 1e6 * cpu / max(1, r.got),
                         "via": "direct" if topo.direct else "public port"}
        if len(paths) == 1:
            out["non-owner"] = {"ok": False, "not_run": "hello lists no direct addresses" if topo.workers > 1
                                else "one worker"}
    except Exception as e:
        out.setdefault("owner", {"ok": False, "note": f"{type(e).__name__}: {e}"})
        out.setdefault("non-owner", {"ok": False, "note": f"{type(e).__name__}: {e}"})
    finally:
        server.stop()
    return out


def spread_key(workers: int, variant: str) -> str:
    return f"spread {variant} workers={workers}"


def one_queue_key(path: str, variant: str) -> str:
    return f"one queue {variant} via {path}"


def sample_text(s: dict) -> str:
    if s.get("not_run"):
        return f"n/a ({s['not_run']})"
    if "value" not in s:
        return f"FAILED {s.get('note', '')}"
    text = f"{s['value']:>12,.0f} deliveries/s  server {s['server_cpu_us_per_delivery']:.2f} us/delivery"
    if "generator_share" in s:
        text += f", {s['server_cores']:.2f} cores; generator {100 * s['generator_share']:.0f}% of the cores"
    if "worker" in s:
        text += f"  (worker {s['worker']}, owner {s['owner']}, {s['via']})"
    return text + (f"  [{s['note'][:200]}]" if s.get("note") else "")


def run(cfg: Config) -> int:
    os.makedirs(LOG_DIR, exist_ok=True)
    python = peers.mqks_python()
    if python is None:
        say(f"! {sys.executable} cannot import mqks.server: run with the repo's venv (.venv/bin/python)")
        return 1
    cores = os.cpu_count() or 1
    idle = idle_percent()
    top = max(cfg.workers)
    say(f"# mqksd --workers {','.join(map(str, cfg.workers))} on {cores} cores (unpinned), git {git_revision()}; "
        f"machine {idle:.0f}% idle before it")
    say(f"# spread: {cfg.queues} queues in {cfg.groups} groups, {cfg.messages:,} msgs a cell; one queue "
        f"at --workers {top}: {cfg.one_queue_messages:,} msgs a cell; reps {cfg.reps}; payload 100 bytes")
    if cfg.messages < 200_000:
        say("  ! cells this short are a smoke run: CPU figures move in 10 ms ticks, rates in start-up noise")
    if idle < 80:
        say("  ! other work is running on this machine: expect wide ranges")
    machine0, own0 = busy_seconds()
    wall0 = time.monotonic()
    samples: dict[str, list[dict]] = {}
    for rep in range(cfg.reps):  # interleaved, so a noisy minute hits every cell alike
        for variant in cfg.variants:
            for workers in cfg.workers:
                key = spread_key(workers, variant)
                s = spread_cell(workers, variant, cfg, python)
                samples.setdefault(key, []).append(s)
                say(f"  rep {rep + 1}/{cfg.reps} {key:<40} {sample_text(s)}")
            if top > 1:
                for path, s in one_queue_cells(top, variant, cfg, python, rep).items():
                    key = one_queue_key(path, variant)
                    samples.setdefault(key, []).append(s)
                    say(f"  rep {rep + 1}/{cfg.reps} {key:<40} {sample_text(s)}")
    machine1, own1 = busy_seconds()
    foreign = max(0.0, (machine1 - machine0) - (own1 - own0)) / max(1e-9, time.monotonic() - wall0) / cores
    cells = {key: summarize_cell(ss) for key, ss in samples.items()}
    results = {"bench": "workers", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git_revision(),
               "cpus": cores, "idle_percent_before": idle, "foreign_cpu_percent": 100 * foreign,
               "config": {"workers": cfg.workers, "variants": cfg.variants, "queues": cfg.queues,
                          "groups": cfg.groups, "messages": cfg.messages,
                          "one_queue_messages": cfg.one_queue_messages, "reps": cfg.reps},
               "cells": cells, "ratios": ratios(cells, cfg)}
    print_table(results)
    os.makedirs(os.path.dirname(os.path.abspath(cfg.json_path)), exist_ok=True)
    with open(cfg.json_path, "w", encoding="utf-8") as f:
        json.dump({**results, "samples": samples}, f, indent=1)
    say(f"\n# JSON: {cfg.json_path}")
    say(json.dumps(results, separators=(",", ":")))
    return 0 if all(c["n"] or c.get("not_run") for c in cells.values()) else 1


def summarize_cell(ss: list[dict]) -> dict:
    good = [s for s in ss if s.get("ok")]
    out = {**summarize([s["value"] for s in good]), "failed": sum(1 for s in ss if not s.get("ok")),
           "notes": sorted({s["note"] for s in ss if s.get("note")})}
    for figure in ("generator_share", "server_cores", "server_cpu_us_per_delivery"):
        values = [s[figure] for s in good if figure in s]
        if values:
            out[figure] = summarize(values)["median"]
    not_run = sorted({s["not_run"] for s in ss if s.get("not_run")})
    if not_run:
        out["not_run"], out["failed"] = "; ".join(not_run), 0
    return out


def ratios(cells: dict[str, dict], cfg: Config) -> list[dict]:
    """N workers / 1 worker per variant and N, and non-owner / owner per variant, as ratios of medians."""
    rows = []

    def row(label: str, num: str, den: str, target: float) -> None:
        a, b = cells.get(num, {}), cells.get(den, {})
        ratio = a["median"] / b["median"] if a.get("median") and b.get("median") else None
        rows.append({"label": label, "ratio": ratio, "target": target,
                     "met": None if ratio is None else ratio >= target,
                     "generator_share": a.get("generator_share"),
                     "not_run": a.get("not_run") or b.get("not_run")})

    for variant in cfg.variants:
        for workers in cfg.workers[1:]:
            # the target is 1.6x for 2 workers; for N, the same 80% efficiency per worker
            row(f"spread {variant}: {workers} workers / 1 worker", spread_key(workers, variant),
                spread_key(1, variant), SPREAD_TARGET * workers / 2)
        if max(cfg.workers) > 1:
            row(f"one queue {variant}: non-owner / owner", one_queue_key("non-owner", variant),
                one_queue_key("owner", variant), NON_OWNER_TARGET)
    return rows


def print_table(results: dict) -> None:
    say(f"\n### mqksd --workers on {results['cpus']} cores  (other processes used "
        f"{results['foreign_cpu_percent']:.0f}% of the CPUs meanwhile)\n")
    say("| cell | deliveries/s (median) | range | runs | server us/delivery | server cores | generator share | notes |")
    say("|---|---:|---|---:|---:|---:|---:|---|")

    def num(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    for key, c in results["cells"].items():
        runs = f"{c['n']}" + (f" (+{c['failed']} failed)" if c["failed"] else "")
        share = c.get("generator_share")
        say(f"| {key} | {num(c['median'], ',.0f') if not c.get('not_run') else 'n/a'} | "
            f"{num(c['min'], ',.0f')} .. {num(c['max'], ',.0f')} | {runs} | "
            f"{num(c.get('server_cpu_us_per_delivery'), '.2f')} | {num(c.get('server_cores'), '.2f')} | "
            f"{'-' if share is None else f'{100 * share:.0f}%'} | "
            f"{c.get('not_run') or '; '.join(c['notes'])[:160]} |")
    say("\n| ratio (medians) | value | target | verdict | generator share (numerator) |")
    say("|---|---:|---|---|---:|")
    for r in results["ratios"]:
        share = "-" if r["generator_share"] is None else f"{100 * r['generator_share']:.0f}%"
        if r["ratio"] is None:
            say(f"| {r['label']} | n/a | ≥ {r['target']:.1f} | {r['not_run'] or 'no data'} | {share} |")
            continue
        say(f"| {r['label']} | {r['ratio']:.2f}x | ≥ {r['target']:.1f} | {'met' if r['met'] else 'MISSED'} | "
            f"{share} |")
    cores = results["cpus"]
    for key, c in results["cells"].items():
        if "server_cores" not in c or "generator_share" not in c:
            continue
        busy = c["server_cores"] + c["generator_share"] * cores
        if busy >= 0.9 * cores:
            say(f"\nnote: {key}: the server used {c['server_cores']:.2f} and the generator "
                f"{c['generator_share'] * cores:.2f} of the {cores} cores: the machine, not the broker, was the limit")


def main(argv: list[str] | None = None) -> int:
    return run(build_config(argv))


if __name__ == "__main__":
    sys.exit(main())

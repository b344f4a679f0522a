"""Routing by masks as they grow: unique-id events with 10 to 100,000 masks bound, MQKS beside NATS.

    .venv/bin/python -m bench.masks [--quick] [--unpinned] [--masks 10,1000,10000,100000]
                                    [--messages N] [--reps N] [--timeout S] [--json PATH]

(from the repository root). One consumer's queue (MQKS) or connection (NATS) is bound to N
masks of four shapes, `user{k}.*.created`, `order{k}.*.*.paid`, `*.updated{k}` and
`*.*.deleted{k}` (NATS: the same subjects, its `*` being a whole token as here); one producer
publishes events with a unique 24-hex-digit id, each matching exactly one mask, masks taken in
turn. So nearly every MQKS publish misses the route cache, as real events with ids do. Cells
run interleaved, each on a fresh server; the table gives deliveries/s, the ratios each server's
N-mask rate over its own 10-mask rate (targets: 10,000 >= 0.7x, 100,000 >= 0.5x) as a ratio
of medians, as the median of each repetition's own ratio, and of the best runs (other work on
a shared machine only ever slows a run down, so the best run is the steadiest figure),
and the server's RSS growth per bound mask (a separate run per N, binding only). Results go
to bench/results/masks-*.json.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import time
from dataclasses import dataclass

from . import loadgen, peers
from .loadgen import ConsumerState, Flow, MqksAutoState, Proto

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
LOG_DIR = os.path.join(RESULTS_DIR, "logs")
SERVER_CORE, GENERATOR_CORE = 0, 1
MASK_COUNTS = (10, 1_000, 10_000, 100_000)
TARGETS = {10_000: 0.7, 100_000: 0.5}  # N masks / 10 masks, MQKS (issue 10)
BIND_CHUNK = 5_000  # masks per MQKS rebind line, well under --max-line-bytes
MASK_SHAPES = (b"user%d.*.created", b"order%d.*.*.paid", b"*.updated%d", b"*.*.deleted%d")
EVENT_SHAPES = (b"user%d.%024x.created", b"order%d.%024x.card.paid", b"%024x.updated%d", b"post.%024x.deleted%d")
QUEUE = b"bench.masks"


def mask(k: int) -> bytes:
    """The k-th mask: the four shapes in turn, each made distinct by k."""
    return MASK_SHAPES[k % 4] % k


def event(i: int, masks: int) -> bytes:
    """The i-th event: a unique id, matching mask i % masks and no other."""
    k = i % masks
    shape = k % 4
    return EVENT_SHAPES[shape] % ((i, k) if shape >= 2 else (k, i))


class MqksMasks(Proto):
    """MQKS: one auto-ack consumer on a queue bound to `masks` masks; publishes of unique-id events."""

    name = "mqks"
    producer_error = b" error "
    barrier_request = b"z ping done\n"
    barrier_reply = b"z ok done"

    def __init__(self, masks: int) -> None:
        self.masks = masks

    def publish(self, start: int, count: int, ts_ns: int = 0) -> bytes:
        tail = b" " + loadgen.payload(ts_ns) + b"\n"
        masks = self.masks
        return b"".join([b"m%d publish %b%b" % (i, event(i, masks), tail) for i in range(start, start + count)])

    def bind(self, sock: socket.socket) -> None:
        """Bind every mask to the queue, in rebind lines of BIND_CHUNK masks, each confirmed."""
        for start in range(0, self.masks, BIND_CHUNK):
            chunk = b" ".join(mask(k) for k in range(start, min(self.masks, start + BIND_CHUNK)))
            sock.sendall(b"r rebind --confirm " + QUEUE + b" --add " + chunk + b"\n")
            line = loadgen.read_until(sock, b"\n").split(b"\n", 1)[0]
            if line.rstrip() != b"r ok":
                raise RuntimeError(f"mqks rebind failed: {line[:300]!r}")

    def consumer_setup(self, sock: socket.socket, index: int) -> tuple[ConsumerState, bytes]:
        self.bind(sock)
        sock.sendall(b"c0 consume --confirm " + QUEUE + b"\n")  # no events: keeps the bindings
        line = loadgen.read_until(sock, b"\n").split(b"\n", 1)[0]
        if line.rstrip() != b"c0 ok":
            raise RuntimeError(f"mqks consume failed: {line[:300]!r}")
        return MqksAutoState(), b""


class NatsMasks(Proto):
    """NATS core: one connection subscribed to the same masks as subject wildcards; the same events."""

    name = "nats"
    barrier_request = b"PING\r\n"
    barrier_reply = b"PONG"

    def __init__(self, masks: int) -> None:
        self.masks = masks

    def _handshake(self, sock: socket.socket) -> None:
        loadgen.read_until(sock, b"\r\n")  # INFO
        sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"echo":false}\r\nPING\r\n')
        loadgen.read_until(sock, b"PONG")

    def producer_setup(self, sock: socket.socket) -> None:
        self._handshake(sock)

    def publish(self, start: int, count: int, ts_ns: int = 0) -> bytes:
        tail = b" 100\r\n" + loadgen.payload(ts_ns) + b"\r\n"
        masks = self.masks
        return b"".join([b"PUB " + event(i, masks) + tail for i in range(start, start + count)])

    def bind(self, sock: socket.socket) -> None:
        self._handshake(sock)
        for start in range(0, self.masks, BIND_CHUNK):
            end = min(self.masks, start + BIND_CHUNK)
            sock.sendall(b"".join(b"SUB %b %d\r\n" % (mask(k), k + 1) for k in range(start, end)) + b"PING\r\n")
            loadgen.read_until(sock, b"PONG")

    def consumer_setup(self, sock: socket.socket, index: int) -> tuple[ConsumerState, bytes]:
        self.bind(sock)
        return ConsumerState(), b""


PROTOS: dict[str, type[MqksMasks] | type[NatsMasks]] = {"mqks": MqksMasks, "nats": NatsMasks}


@dataclass(frozen=True, slots=True)
class Config:
    masks: tuple[int, ...]
    messages: int
    reps: int
    pinned: bool
    timeout_seconds: float
    json_path: str
    memory: bool
    counter_binary: str | None


def build_config(argv: list[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(prog="python -m bench.masks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages, one repetition")
    parser.add_argument("--unpinned", action="store_true", help="no taskset (default: server core 0, generator 1)")
    parser.add_argument("--masks", default=",".join(map(str, MASK_COUNTS)), help="comma list of mask counts")
    parser.add_argument("--messages", type=int, help="events per run (default 300000, quick 100000)")
    parser.add_argument("--reps", type=int, help="repetitions per cell (default 5, quick 1)")
    parser.add_argument("--timeout", type=float, help="seconds one run may take (default 60)")
    parser.add_argument("--no-memory", action="store_true", help="skip the RSS-per-mask runs")
    parser.add_argument("--json", dest="json_path", help="where to write the JSON (default bench/results/...)")
    a = parser.parse_args(argv)
    pinned = not a.unpinned and bool(shutil.which("taskset")) and (os.cpu_count() or 1) >= 2
    counts = tuple(int(x) for x in a.masks.split(",") if x.strip())
    if 10 not in counts:
        parser.error("--masks must include 10: every ratio is over the 10-mask rate")
    name = f"masks-{time.strftime('%Y%m%d-%H%M%S')}{'-quick' if a.quick else ''}.json"
    return Config(masks=counts, messages=a.messages or (100_000 if a.quick else 300_000),
                  reps=a.reps or (1 if a.quick else 5), pinned=pinned, timeout_seconds=a.timeout or 60.0,
                  json_path=a.json_path or os.path.join(RESULTS_DIR, name),
                  memory=not a.no_memory, counter_binary=loadgen.build_counter())


def say(text: str = "") -> None:
    print(text, flush=True)


class Servers:
    """Fresh MQKS and NATS servers, pinned to the server core when asked."""

    def __init__(self, cfg: Config) -> None:
        self.core = SERVER_CORE if cfg.pinned else None
        self.nats = peers.find_binary("nats-server")
        python = peers.mqks_python()
        if python is None:
            raise SystemExit(f"{sys.executable} cannot import mqks.server: run with the repo's .venv/bin/python")
        self.python: str = python

    def kinds(self) -> list[str]:
        return ["mqks"] + (["nats"] if self.nats else [])

    def start(self, kind: str) -> peers.Server:
        if kind == "mqks":
            return peers.start_mqks(self.core, LOG_DIR, python=self.python)
        assert self.nats is not None
        return peers.start_nats(self.nats, self.core, LOG_DIR)


def mqks_stats(server: peers.Server) -> dict:
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(b"e _eval state.stats()\n")
        line = loadgen.read_until(sock, b"\n").split(b"\n", 1)[0]
    if not line.startswith(b"e ok "):
        raise RuntimeError(f"_eval failed: {line[:300]!r}")
    return ast.literal_eval(line[5:].decode())


def run_flow_cell(kind: str, masks: int, cfg: Config, servers: Servers) -> dict:
    """One run: bind `masks` masks, publish cfg.messages unique-id events, count the deliveries."""
    server = servers.start(kind)
    try:
        flow = Flow(proto=PROTOS[kind](masks), host=server.host, port=server.port, n=cfg.messages,
                    core=GENERATOR_CORE if cfg.pinned else None, timeout_s=cfg.timeout_seconds,
                    counter_binary=cfg.counter_binary)
        r = loadgen.run_flow(flow)
        note = r.note
        if kind == "mqks" and server.alive():
            st = mqks_stats(server)
            if st.get("published") != cfg.messages or st.get("consumed") != cfg.messages:
                note += f" stats: published={st.get('published')} consumed={st.get('consumed')} (sent {cfg.messages})"
        if not server.alive():
            note += f" server died: {server.log_tail(300)}"
        ok = r.ok and not r.errors and not note.strip()
        return {"ok": ok, "value": r.rate, "got": r.got, "seconds": r.seconds, "send_rate": r.send_rate,
                "note": note.strip()}
    except Exception as e:  # report the cell, keep the benchmark going
        return {"ok": False, "note": f"{type(e).__name__}: {e}"}
    finally:
        server.stop()


def run_memory_cell(kind: str, masks: int, servers: Servers) -> dict:
    """RSS growth of a fresh server while one connection binds `masks` masks, per mask."""
    server = servers.start(kind)
    try:
        with loadgen.connect(server.host, server.port) as sock:
            sock.settimeout(120)
            time.sleep(0.2)
            rss0 = loadgen.vm_rss(server.pid)
            PROTOS[kind](masks).bind(sock)  # a confirm (PONG) per chunk: all bound when it returns
            time.sleep(0.2)
            rss1 = loadgen.vm_rss(server.pid)
        return {"ok": True, "value": (rss1 - rss0) / masks, "rss0": rss0, "rss1": rss1}
    except Exception as e:
        return {"ok": False, "note": f"{type(e).__name__}: {e}"}
    finally:
        server.stop()


def summarize(samples: list[dict]) -> dict:
    values = [s["value"] for s in samples if s.get("ok")]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def paired(cells: dict[str, dict], num: str, den: str) -> float | None:
    """The median over repetitions of num/den within the same repetition (both runs good)."""
    a, b = cells.get(num, {}).get("samples", []), cells.get(den, {}).get("samples", [])
    values = [x["value"] / y["value"] for x, y in zip(a, b, strict=False)
              if x.get("ok") and y.get("ok") and y["value"]]
    return statistics.median(values) if values else None


def ratios(cells: dict[str, dict]) -> list[dict]:
    """Each server's N-mask rate over its own 10-mask rate, then MQKS over NATS at each N."""
    out = []
    counts = sorted({c["masks"] for c in cells.values() if c["measure"] == "flow"})
    pairs = [(f"{'MQKS' if kind == 'mqks' else 'NATS'} {n:,} masks / 10 masks", f"{kind} {n} masks",
              f"{kind} 10 masks", TARGETS.get(n) if kind == "mqks" else None)
             for kind in ("mqks", "nats") for n in counts if n != 10]
    pairs += [(f"{n:,} masks: MQKS / NATS", f"mqks {n} masks", f"nats {n} masks", None) for n in counts]
    for label, num, den, target in pairs:
        a, b = cells.get(num, {}).get("median"), cells.get(den, {}).get("median")
        ratio = a / b if a is not None and b else None
        met = None if target is None or ratio is None else ratio >= target
        best_a, best_b = cells.get(num, {}).get("max"), cells.get(den, {}).get("max")
        out.append({"label": label, "ratio": ratio, "per_rep": paired(cells, num, den),
                    "best": best_a / best_b if best_a is not None and best_b else None, "target": target,
                    "met": met})
    return out


def busy_seconds() -> tuple[float, float]:
    """(CPU seconds the whole machine has used, CPU seconds we and our children used)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    machine = (fields[0] + fields[1] + fields[2]) / os.sysconf("SC_CLK_TCK")
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        own += r.ru_utime + r.ru_stime
    return machine, own


def run(cfg: Config) -> int:
    os.makedirs(LOG_DIR, exist_ok=True)
    servers = Servers(cfg)
    mode = "pinned (server: taskset -c 0, generator: core 1)" if cfg.pinned else "unpinned"
    say(f"# MQKS masks benchmark  {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  {mode}; masks {cfg.masks}; "
        f"{cfg.messages:,} unique-id events per run, reps {cfg.reps}; load average {os.getloadavg()[0]:.2f}")
    if not servers.nats:
        say("# SKIPPED peer nats: nats-server not found (bench.run installs it)")
    started = time.monotonic()
    machine0, own0 = busy_seconds()
    samples: dict[str, list[dict]] = {}
    meta: dict[str, dict] = {}
    for rep in range(cfg.reps):  # interleaved, so a noisy minute hits every cell alike
        for masks in cfg.masks:
            for kind in servers.kinds():
                key = f"{kind} {masks} masks"
                meta[key] = {"server": kind, "masks": masks, "measure": "flow", "unit": "deliveries/s"}
                s = run_flow_cell(kind, masks, cfg, servers)
                samples.setdefault(key, []).append(s)
                text = f"{s['value']:>12,.0f} deliveries/s" if "value" in s else "FAILED"
                if s.get("note"):
                    text += f"  [{s['note'][:200]}]"
                say(f"  rep {rep + 1}/{cfg.reps} {key:<24} {text}")
    if cfg.memory:
        for masks in [n for n in cfg.masks if n >= 10_000]:
            for kind in servers.kinds():
                key = f"{kind} {masks} masks, RSS"
                meta[key] = {"server": kind, "masks": masks, "measure": "memory", "unit": "bytes/mask"}
                s = run_memory_cell(kind, masks, servers)
                samples.setdefault(key, []).append(s)
                text = f"{s['value']:.0f} bytes/mask" if "value" in s else f"FAILED {s.get('note', '')}"
                say(f"  memory {key:<26} {text}")
    machine1, own1 = busy_seconds()
    cores = os.cpu_count() or 1
    foreign = 100 * max(0.0, (machine1 - machine0) - (own1 - own0)) / (time.monotonic() - started) / cores
    say(f"  other processes used {foreign:.0f}% of the machine's {cores} cores meanwhile")
    cells = {key: {**meta[key], **summarize(ss), "samples": ss} for key, ss in samples.items()}
    rows = ratios(cells)
    say("\n| server | masks | measure | median | range (min .. max) | runs | notes |")
    say("|---|---:|---|---:|---|---:|---|")
    for c in cells.values():
        unit = c["unit"]
        notes = "; ".join(sorted({s["note"] for s in c["samples"] if s.get("note")}))[:160]
        if c["median"] is None:
            say(f"| {c['server']} | {c['masks']:,} | {unit} | - | - | 0 | {notes} |")
            continue
        say(f"| {c['server']} | {c['masks']:,} | {unit} | {c['median']:,.0f} | "
            f"{c['min']:,.0f} .. {c['max']:,.0f} | {c['n']} | {notes} |")
    say("\n| ratio | of medians | median per rep | of best runs | target | verdict (medians) |")
    say("|---|---:|---:|---:|---|---|")
    for r in rows:
        value = "-" if r["ratio"] is None else f"{r['ratio']:.3f}x"
        per_rep = "-" if r["per_rep"] is None else f"{r['per_rep']:.3f}x"
        best = "-" if r["best"] is None else f"{r['best']:.3f}x"
        target = "-" if r["target"] is None else f"≥ {r['target']:.1f}"
        verdict = "info" if r["met"] is None else ("met" if r["met"] else "MISSED")
        say(f"| {r['label']} | {value} | {per_rep} | {best} | {target} | "
            f"{verdict if r['ratio'] is not None else 'no data'} |")
    os.makedirs(os.path.dirname(os.path.abspath(cfg.json_path)), exist_ok=True)
    with open(cfg.json_path, "w", encoding="utf-8") as f:
        json.dump({"meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": repr(cfg),
                            "seconds": time.monotonic() - started, "foreign_cpu_percent": foreign},
                   "cells": cells, "ratios": rows},
                  f, indent=1, default=str)
    say(f"\n# done in {time.monotonic() - started:.0f}s; JSON: {cfg.json_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_config(argv))


if __name__ == "__main__":
    sys.exit(main())

"""Confirmed publishes through a three-node cluster beside one broker on the same replicated log (issue 40's cell,
issue 57's spread cells), and what a default cluster costs while idle.

    .venv/bin/python -m bench.cluster_confirmed [--messages 60000] [--window 2000] [--paced-rate 10000]
                                                [--groups 16,4,3:1] [--paced-first] [--pacing ticks|answers] [--reps 3]
                                                [--trees DIR,DIR] [--json FILE]

One three-node NATS cluster on loopback (`mqks nats up`, `sync_interval: always`) serves every cell. Each client
binds 30 queues q0..q29 to e0..e29 and pipelines `publish --confirm` of 100 bytes (e(i % 30)), at most `--window`
unanswered, through one connection; a cell counts the confirms, the CPU-seconds of every MQKS process (supervisors
and group processes) and of the three nats-servers (not the clients'), and the JetStream messages stored (the
streams' last sequences, the map's bucket aside) per confirmed publish. Cells, for one broker (`mqksd --log`, one
stream, R3) and for three nodes with each of `--groups`:
- 1 client: `--messages` through one connection (to node a);
- 3 clients: the same messages from three client processes, a third each, each its own window (in a cluster one
  through each node: what a spread application does);
- a --groups entry `G:P` runs P processes on each node (`--processes P`; else one per core): `3:1` is the cell
  where each node has one process owning one group, the layout a writer shared by a process's groups would give at
  any group count (docs/internals.md);
- paced (one broker and each --groups, or the first only with --paced-first): `--paced-rate` confirmed publishes
  a second for 4 s, from one client and from the same three (a third of the rate each), below what either reaches:
  at saturation the CPU per message is elastic (a process given a core back takes smaller batches), at a fixed rate
  each side's cost per message is what it spends. With `--pacing ticks` (the default) a client sends what is due
  every 5 ms and only then, the three on one grid of the machine's monotonic clock; with `answers` it also sends
  what is due each time answers come in (the cell of before issue 57). One broker stores what it has as soon as it
  can, so its stored messages, and its CPU, follow the clients' sends: three clients out of step cost it a frame
  per send.
Then the first --groups' cluster left idle for `--idle-seconds`: CPU of its processes and of the NATS servers, as a
share of one core, and node a's resident memory. Ratios against one broker's same cell: rate, and CPU per message.
Medians of --reps; an absolute figure from this VM is noise. To compare trees, give `--trees A,B` (each a copy of
the package as A/mqks, e.g. `cp -rL build/__editable__*/mqks A/`): their clusters alternate within each rep, each
rep starting with the next tree (the one run later in a rep was favoured).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from mqks.client import nats_local

from . import peers
from .cluster import start_nodes
from .run import LOG_DIR, RESULTS_DIR, git_revision
from .workers import tree_cpu_seconds

QUEUES = 30
BODY = b"x" * 100
PACE_SECONDS = 0.005  # a paced cell sends what is due this often
PACED_SECONDS = 4.0
STEADY_SECONDS = 6.0  # longer than a standby's balancing period (server/cluster/election.py BALANCE_SECONDS)


def bound(port: int) -> tuple[socket.socket, bytearray]:
    """A connection to 127.0.0.1:port with q0..q29 bound to e0..e29 (each client rebinds them: the same bindings)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(b"".join(b"r%d rebind --confirm q%d e%d\n" % (i, i, i) for i in range(QUEUES)))
    pending = bytearray()
    read_answers(sock, QUEUES, pending)
    return sock, pending


def publishes(messages: int) -> list[bytes]:
    return [b"p%d publish --confirm e%d %b\n" % (i, i % QUEUES, BODY) for i in range(messages)]


def confirmed_cell(port: int, messages: int, window: int,
                   start: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """(first send, last confirm) on the monotonic clock of one pipelined run through 127.0.0.1:port, `start`
    called once bound; raises on an error answer."""
    sock, pending = bound(port)
    try:
        lines = publishes(messages)
        start()
        sent = answered = 0
        started = time.monotonic()
        while answered < messages:
            if sent < messages and sent - answered < window:
                upto = min(messages, answered + window)
                sock.sendall(b"".join(lines[sent:upto]))
                sent = upto
            answered += read_answers(sock, 0, pending)
        return started, time.monotonic()
    finally:
        sock.close()


def read_answers(sock: socket.socket, at_least: int, pending: bytearray) -> int:
    """Answers read from one recv (or until `at_least`); raises on an error."""
    got = 0
    while True:
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise RuntimeError("the broker closed the connection")
        pending += chunk
        end = pending.rfind(b"\n")
        if end >= 0:
            complete = bytes(pending[:end])
            del pending[:end + 1]
            if b" error " in complete:
                raise RuntimeError(next(line for line in complete.split(b"\n") if b" error " in line).decode())
            got += complete.count(b"\n") + 1
        if got >= at_least:
            return got


def paced_cell(port: int, messages: int, rate: float, ticks: bool = True,
               start: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """`messages` confirmed publishes offered at `rate` a second through 127.0.0.1:port: (first send, last confirm).
    `ticks`: what is due goes every PACE_SECONDS and only then; else also each time answers come in."""
    sock, pending = bound(port)
    try:
        lines = publishes(messages)
        start()
        sent = answered = 0
        started = time.monotonic()
        next_tick = (int(started / PACE_SECONDS) + 1) * PACE_SECONDS  # one grid for every client: they send together
        while answered < messages:
            now = time.monotonic()
            if now >= next_tick or not ticks:
                due = min(messages, int((now - started) * rate) + 1)
                if due > sent:
                    sock.sendall(b"".join(lines[sent:due]))
                    sent = due
                if now >= next_tick:
                    next_tick += PACE_SECONDS * (1 + int((now - next_tick) / PACE_SECONDS))
            if select.select([sock], [], [], max(0.0, next_tick - time.monotonic()))[0]:
                answered += read_answers(sock, 0, pending)
        return started, time.monotonic()
    finally:
        sock.close()


def client(port: int, messages: int, args: argparse.Namespace, rate: float, barrier: Any, results: Any) -> None:
    """One client process of a cell: its (first send, last confirm), or the error, into `results`."""
    try:
        if rate:
            span = paced_cell(port, messages, rate, args.pacing == "ticks", barrier.wait)
        else:
            span = confirmed_cell(port, messages, args.window, barrier.wait)
        results.put(span)
    except BaseException as e:  # reported by the parent, which stops
        barrier.abort()
        results.put(repr(e))


def run_clients(ports: list[int], messages: int, args: argparse.Namespace, rate: float = 0.0) -> float:
    """`messages` confirmed publishes from a client process per port (a share each), started together; the rate
    of the whole: messages over the span from the first send to the last confirm."""
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(len(ports)), context.Queue()
    shares = [messages // len(ports) + (i < messages % len(ports)) for i in range(len(ports))]
    processes = [context.Process(target=client, args=(port, share, args, rate / len(ports), barrier, results))
                 for port, share in zip(ports, shares, strict=True)]
    for process in processes:
        process.start()
    try:
        spans = [results.get(timeout=600) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    failed = [span for span in spans if isinstance(span, str)]
    if failed:
        raise RuntimeError(f"a client failed: {failed[0]}")
    return messages / (max(end for _, end in spans) - min(begin for begin, _ in spans))


def stored_messages(urls: str) -> int:
    """The JetStream messages the log streams have stored so far (their last sequences: a purge takes none back);
    the cluster map's bucket aside."""

    async def ask() -> int:
        import nats

        nc = await nats.connect(servers=urls.split(","))
        try:
            infos = await nc.jetstream().streams_info()
            return sum(int(info.state.last_seq) for info in infos if not (info.config.name or "").startswith("KV_"))
        finally:
            await nc.close()

    return asyncio.run(ask())


def wait_settled(cluster: str, urls: str, nodes: int, timeout: float = 120.0) -> None:
    """Until every group's owner answers, the groups are spread within one over the nodes, and no group has moved
    for STEADY_SECONDS (balancing hands groups over for a while after a start, and a standby may still be asking
    for its group when the spread first looks even: a cell measured meanwhile measures the hand-overs)."""
    mqks = os.path.join(os.path.dirname(sys.executable), "mqks")
    deadline = time.monotonic() + timeout
    steady: tuple[list[str], float] | None = None  # the owners, and since when they have not changed
    while time.monotonic() < deadline:
        done = subprocess.run([mqks, "cluster", "status", "--json", "--cluster", cluster, "--log", urls],
                              capture_output=True, text=True, timeout=60)
        if done.returncode == 0:
            rows = json.loads(done.stdout)
            owners = [row["owner"] for row in rows]
            counts = [owners.count(owner) for owner in set(owners)]
            if (all(row["owner"] and row["answering"] == row["owner"] for row in rows) and len(counts) == nodes
                    and max(counts) - min(counts) <= 1):
                if steady is None or steady[0] != owners:
                    steady = (owners, time.monotonic())
                elif time.monotonic() - steady[1] >= STEADY_SECONDS:
                    return
            else:
                steady = None
        time.sleep(1.0)
    raise RuntimeError(f"cluster {cluster} did not settle within {timeout:g} s")


def cpu_seconds(pids: list[int]) -> float:
    return sum(tree_cpu_seconds(pid) for pid in pids)


def measured(ports: list[int], mqks_pids: list[int], nats_pids: list[int], urls: str, args: argparse.Namespace,
             paced: bool = False) -> dict:
    """One cell: saturated (pipelined, at most --window unanswered per client) or paced (--paced-rate a second in
    all), from a client per port."""
    messages = int(args.paced_rate * PACED_SECONDS) if paced else args.messages
    stored_before = stored_messages(urls)
    mqks_before, nats_before = cpu_seconds(mqks_pids), cpu_seconds(nats_pids)
    rate = run_clients(ports, messages, args, args.paced_rate if paced else 0.0)
    mqks_cpu, nats_cpu = cpu_seconds(mqks_pids) - mqks_before, cpu_seconds(nats_pids) - nats_before
    stored = stored_messages(urls) - stored_before
    return {"rate": rate, "cpu_us_per_msg": (mqks_cpu + nats_cpu) / messages * 1e6,
            "mqks_us_per_msg": mqks_cpu / messages * 1e6, "nats_us_per_msg": nats_cpu / messages * 1e6,
            "stored_per_msg": stored / messages}


def spread_cells(prefix: str, ports: list[int], mqks_pids: list[int], nats_pids: list[int], urls: str,
                 args: argparse.Namespace, paced: bool, cells: dict[str, list[dict]]) -> None:
    """A 1-client and a 3-client cell (the one client through the first port; paced too if `paced`) into `cells`."""
    for kind in ("", ", paced") if paced else ("",):
        for clients in (ports[:1], ports):
            cells.setdefault(f"{prefix}{kind}, {len(clients)} client{'s' * (len(clients) > 1)}", []).append(
                measured(clients, mqks_pids, nats_pids, urls, args, bool(kind)))


def resident_mib(pid: int) -> float:
    """RSS of `pid` and its live descendants."""
    total = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/status", encoding="ascii") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            for tid in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{tid}/children", encoding="ascii") as f:
                    pending += [int(c) for c in f.read().split()]
        except (OSError, StopIteration):
            continue
    return total / 1024


def use_tree(tree: str) -> None:
    """The MQKS processes started from now on import the package from `tree` (the installed one for "")."""
    os.environ.pop("PYTHONPATH", None)
    if tree:
        os.environ["PYTHONPATH"] = tree


def median(samples: list[dict]) -> dict:
    return {key: statistics.median(sample[key] for sample in samples) for key in samples[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster_confirmed", description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=60_000, help="a saturated cell's, in all")
    parser.add_argument("--window", type=int, default=2000, help="unanswered publishes per client")
    parser.add_argument("--paced-rate", type=int, default=10_000, help="the paced cells' rate in all (0: none)")
    parser.add_argument("--pacing", choices=("ticks", "answers"), default="ticks")
    parser.add_argument("--groups", default="16,4", help="the clusters' --groups, the idle cell's first; G:P for "
                        "P processes a node")
    parser.add_argument("--paced-first", action="store_true", help="paced cells for the first --groups only")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--trees", default="", help="directories, each holding a copy of the package as mqks/, whose "
                        "clusters alternate in every rep (each first on its MQKS processes' PYTHONPATH; one broker "
                        "runs the first); default: the installed tree")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    layouts = [(int(g), int(p or 0)) for g, _, p in (entry.partition(":") for entry in args.groups.split(","))]
    trees = [tree for tree in args.trees.split(",") if tree] or [""]
    os.makedirs(LOG_DIR, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="mqks-bench-nats-")
    cells: dict[str, list[dict]] = {}
    idle: dict[str, float] = {}
    try:
        nats_nodes = nats_local.up(directory, 3, "bench")
        urls = ",".join(node.url for node in nats_nodes)
        nats_pids = [node.pid for node in nats_nodes]
        for rep in range(args.reps):
            use_tree(trees[0])
            broker = peers.start_mqks(None, LOG_DIR,
                                      extra_args=("--log", urls, "--log-stream", f"one{rep}{os.getpid()}"))
            try:
                spread_cells("one broker", [broker.port] * 3, [broker.pid], nats_pids, urls, args,
                             bool(args.paced_rate), cells)
            finally:
                broker.stop()
            # the trees take turns going first: run against itself, the tree run later in a rep won 3 pairs of 3
            turn = rep % len(trees)
            in_turn = list(enumerate(trees))[turn:] + list(enumerate(trees))[:turn]
            for (groups, processes), (index, tree) in itertools.product(layouts, in_turn):
                use_tree(tree)
                name = f"c{groups}x{processes}t{index}r{rep}p{os.getpid()}"
                nodes = start_nodes(["a", "b", "c"], name, urls, groups, processes)
                try:
                    wait_settled(name, urls, len(nodes))
                    pids = [node.pid for node in nodes]
                    label = f"{os.path.basename(tree.rstrip('/'))}: " if tree else ""
                    first = (groups, processes) == layouts[0]
                    paced = (first or not args.paced_first) and bool(args.paced_rate)
                    spread = f" in {processes} process{'es' * (processes > 1)}" if processes else ""
                    spread_cells(f"{label}3 nodes, {groups} groups{spread}", [node.port for node in nodes], pids,
                                 nats_pids, urls, args, paced, cells)
                    if first and rep == 0 and index == 0 and args.idle_seconds:
                        time.sleep(5)
                        mqks_before, nats_before = cpu_seconds(pids), cpu_seconds(nats_pids)
                        time.sleep(args.idle_seconds)
                        idle = {"mqks_core_share": (cpu_seconds(pids) - mqks_before) / args.idle_seconds,
                                "nats_core_share": (cpu_seconds(nats_pids) - nats_before) / args.idle_seconds,
                                "node_rss_mib": resident_mib(nodes[0].pid)}
                finally:
                    for node in nodes:
                        node.stop()
            print(f"rep {rep + 1}: " + ", ".join(f"{k} {v[-1]['rate']:,.0f}/s" for k, v in cells.items()), flush=True)
    finally:
        try:
            nats_local.down(directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    result_cells = {key: median(values) for key, values in cells.items()}
    ratios = {}
    for key, cell in result_cells.items():
        if not key.startswith("one broker"):
            one = result_cells["one broker" + key[key.index(",", key.index(" groups")):]]
            ratios[f"{key} / one broker"] = {"rate": cell["rate"] / one["rate"],
                                             "cpu_per_msg": cell["cpu_us_per_msg"] / one["cpu_us_per_msg"],
                                             "mqks_cpu_per_msg": cell["mqks_us_per_msg"] / one["mqks_us_per_msg"]}
    print(f"{'cell':<52} {'confirmed/s':>12} {'CPU us/msg':>11} {'(mqks':>7} {'nats)':>7} {'JS msgs/msg':>12}")
    for key, cell in result_cells.items():
        print(f"{key:<52} {cell['rate']:>12,.0f} {cell['cpu_us_per_msg']:>11.1f} {cell['mqks_us_per_msg']:>7.1f} "
              f"{cell['nats_us_per_msg']:>7.1f} {cell['stored_per_msg']:>12.4f}")
    for key, ratio in ratios.items():
        print(f"{key}: {ratio['rate']:.2f}x the rate at {ratio['cpu_per_msg']:.1f}x the CPU per message "
              f"(MQKS alone {ratio['mqks_cpu_per_msg']:.1f}x)")
    if idle:
        print(f"idle default cluster: MQKS {idle['mqks_core_share']:.1%} of a core, NATS "
              f"{idle['nats_core_share']:.1%}; node a {idle['node_rss_mib']:.0f} MiB resident")
    result = {"revision": git_revision(), "messages": args.messages, "window": args.window,
              "paced_rate": args.paced_rate, "pacing": args.pacing, "reps": args.reps,
              "cells": result_cells, "ratios": ratios, "idle": idle}
    path = args.json or os.path.join(RESULTS_DIR, f"cluster-confirmed-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

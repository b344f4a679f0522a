"""Confirmed publishes through one node of a three-node cluster beside one broker on the same replicated log
(issue 40's cell), and what a default cluster costs while idle.

    .venv/bin/python -m bench.cluster_confirmed [--messages 60000] [--window 2000] [--paced-rate 10000]
                                                [--reps 3] [--json FILE]

One three-node NATS cluster on loopback (`mqks nats up`, `sync_interval: always`) serves every cell. Each cell
binds 30 queues q0..q29 to e0..e29 and pipelines `--messages` `publish --confirm` of 100 bytes (e(i % 30)), at
most `--window` unanswered, through one connection; it counts the confirms and the CPU-seconds of every MQKS
process (supervisors and group processes) and of the three nats-servers during the run. Cells:
- one broker: `mqksd --log` (one stream, R3);
- three nodes, default --groups (16), through node a; and the same with --groups 4;
- paced: one broker and the 16 groups again, offered `--paced-rate` confirmed publishes a second for 4 s (sent
  every 5 ms), below what either reaches: at saturation the CPU per message is elastic (a process given a
  core back takes smaller batches), at a fixed rate each side's cost per message is what it spends.
Then the default cluster left idle for `--idle-seconds`: CPU of its processes and of the NATS servers, as a
share of one core, and node a's resident memory. Ratios against one broker: rate, and CPU per message.
Medians of --reps; an absolute figure from this VM is noise.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

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


def confirmed_cell(port: int, messages: int, window: int) -> tuple[float, float]:
    """(confirmed msg/s, seconds) of one pipelined run through 127.0.0.1:port; raises on an error answer."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        sock.sendall(b"".join(b"r%d rebind --confirm q%d e%d\n" % (i, i, i) for i in range(QUEUES)))
        read_answers(sock, QUEUES, bytearray())
        lines = [b"p%d publish --confirm e%d %b\n" % (i, i % QUEUES, BODY) for i in range(messages)]
        pending = bytearray()
        sent = answered = 0
        started = time.monotonic()
        while answered < messages:
            if sent < messages and sent - answered < window:
                upto = min(messages, answered + window)
                sock.sendall(b"".join(lines[sent:upto]))
                sent = upto
            answered += read_answers(sock, 0, pending)
        seconds = time.monotonic() - started
        return messages / seconds, seconds
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


def paced_cell(port: int, messages: int, rate: int) -> float:
    """`messages` confirmed publishes offered at `rate` a second through 127.0.0.1:port; the rate reached."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        sock.sendall(b"".join(b"r%d rebind --confirm q%d e%d\n" % (i, i, i) for i in range(QUEUES)))
        pending = bytearray()
        read_answers(sock, QUEUES, pending)
        lines = [b"p%d publish --confirm e%d %b\n" % (i, i % QUEUES, BODY) for i in range(messages)]
        sent = answered = 0
        started = time.monotonic()
        while answered < messages:
            due = min(messages, int((time.monotonic() - started) * rate))
            if due > sent:
                sock.sendall(b"".join(lines[sent:due]))
                sent = due
            if select.select([sock], [], [], PACE_SECONDS)[0]:
                answered += read_answers(sock, 0, pending)
        return messages / (time.monotonic() - started)
    finally:
        sock.close()


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


def measured(port: int, mqks_pids: list[int], nats_pids: list[int], args: argparse.Namespace,
             paced: bool = False) -> dict:
    """One cell: saturated (pipelined, at most --window unanswered) or paced (--paced-rate a second)."""
    messages = int(args.paced_rate * PACED_SECONDS) if paced else args.messages
    mqks_before, nats_before = cpu_seconds(mqks_pids), cpu_seconds(nats_pids)
    rate = paced_cell(port, messages, args.paced_rate) if paced else confirmed_cell(port, messages, args.window)[0]
    mqks_cpu, nats_cpu = cpu_seconds(mqks_pids) - mqks_before, cpu_seconds(nats_pids) - nats_before
    return {"rate": rate, "cpu_us_per_msg": (mqks_cpu + nats_cpu) / messages * 1e6,
            "mqks_us_per_msg": mqks_cpu / messages * 1e6, "nats_us_per_msg": nats_cpu / messages * 1e6}


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


def median(samples: list[dict]) -> dict:
    return {key: statistics.median(sample[key] for sample in samples) for key in samples[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster_confirmed", description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=60_000)
    parser.add_argument("--window", type=int, default=2000)
    parser.add_argument("--paced-rate", type=int, default=10_000, help="the paced cells' rate (0: none)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.makedirs(LOG_DIR, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="mqks-bench-nats-")
    cells: dict[str, list[dict]] = {"one broker --log": [], "3 nodes, 16 groups": [], "3 nodes, 4 groups": []}
    if args.paced_rate:
        cells.update({"one broker, paced": [], "3 nodes, 16 groups, paced": []})
    idle: dict[str, float] = {}
    try:
        nats_nodes = nats_local.up(directory, 3, "bench")
        urls = ",".join(node.url for node in nats_nodes)
        nats_pids = [node.pid for node in nats_nodes]
        for rep in range(args.reps):
            broker = peers.start_mqks(None, LOG_DIR,
                                      extra_args=("--log", urls, "--log-stream", f"one{rep}{os.getpid()}"))
            try:
                cells["one broker --log"].append(measured(broker.port, [broker.pid], nats_pids, args))
                if args.paced_rate:
                    cells["one broker, paced"].append(measured(broker.port, [broker.pid], nats_pids, args, True))
            finally:
                broker.stop()
            for groups in (16, 4):
                name = f"c{groups}r{rep}p{os.getpid()}"
                nodes = start_nodes(["a", "b", "c"], name, urls, groups)
                try:
                    wait_settled(name, urls, len(nodes))
                    cells[f"3 nodes, {groups} groups"].append(
                        measured(nodes[0].port, [node.pid for node in nodes], nats_pids, args))
                    if groups == 16 and args.paced_rate:
                        cells["3 nodes, 16 groups, paced"].append(
                            measured(nodes[0].port, [node.pid for node in nodes], nats_pids, args, True))
                    if groups == 16 and rep == 0:
                        time.sleep(5)
                        pids = [node.pid for node in nodes]
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
    one = result_cells["one broker --log"]
    ratios = {f"{key} / one broker": {"rate": cell["rate"] / one["rate"],
                                      "cpu_per_msg": cell["cpu_us_per_msg"] / one["cpu_us_per_msg"]}
              for key, cell in result_cells.items() if key != "one broker --log" and not key.endswith("paced")}
    if args.paced_rate:
        one_paced, cluster_paced = result_cells["one broker, paced"], result_cells["3 nodes, 16 groups, paced"]
        ratios["3 nodes, 16 groups / one broker, paced"] = {
            "rate": cluster_paced["rate"] / one_paced["rate"],
            "cpu_per_msg": cluster_paced["cpu_us_per_msg"] / one_paced["cpu_us_per_msg"],
            "mqks_cpu_per_msg": cluster_paced["mqks_us_per_msg"] / one_paced["mqks_us_per_msg"]}
    print(f"{'cell':<26} {'confirmed/s':>12} {'CPU us/msg':>11} {'(mqks':>7} {'nats)':>7}")
    for key, cell in result_cells.items():
        print(f"{key:<26} {cell['rate']:>12,.0f} {cell['cpu_us_per_msg']:>11.1f} {cell['mqks_us_per_msg']:>7.1f} "
              f"{cell['nats_us_per_msg']:>7.1f}")
    for key, ratio in ratios.items():
        mqks_alone = f" (MQKS alone {ratio['mqks_cpu_per_msg']:.1f}x)" if "mqks_cpu_per_msg" in ratio else ""
        print(f"{key}: {ratio['rate']:.2f}x the rate at {ratio['cpu_per_msg']:.1f}x the CPU per message{mqks_alone}")
    print(f"idle default cluster: MQKS {idle['mqks_core_share']:.1%} of a core, NATS {idle['nats_core_share']:.1%}; "
          f"node a {idle['node_rss_mib']:.0f} MiB resident")
    result = {"revision": git_revision(), "messages": args.messages, "window": args.window,
              "paced_rate": args.paced_rate, "reps": args.reps,
              "cells": result_cells, "ratios": ratios, "idle": idle}
    path = args.json or os.path.join(RESULTS_DIR, f"cluster-confirmed-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A cluster of MQKS nodes (docs/cluster.md) beside one node, on the same machine and the same NATS cluster.

    .venv/bin/python -m bench.cluster [--messages 100000] [--queues 64] [--groups 4] [--reps 3] [--json FILE]

One three-node NATS cluster on loopback (`mqks nats up`, `sync_interval: always`) serves every cell; every node
runs `--groups` slot groups with their streams on it (R3). Cells, each on a fresh cluster name:
- spread, 1 node: `--queues` queues, one producer and one consumer per slot group (bench/workers.py's spread
  flows: unconfirmed publishes, auto-ack), each connected to its group's owner; one node owns every group.
- spread, 3 nodes: the same flows on three nodes once the groups have spread over them.
- one queue through its owner, and through a node that does not own it (the publish crosses nodes on a link,
  every delivery comes back on it): loadgen's w1 flow, on three nodes.
Ratios: 3 nodes / 1 node (on one 2-core machine three nodes share the same cores: this is the cost of the
spread, not its gain), and non-owner / owner (the cost of a line that crosses nodes). Also each cell's server
CPU per delivery, summed over every node's processes. Medians of --reps; an absolute figure from this VM is noise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

from mqks.client import nats_local

from . import loadgen, peers
from .loadgen import Flow
from .run import LOG_DIR, RESULTS_DIR, git_revision
from .workers import MqksGroup, broker_check, queue_groups, run_groups, tree_cpu_seconds


def start_nodes(names: list[str], cluster: str, urls: str, groups: int, processes: int = 0) -> list[peers.Server]:
    """Nodes of `cluster` (`processes` each, 0: one per core), started together; back once every group is owned,
    by as many nodes as can own one."""
    nodes = [peers.start_mqks(None, LOG_DIR, wait=False, extra_args=(
        "--cluster", cluster, "--node", name, "--log", urls, "--groups", str(groups), "--processes", str(processes)))
        for name in names]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        owners = owners_now(nodes)
        if len(owners) == groups and len(set(node for node, _ in owners.values())) == min(len(names), groups):
            return nodes
        time.sleep(0.5)
    for node in nodes:
        node.stop()
    raise RuntimeError(f"cluster {cluster}: the groups did not spread over {names} in 120 s")


def owners_now(nodes: list[peers.Server]) -> dict[int, tuple[str, tuple[str, int]]]:
    """Group -> (node, its owner's own address), from the first node that answers hello."""
    for node in nodes:
        try:
            with loadgen.connect(node.host, node.port) as sock:
                line = loadgen.ask(sock, b"h hello\n", b"\n").split(b"\n", 1)[0]
        except OSError:
            continue
        if line.startswith(b"h ok "):
            hello = json.loads(line[5:])
            return {d["worker"]: (d["node"], (d["host"], d["port"])) for d in hello.get("direct", [])
                    if d.get("node") and d.get("port")}
    return {}


def cluster_cpu(nodes: list[peers.Server]) -> float:
    return sum(tree_cpu_seconds(node.pid) for node in nodes)


def spread_cell(nodes: list[peers.Server], args: argparse.Namespace) -> dict:
    owners = owners_now(nodes)
    queues = [b"bench.cq%d" % i for i in range(args.queues)]
    groups = queue_groups(queues, args.groups, args.groups)
    per_group, extra = divmod(args.messages, len(groups))
    flows = [Flow(proto=MqksGroup(owned), host=owners[group][1][0], port=owners[group][1][1],
                  n=per_group + (i < extra), window=args.window, timeout_s=300.0)
             for i, (group, owned) in enumerate(groups)]
    cpu0 = cluster_cpu(nodes)
    run = run_groups(flows, nodes[0].pid, broker_check(nodes[0].host, nodes[0].port, args.messages, False))
    cpu = cluster_cpu(nodes) - cpu0
    return {"ok": run.ok, "rate": run.rate, "note": run.note, "cpu_us_per_delivery": 1e6 * cpu / max(1, run.got)}


def one_queue_cell(nodes: list[peers.Server], args: argparse.Namespace, through_owner: bool) -> dict:
    """loadgen's w1 flow (queue bench.qx0), connected to the queue's owner or to a node that does not own it."""
    owners = owners_now(nodes)
    from mqks.server.dispatch.slots import owner_of

    group = owner_of(b"bench.qx0", args.groups)
    owner_node, owner_address = owners[group]
    if through_owner:
        host, port = owner_address
    else:  # a node that owns a group (so it listens), not this queue's
        other = next(node for node in nodes if node_name(node) != owner_node
                     and node_name(node) in {name for name, _ in owners.values()})
        host, port = other.host, other.port
    flow = Flow(proto=loadgen.Mqks(), host=host, port=port, n=args.messages, window=args.window, timeout_s=300.0)
    cpu0 = cluster_cpu(nodes)
    result = loadgen.run_flow(flow)
    cpu = cluster_cpu(nodes) - cpu0
    return {"ok": result.ok and not result.errors, "rate": result.rate, "note": result.note,
            "cpu_us_per_delivery": 1e6 * cpu / max(1, args.messages)}


def node_name(node: peers.Server) -> str:
    """The --node a server was started with."""
    args = node.proc.args
    return str(args[list(args).index("--node") + 1])


def median_cell(samples: list[dict]) -> dict:
    good = [s for s in samples if s.get("ok")]
    if not good:
        return {"ok": False, "note": "; ".join(s.get("note", "") for s in samples)}
    return {"ok": True, "rate": statistics.median(s["rate"] for s in good),
            "cpu_us_per_delivery": statistics.median(s["cpu_us_per_delivery"] for s in good),
            "samples": len(good), "notes": [s["note"] for s in samples if s.get("note")]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--queues", type=int, default=64)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--window", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.makedirs(LOG_DIR, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="mqks-bench-nats-")
    samples: dict[str, list[dict]] = {"spread, 1 node": [], "spread, 3 nodes": [], "one queue via its owner": [],
                                      "one queue via another node": []}
    try:
        urls = ",".join(node.url for node in nats_local.up(directory, 3, "bench"))
        for rep in range(args.reps):
            for names, key in ((["a"], "spread, 1 node"), (["a", "b", "c"], "spread, 3 nodes")):
                nodes = start_nodes(names, f"b{rep}{len(names)}{os.getpid()}", urls, args.groups)
                try:
                    samples[key].append(spread_cell(nodes, args))
                    if len(names) == 3:
                        samples["one queue via its owner"].append(one_queue_cell(nodes, args, True))
                        samples["one queue via another node"].append(one_queue_cell(nodes, args, False))
                finally:
                    for node in nodes:
                        node.stop()
                print(f"rep {rep + 1}: " + ", ".join(f"{k} {v[-1].get('rate', 0):,.0f}/s" for k, v in samples.items()
                                                     if v), flush=True)
    finally:
        try:
            nats_local.down(directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    cells = {key: median_cell(values) for key, values in samples.items()}

    def ratio(a: str, b: str) -> float | None:
        return cells[a]["rate"] / cells[b]["rate"] if cells[a].get("ok") and cells[b].get("ok") else None

    result = {"revision": git_revision(), "messages": args.messages, "queues": args.queues, "groups": args.groups,
              "reps": args.reps, "cells": cells,
              "ratios": {"3 nodes / 1 node (spread, same 2 cores)": ratio("spread, 3 nodes", "spread, 1 node"),
                         "via another node / via the owner (one queue)": ratio("one queue via another node",
                                                                               "one queue via its owner")}}
    print(f"{'cell':<30} {'deliveries/s':>14} {'server CPU us/delivery':>24}")
    for key, cell in cells.items():
        rate = f"{cell['rate']:,.0f}" if cell.get("ok") else "FAILED"
        cpu = f"{cell['cpu_us_per_delivery']:.1f}" if cell.get("ok") else cell.get("note", "")[:60]
        print(f"{key:<30} {rate:>14} {cpu:>24}")
    for name, value in result["ratios"].items():
        print(f"{name}: {value:.2f}x" if value is not None else f"{name}: n/a")
    path = args.json or os.path.join(RESULTS_DIR, f"cluster-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["ratios"]))
    return 0 if all(cell.get("ok") for cell in cells.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

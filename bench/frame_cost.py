"""What one stored frame costs NATS, by how a cluster's groups lay their frames out: measured, not assumed.

    .venv/bin/python -m bench.frame_cost [--seconds 6] [--rate 50] [--size 8000] [--reps 2]

On a fresh three-node NATS cluster (R3, `sync_interval: always`, the cluster extra's nats-server), 16 writers,
as 16 groups' owners would be, each append frames of `--size` bytes at `--rate` frames a second (0: as fast as
their PubAcks come back), one in flight each, each fenced as an owner's frame is; two standbys per group follow
on push consumers (memory, one replica, filtered on the group's subject) on two other connections. Layouts:

- `own`: a stream per group (`Nats-Expected-Last-Sequence`), the layout of clusters made before 2026-11-28;
- `shared`: one stream, a subject per group (`Nats-Expected-Last-Subject-Sequence`), today's default;
- `batch`: one stream, the 16 frames of a round sent as one atomic batch (`allow_atomic`, `Nats-Batch-*`,
  each frame fenced by its subject): one raft entry for the round;
- `node`: not how MQKS writes today, a layout measured for issue 40: one writer per node of three, each frame
  holding the records of its node's groups (16/3 frames' bytes), fenced by every group's takeover records at once
  (`Nats-Expected-Last-Subject-Sequence-Subject: TAG.own.*`: any takeover refuses every writer's next frame until
  it has read it), two standbys following each writer's subject;
- `node-own`: the same three writers, each in a stream of its own fenced by its last sequence (a takeover would
  be appended to the old owner node's stream).

It prints the frames stored a second and the CPU of the three nats-servers per frame (medians of `--reps`); a
`node` frame counts as the 16/3 frames whose records it carries.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from mqks.client import nats_local

WRITERS = 16
NODES = 3  # the `node` layout's writers
LAYOUTS = ("own", "shared", "batch", "node", "node-own")


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


async def follow(connections: list[Any], stream_of: Any, tag: str, subjects: int = WRITERS) -> list[int]:
    """Two standbys per group (per writer's subject), each a push consumer on its own connection; the deliveries
    they count."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    delivered = [0]

    async def on_frame(msg: Any) -> None:
        delivered[0] += 1

    for group in range(subjects):
        for nc in connections:
            inbox = nc.new_inbox()
            await nc.subscribe(inbox, cb=on_frame)
            await nc.jetstream()._jsm.add_consumer(stream_of(group), config=ConsumerConfig(
                ack_policy=AckPolicy.NONE, deliver_subject=inbox, filter_subject=f"{tag}.{group}", mem_storage=True,
                num_replicas=1, deliver_policy=DeliverPolicy.NEW))
    return delivered


async def measure(urls: list[str], pids: list[int], layout: str, args: argparse.Namespace) -> dict[str, float]:
    import nats

    tag = f"F{layout}{os.getpid()}{int(time.monotonic() * 1000) % 100000}"
    connections = [await nats.connect(servers=urls) for _ in range(3)]
    nc, body = connections[0], b"x" * args.size
    streams = ([f"{tag}-{g}" for g in range(WRITERS)] if layout == "own"
               else [f"{tag}-{n}" for n in range(NODES)] if layout == "node-own" else [tag])
    for name in streams:
        subjects = ([f"{tag}.{name.rpartition('-')[2]}"] if layout == "own"
                    else [f"{tag}.w.{name.rpartition('-')[2]}"] if layout == "node-own" else [f"{tag}.>"])
        config = {"name": name, "subjects": subjects, "num_replicas": 3, "storage": "file",
                  "allow_atomic": layout == "batch", "duplicate_window": 120 * 10**9}
        await nc.request(f"$JS.API.STREAM.CREATE.{name}", json.dumps(config).encode(), timeout=10)
    takeover_seq = 0
    if layout == "node":  # each group's takeover record, as a cluster's first owners append them
        for group in range(WRITERS):
            takeover_seq = json.loads((await nc.request(f"{tag}.own.{group}", b"", timeout=10)).data)["seq"]
    by_node = layout.startswith("node")
    delivered = await follow(connections[1:], lambda g: streams[g] if layout in ("own", "node-own") else tag,
                             f"{tag}.w" if by_node else tag, NODES if by_node else WRITERS)
    await asyncio.sleep(1.0)  # the consumers' and streams' leaders settle
    last = [0] * WRITERS
    stored: list[float] = [0]
    refused = [0]
    deadline = time.monotonic() + args.seconds
    interval = 1.0 / args.rate if args.rate else 0.0

    async def paced(started: float, done: int) -> None:
        if interval:
            await asyncio.sleep(max(0.0, started + done * interval - time.monotonic()))

    async def writer(group: int) -> None:
        fence = "Nats-Expected-Last-Sequence" if layout == "own" else "Nats-Expected-Last-Subject-Sequence"
        started, k = time.monotonic(), 0
        while time.monotonic() < deadline:
            headers = {"Nats-Msg-Id": f"{group}-{k}", fence: str(last[group])}
            answer = json.loads((await nc.request(f"{tag}.{group}", body, headers=headers, timeout=10)).data)
            if "error" in answer:  # 10164: a right fence refused for the moment; the same frame again
                refused[0] += 1
                await asyncio.sleep(0.005)
                continue
            last[group], k = int(answer["seq"]), k + 1
            stored[0] += 1
            await paced(started, k)

    async def node_writer(node: int) -> None:
        node_body = b"x" * (len(body) * WRITERS // NODES)
        started, k = time.monotonic(), 0
        while time.monotonic() < deadline:
            if layout == "node":
                headers = {"Nats-Expected-Last-Subject-Sequence": str(takeover_seq),
                           "Nats-Expected-Last-Subject-Sequence-Subject": f"{tag}.own.*"}
            else:
                headers = {"Nats-Expected-Last-Sequence": str(last[node])}
            answer = json.loads((await nc.request(f"{tag}.w.{node}", node_body,
                                                  headers={**headers, "Nats-Msg-Id": f"w{node}-{k}"}, timeout=10)).data)
            if "error" in answer:  # 10164 as for `shared`: the same frame again
                refused[0] += 1
                await asyncio.sleep(0.005)
                continue
            last[node], k = int(answer["seq"]), k + 1
            stored[0] += WRITERS / NODES  # the group frames whose records it carries
            await paced(started, k)

    async def rounds() -> None:
        started, k = time.monotonic(), 0
        while time.monotonic() < deadline:
            batch = f"{tag}-{k}"
            for group in range(WRITERS):
                headers = {"Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(group + 1), "Nats-Msg-Id": f"{group}-{k}",
                           "Nats-Expected-Last-Subject-Sequence": str(last[group])}
                if group < WRITERS - 1:
                    await nc.publish(f"{tag}.{group}", body, headers=headers)
                    continue
                headers["Nats-Batch-Commit"] = "1"
                answer = json.loads((await nc.request(f"{tag}.{group}", body, headers=headers, timeout=10)).data)
                if "error" in answer:
                    raise RuntimeError(f"an atomic batch was refused: {answer['error']}")
                for g in range(WRITERS):  # a batch's frames take consecutive sequences, the commit's last
                    last[g] = int(answer["seq"]) - WRITERS + 1 + g
            stored[0] += WRITERS
            k += 1
            await paced(started, k)

    cpu, began = cpu_seconds(pids), time.monotonic()
    if layout == "batch":
        await rounds()
    elif by_node:  # each at the rate of the groups it carries: as many records a second as the others
        await asyncio.gather(*(node_writer(node) for node in range(NODES)))
    else:
        await asyncio.gather(*(writer(group) for group in range(WRITERS)))
    seconds, spent = time.monotonic() - began, cpu_seconds(pids) - cpu
    for name in streams:
        await nc.jetstream().delete_stream(name)
    for connection in connections:
        await connection.close()
    return {"frames_per_second": stored[0] / seconds, "nats_us_per_frame": spent / max(1, stored[0]) * 1e6,
            "deliveries_per_frame": delivered[0] / max(1, stored[0]),
            "refused_per_stored": refused[0] / max(1, stored[0])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.frame_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rate", type=float, default=50.0, help="frames a second per writer (0: unpaced)")
    parser.add_argument("--size", type=int, default=8000)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args(argv)
    directory = tempfile.mkdtemp(prefix="mqks-bench-nats-")
    try:
        nodes = nats_local.up(directory, 3, "frames")
        urls, pids = [node.url for node in nodes], [node.pid for node in nodes]
        found: dict[str, list[dict[str, float]]] = {layout: [] for layout in LAYOUTS}
        for _ in range(args.reps):  # interleaved: the machine's drift falls on every layout alike
            for layout in LAYOUTS:
                found[layout].append(asyncio.run(measure(urls, pids, layout, args)))
    finally:
        try:
            nats_local.down(directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    print(f"{WRITERS} writers, {args.size} B frames, {args.rate or 'unpaced'} frames/s each, R3, fsync always:")
    for layout, samples in found.items():
        rate = statistics.median(s["frames_per_second"] for s in samples)
        cost = statistics.median(s["nats_us_per_frame"] for s in samples)
        runs = ", ".join(f"{sample['nats_us_per_frame']:,.0f}" for sample in samples)
        refused = statistics.median(s["refused_per_stored"] for s in samples)
        print(f"  {layout:7} {rate:8,.0f} frames/s  {cost:6,.0f} µs of NATS CPU per frame  (runs: {runs})"
              f"  {refused:.2f} refused for the moment per stored")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

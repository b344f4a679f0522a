"""Confirmed publishes on the local disk log and on the replicated log, plain and with per-message acks, beside
NATS JetStream's own pipelined publishes from nats-py to the same cluster (the cluster extra).

    .venv/bin/python -m bench.replicated [--messages 200000] [--plain-messages 100000] [--reps 3]
                                         [--cells plain,acked,jetstream,floor] [--profile DIR] [--trees A,B]
                                         [--floor-in-flight 2,4] [--floor-messages 300000] [--pin]
                                         [--json FILE]

One three-node NATS cluster on loopback (`mqks nats up`, `sync_interval: always`) serves every cell. The MQKS
cells run loadgen's confirmed w5 flow (100-byte messages, at most --window publishes unconfirmed, one ack line
per message, done once every publish is confirmed and acked): `--data-dir --fsync always` and
`--log nats://...` (R3). The peer is nats-py publishing the same number of 100-byte messages to an R3 stream
with 1,000 in flight (js.publish_async). Figures are medians of --reps; the ratios are the result, an absolute
figure from this VM is noise. Each acked cell also gives the MQKS server's CPU per message and the confirm latency
p50/p99 of lock-step confirmed publishes (one at a time, 2,000 of them). The plain cells (issue 59's held-out
cell) pipeline --plain-messages `publish --confirm` of 100 bytes into one queue, at most --plain-window (2,000)
unconfirmed, no consumer, no ack: what a confirm alone costs on each log. --profile DIR runs each MQKS server
under cProfile (DIR/<cell>-<rep>.prof: the main thread, where the loop and the log's writer run). --trees A,B
(each a copy of the package as A/mqks, e.g. `cp -rL build/__editable__*/mqks A/`) runs each replicated cell once
per tree, the trees' order alternated from rep to rep, each against the same rep's local disk (the installed tree):
paired figures of an old and a new writer on one NATS. The plain replicated cell also gives the bytes NATS stores a
frame and a publish (stream info), and a line that sums what a publish cost MQKS, NATS and this client against what
the machine's cores give a publish at 0.8x the local disk. `--cells plain,floor` adds the floor: JetStream alone
(no MQKS running), nats-py appending frames of the size the same rep's replicated cell stored, with MQKS's writer's
headers (Nats-Msg-Id, the expected-sequence fence), --floor-in-flight at a time, reported as the publishes a
second those frames carry (frame bytes / stored bytes a publish), the NATS servers' CPU a frame and a publish, and
a ratio to the same rep's local disk. --pin confines every thread of the three nats-servers to the last core and
each MQKS server to the first (taskset; the client unpinned).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

from mqks.client import nats_local

from . import loadgen, peers
from .cluster_confirmed import read_answers, use_tree
from .run import busy_seconds, mqks_check, mqks_stats, process_cpu_seconds

LOCAL, REPLICATED = "local disk, fsync always", "replicated log, R3"
PLAIN = "plain confirms, "  # the held-out cell's rows: PLAIN + LOCAL, PLAIN + REPLICATED
JETSTREAM = "jetstream nats-py, 1000 in flight, R3"
FLOOR = "JetStream alone, the same frames, %d in flight"  # the floor cell's rows, by frames in flight


def mqks_cell(args: argparse.Namespace, log_dir: str, extra: list[str], data_dir: str | None) -> dict:
    server = peers.start_mqks(0 if args.pin else None, log_dir, data_dir=data_dir, fsync="always",
                              extra_args=tuple(extra))
    try:
        proto = loadgen.Mqks(manual_ack=True, confirm=True)
        flow = loadgen.Flow(proto=proto, host=server.host, port=server.port, n=args.messages, window=args.window,
                            timeout_s=300.0, confirm=True)
        cpu0 = process_cpu_seconds(server.pid)
        result = loadgen.run_flow(flow, check=mqks_check(server, args.messages, 1, True))
        cpu = process_cpu_seconds(server.pid) - cpu0
        p50, p99 = lockstep_latency(server.host, server.port)
        return {"ok": result.ok and not result.errors, "rate": result.rate, "note": result.note,
                "cpu_us_per_msg": 1e6 * cpu / args.messages, "confirm_p50_ms": p50, "confirm_p99_ms": p99}
    finally:
        server.stop()


def plain_cell(args: argparse.Namespace, log_dir: str, extra: list[str], data_dir: str | None,
               profile_path: str | None, nats_pids: list[int], urls: list[str]) -> dict:
    """--plain-messages confirmed publishes into one queue with no consumer, at most --plain-window unconfirmed:
    confirms a second, the server's, this client's and the NATS servers' CPU per message, the machine's busy
    cores, the log's frames (lines' bytes each, PubAck p50, and the bytes NATS stores a frame and a publish) on
    the replicated log, and whether every message is queued."""
    server = peers.start_mqks(0 if args.pin else None, log_dir, data_dir=data_dir, fsync="always",
                              extra_args=tuple(extra), profile_path=profile_path)
    try:
        n, window = args.plain_messages, args.plain_window
        sock = socket.create_connection((server.host, server.port), timeout=60)
        pending = bytearray()
        sock.sendall(b"r rebind --confirm plain.q plain.e\n")
        read_answers(sock, 1, pending)
        log_before = log_figures(sock)
        body = loadgen.payload()
        lines = [b"p%d publish --confirm plain.e %b\n" % (i, body) for i in range(n)]
        sent = answered = 0
        cpu0, busy0, own0 = process_cpu_seconds(server.pid), busy_seconds()[0], time.process_time()
        nats_cpu0 = sum(map(process_cpu_seconds, nats_pids))
        started = time.perf_counter()
        while answered < n:
            if sent - answered < window:
                upto = min(n, answered + window)
                sock.sendall(b"".join(lines[sent:upto]))
                sent = upto
            answered += read_answers(sock, 0, pending)
        seconds = time.perf_counter() - started
        cpu, busy = process_cpu_seconds(server.pid) - cpu0, busy_seconds()[0] - busy0
        own = time.process_time() - own0
        nats_cpu = sum(map(process_cpu_seconds, nats_pids)) - nats_cpu0
        log_after = log_figures(sock)
        sock.close()
        stats = mqks_stats(server)
        queued = stats.get("messages_waiting")
        figures = {"ok": queued == n, "rate": n / seconds, "cpu_us_per_msg": 1e6 * cpu / n,
                   "nats_cpu_us_per_msg": 1e6 * nats_cpu / n, "client_us_per_msg": 1e6 * own / n,
                   "machine_cores": busy / seconds,
                   "note": "" if queued == n else f"{queued} of {n} queued"}
        if "puback_ms_p50" in log_after:
            figures["frame_bytes"] = n * len(lines[0]) / max(1, log_after["last_seq"] - log_before["last_seq"])
            figures["puback_ms_p50"] = log_after["puback_ms_p50"]
            stored, frames = asyncio.run(stream_state(urls, extra[extra.index("--log-stream") + 1]))
            figures["stored_frame_bytes"], figures["stored_bytes_per_msg"] = stored / frames, stored / n
        return figures
    finally:
        server.stop()


async def stream_state(urls: list[str], stream: str) -> tuple[int, int]:
    """A stream's (bytes, messages) as NATS stores them: subjects, headers and record overhead included."""
    import nats

    nc = await nats.connect(servers=urls)
    info = await nc.jetstream().stream_info(stream)
    await nc.close()
    return info.state.bytes, info.state.messages


async def frames_floor(urls: list[str], nats_pids: list[int], stream: str, frame_bytes: float, in_flight: int,
                       publishes: int, bytes_per_publish: float) -> dict:
    """JetStream alone, the replicated cell's frames without MQKS: nats-py appends frames stored at `frame_bytes`
    each (headers as MQKS's writer sends them: epoch, counter, Nats-Msg-Id and the Nats-Expected-Last-Sequence
    fence, each expecting the sequence the frame before it will get), `in_flight` at a time, to an R3 file
    stream, until they carry `publishes` publishes of `bytes_per_publish` stored bytes. Returns the publishes a
    second they carry, frames a second, the NATS servers' CPU per frame and per publish, this client's, the
    machine's busy cores and the PubAck p50."""
    import collections

    import nats
    import nats.errors

    nc = await nats.connect(servers=urls)
    subject = f"mqks.log.{stream}"
    config = {"name": stream, "subjects": [subject], "num_replicas": 3, "storage": "file", "discard": "new",
              "duplicate_window": 120 * 10**9}
    await nc.request(f"$JS.API.STREAM.CREATE.{stream}", json.dumps(config).encode(), timeout=10)
    for _ in range(50):  # the new stream's leader may take a moment to be elected: no responders until then
        try:
            last = json.loads((await nc.request(subject, b"takeover", timeout=10)).data)["seq"]  # a writer's first
            break
        except nats.errors.NoRespondersError:
            await asyncio.sleep(0.1)
    else:
        raise RuntimeError(f"the stream {stream} has no leader")
    headers = {"Mqks-Epoch": "1", "Mqks-Frame": "0", "Nats-Msg-Id": f"{stream}.1.ab12cd34.0",
               "Nats-Expected-Last-Sequence": str(last)}
    overhead = 30 + len(subject) + sum(len(k) + len(v) + 4 for k, v in headers.items())  # the file store's record
    body = b"x" * max(1, round(frame_bytes) - overhead)
    frames = max(in_flight, round(publishes * bytes_per_publish / frame_bytes))
    flying: collections.deque = collections.deque()
    pubacks: list[float] = []
    sent = 0
    cpu0, own0, busy0 = sum(map(process_cpu_seconds, nats_pids)), time.process_time(), busy_seconds()[0]
    started = time.perf_counter()
    while sent < frames or flying:
        while sent < frames and len(flying) < in_flight:
            sent += 1
            headers = {"Mqks-Epoch": "1", "Mqks-Frame": str(sent), "Nats-Msg-Id": f"{stream}.1.ab12cd34.{sent}",
                       "Nats-Expected-Last-Sequence": str(last + sent - 1)}
            flying.append((time.perf_counter(), asyncio.ensure_future(nc.request(subject, body, timeout=10,
                                                                                 headers=headers))))
        sent_at, future = flying.popleft()
        answer = json.loads((await future).data)
        pubacks.append(time.perf_counter() - sent_at)
        if "error" in answer:
            raise RuntimeError(f"a frame was refused: {answer['error']}")
    seconds = time.perf_counter() - started
    nats_cpu = sum(map(process_cpu_seconds, nats_pids)) - cpu0
    own, busy = time.process_time() - own0, busy_seconds()[0] - busy0
    await nc.jetstream().delete_stream(stream)
    await nc.close()
    carried = frames * frame_bytes / bytes_per_publish
    return {"ok": True, "note": "", "rate": carried / seconds, "frames_per_second": frames / seconds,
            "nats_us_per_frame": 1e6 * nats_cpu / frames, "nats_cpu_us_per_msg": 1e6 * nats_cpu / carried,
            "client_us_per_frame": 1e6 * own / frames, "machine_cores": busy / seconds,
            "puback_ms_p50": 1000 * statistics.median(pubacks), "frame_bytes": frame_bytes}


def log_figures(sock: socket.socket) -> dict:
    """The `log` object of the broker's `stats`, asked on a connection that owes no answer."""
    sock.sendall(b"s stats\n")
    return json.loads(loadgen.read_until(sock, b"\n").split(b" ok ", 1)[1])["log"]


def lockstep_latency(host: str, port: int, count: int = 2000) -> tuple[float, float]:
    """Confirm latency of one confirmed publish at a time into a bound queue: (p50, p99) in ms."""
    sock = socket.create_connection((host, port))
    reader = sock.makefile("rb")
    sock.sendall(b"b rebind --confirm lat.q lat.e\n")
    reader.readline()
    samples = []
    for i in range(count):
        started = time.perf_counter()
        sock.sendall(b"p%d publish --confirm lat.e %b\n" % (i, b"x" * 100))
        reader.readline()
        samples.append((time.perf_counter() - started) * 1000.0)
    sock.close()
    samples.sort()
    return samples[len(samples) // 2], samples[len(samples) * 99 // 100]


async def jetstream_rate(urls: list[str], messages: int, stream: str, in_flight: int = 1000) -> float:
    """nats-py, `publish_async` with `in_flight` pending, to an R3 file stream: PubAcks per second."""
    import nats

    nc = await nats.connect(servers=urls)
    js = nc.jetstream(publish_async_max_pending=in_flight)
    await js.add_stream(name=stream, subjects=[f"{stream}.x"], num_replicas=3, storage="file")
    payload = b"x" * 100
    started = time.perf_counter()
    futures = [await js.publish_async(f"{stream}.x", payload) for _ in range(messages)]
    await js.publish_async_completed()
    seconds = time.perf_counter() - started
    assert all(f.done() and not f.exception() for f in futures)
    await js.delete_stream(stream)
    await nc.close()
    return messages / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--plain-messages", type=int, default=100_000)
    parser.add_argument("--jetstream-messages", type=int, default=50_000)
    parser.add_argument("--window", type=int, default=10_000)
    parser.add_argument("--plain-window", type=int, default=2_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cells", default="plain,acked,jetstream",
                        help="which of plain, acked, jetstream, floor to run (floor: JetStream alone appending the "
                        "frames the replicated plain cell stored, as publishes a second they carry)")
    parser.add_argument("--floor-in-flight", default="2,4", help="the floor cell's frames in flight, one row each")
    parser.add_argument("--floor-messages", type=int, default=300_000, help="the publishes the floor's frames carry")
    parser.add_argument("--floor-frame-bytes", type=float, default=0.0,
                        help="the floor's stored frame size (default: the replicated plain cell's, else 77,000)")
    parser.add_argument("--profile", default=None, help="a directory: each MQKS server runs under cProfile")
    parser.add_argument("--trees", default="", help="directories, each holding a copy of the package as mqks/: "
                        "each replicated cell runs once per tree, alternated (default: the installed tree)")
    parser.add_argument("--pin", action="store_true", help="every thread of the NATS servers on the last core, each "
                        "MQKS server on the first (the client and the floor's nats-py unpinned)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cells = set(args.cells.split(","))
    trees = [tree for tree in args.trees.split(",") if tree] or [""]
    work = tempfile.mkdtemp(prefix="bench-replicated-")
    log_dir = tempfile.mkdtemp(prefix="bench-replicated-logs-")
    nodes = nats_local.up(f"{work}/nats", 3)
    urls = [node.url for node in nodes]
    if args.pin:
        for node in nodes:
            subprocess.run(["taskset", "-a", "-pc", str((os.cpu_count() or 1) - 1), str(node.pid)], check=True,
                           capture_output=True)
    results: dict[str, list[dict]] = {}
    jetstream: list[float] = []
    try:
        for rep in range(args.reps):
            for kind in ("plain", "acked"):
                if kind not in cells:
                    continue
                ordered = trees if rep % 2 == 0 else trees[::-1]  # neither tree always runs first
                for log_name, tree in [(LOCAL, ""), *((REPLICATED, tree) for tree in ordered)]:
                    use_tree(tree)
                    data_dir = f"{work}/data-{rep}" if log_name == LOCAL else None
                    label = f"{os.path.basename(tree.rstrip('/'))}: " if tree else ""
                    log_args = [] if data_dir else ["--log", ",".join(urls),
                                                    "--log-stream", f"bench{kind}{rep}t{trees.index(tree)}"]
                    if kind == "plain":
                        where = "local" if data_dir else f"nats{trees.index(tree) if tree else ''}"
                        profile = os.path.join(args.profile, f"{kind}-{where}-{rep}.prof") if args.profile else None
                        sample = plain_cell(args, log_dir, log_args, data_dir, profile, [node.pid for node in nodes],
                                            urls)
                    else:
                        sample = mqks_cell(args, log_dir, log_args, data_dir)
                    results.setdefault(label + (PLAIN if kind == "plain" else "") + log_name, []).append(sample)
                    if data_dir:
                        shutil.rmtree(data_dir, ignore_errors=True)
                use_tree("")
            if "floor" in cells:  # the frames this rep's replicated cell stored, or --floor-frame-bytes
                plain = results.get(PLAIN + REPLICATED if not trees[0] else
                                    f"{os.path.basename(trees[0].rstrip('/'))}: {PLAIN}{REPLICATED}", [{}])[-1]
                frame_bytes = args.floor_frame_bytes or plain.get("stored_frame_bytes", 77_000)
                per_msg = plain.get("stored_bytes_per_msg", 140.0)
                for depth in map(int, args.floor_in_flight.split(",")):
                    results.setdefault(FLOOR % depth, []).append(asyncio.run(frames_floor(
                        urls, [node.pid for node in nodes], f"floor{rep}d{depth}", frame_bytes, depth,
                        args.floor_messages, per_msg)))
            if "jetstream" in cells:
                jetstream.append(asyncio.run(jetstream_rate(urls, args.jetstream_messages, f"peer{rep}")))
    finally:
        nats_local.down(f"{work}/nats")
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for name, samples in results.items():
        summary[name] = {key: statistics.median(s[key] for s in samples) for key in samples[0]
                         if key not in ("ok", "note")}
        summary[name]["ok"] = all(s["ok"] for s in samples)
        summary[name]["notes"] = [s["note"] for s in samples if s["note"]]
    if jetstream:
        summary[JETSTREAM] = {"rate": statistics.median(jetstream)}
    for name, figures in summary.items():
        extra = "" if "cpu_us_per_msg" not in figures else f"  cpu {figures['cpu_us_per_msg']:.1f} us/msg"
        if "nats_cpu_us_per_msg" in figures:  # the three NATS servers' together
            extra += f"  nats cpu {figures['nats_cpu_us_per_msg']:.1f} us/msg"
        if "client_us_per_msg" in figures:
            extra += f"  client cpu {figures['client_us_per_msg']:.1f} us/msg"
        if "puback_ms_p50" in figures:
            extra += f"  frames {figures['frame_bytes'] / 1024:.0f} KiB, PubAck p50 {figures['puback_ms_p50']:.2f} ms"
        if "stored_bytes_per_msg" in figures:
            extra += (f"  stored {figures['stored_frame_bytes'] / 1024:.0f} KiB a frame, "
                      f"{figures['stored_bytes_per_msg']:.0f} B a publish")
        if "nats_us_per_frame" in figures:
            extra += (f"  {figures['frames_per_second']:,.0f} frames/s, nats cpu {figures['nats_us_per_frame']:,.0f} "
                      f"us/frame, client {figures['client_us_per_frame']:,.0f} us/frame")
        if "machine_cores" in figures:  # every process's, NATS's and this one's too: near 2, the cell is CPU-bound
            extra += f"  machine {figures['machine_cores']:.2f} cores busy"
        if "confirm_p50_ms" in figures:
            extra += f"  confirm p50/p99 {figures['confirm_p50_ms']:.2f}/{figures['confirm_p99_ms']:.2f} ms"
        if "ok" in figures and not figures["ok"]:
            extra += "  NOT OK: " + "; ".join(figures["notes"])
        runs = ", ".join(f"{s['rate']:,.0f}" for s in results.get(name, []))
        print(f"{name:56s} {figures['rate']:>10,.0f} msg/s{extra}" + (f"  (runs: {runs})" if runs else ""))
    for prefix, tree in itertools.product((PLAIN, ""), trees):
        label = f"{os.path.basename(tree.rstrip('/'))}: " if tree else ""
        if prefix + LOCAL in summary:
            replicated = summary[label + prefix + REPLICATED]["rate"]
            peer = (f"replicated / JetStream per-message: {replicated / summary[JETSTREAM]['rate']:.2f}x   "
                    if jetstream and not prefix else "")
            # each rep's replicated rate over the same rep's local disk: the pairs, beside the ratio of the medians
            paired = [s["rate"] / local["rate"] for s, local in zip(results[label + prefix + REPLICATED],
                                                                    results[prefix + LOCAL], strict=True)]
            print(f"{label}{prefix or 'acked: '}{peer}replicated / local disk: "
                  f"{replicated / summary[prefix + LOCAL]['rate']:.2f}x  (each rep: "
                  f"{', '.join(f'{ratio:.2f}' for ratio in paired)})")
            if tree != trees[0]:  # paired against the first tree, rep by rep
                first = os.path.basename(trees[0].rstrip("/"))
                pairs = list(zip(results[label + prefix + REPLICATED], results[f"{first}: {prefix}{REPLICATED}"],
                                 strict=True))
                faster = sum(s["rate"] > other["rate"] for s, other in pairs)
                print(f"{label}{prefix or 'acked: '}faster than {first} in {faster} of {len(pairs)} reps")
    if PLAIN + LOCAL in summary:
        local = summary[PLAIN + LOCAL]
        for name in (name for name in summary if name.startswith(FLOOR.split("%")[0])):
            paired = [s["rate"] / disk["rate"] for s, disk in zip(results[name], results[PLAIN + LOCAL], strict=True)]
            print(f"{name} / local disk: {summary[name]['rate'] / local['rate']:.2f}x  "
                  f"(each rep: {', '.join(f'{ratio:.2f}' for ratio in paired)})")
        for tree in trees:
            label = f"{os.path.basename(tree.rstrip('/'))}: " if tree else ""
            replicated = summary.get(label + PLAIN + REPLICATED)
            if replicated and "client_us_per_msg" in replicated:
                # the 2 cores' time a publish may take at 0.8x the local disk, against what the replicated cell's
                # processes spent on one (other processes on the machine not counted)
                spent = [replicated[key] for key in ("cpu_us_per_msg", "nats_cpu_us_per_msg", "client_us_per_msg")]
                print(f"{label}plain: CPU a replicated publish: MQKS {spent[0]:.2f} + NATS {spent[1]:.2f} + client "
                      f"{spent[2]:.2f} = {sum(spent):.2f} us; at 0.8x the local disk "
                      f"({0.8 * local['rate']:,.0f} msg/s) {os.cpu_count()} cores give "
                      f"{1e6 * (os.cpu_count() or 1) / (0.8 * local['rate']):.2f} us a publish")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "samples": results, "jetstream": jetstream}, f, indent=1)


if __name__ == "__main__":
    main()

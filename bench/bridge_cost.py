"""What a stored frame costs the broker's own process through the replicated log's writer, and through a bare socket.

    .venv/bin/python -m bench.bridge_cost [--rate 400] [--seconds 5] [--size 2000] [--reps 2]

At a paced load a cluster node spends its CPU per stream message, not per publish (docs/cluster.md: 68 µs of MQKS
CPU per confirmed message at 10,000 msg/s through node a, against 25 for one broker). This measures what the log's
writer costs per frame: on a fresh three-node NATS cluster (R3, `sync_interval: always`), one process appends
`--rate` frames a second of `--size` bytes, one commit each, and counts its own CPU (every thread) per stored frame:

- `pacing`: the pacing loop alone (a gevent sleep every 2 ms), subtracted from the others;
- `log`: `JetStreamLog` on a stream of its own, as `mqksd --log` writes: its writer greenlet publishes each frame
  on the hub's own NATS connection (nats_io/hub_nats.py) and reads the PubAck there (until 372b339 it handed each
  commit to nats-py's asyncio thread through the bridge and took the PubAck back: 256 µs a frame at 400/s);
- `socket`: the floor: one plain TCP socket to NATS read and written by the hub's greenlets (HPUB with the log's
  headers, PubAcks read in chunks and parsed with json), none of a client's or a writer's duties (TLS,
  credentials, reconnects, fencing, frames tracked until stored).

Medians of `--reps`, the cells interleaved; the difference between `log` and `socket` is what the writer and the
hub connection add to the bare protocol.
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
from collections.abc import Callable

import gevent
from gevent import socket as gsocket

from mqks.client import nats_local

CELLS = ("pacing", "log", "socket")
PACE_SECONDS = 0.002


def paced(args: argparse.Namespace, send_one: Callable[[], None], stored: Callable[[], int]) -> float:
    """CPU seconds of this process per frame, `args.rate` frames a second for `args.seconds`, all stored."""
    started, sent, cpu = time.monotonic(), 0, time.process_time()
    while time.monotonic() - started < args.seconds:
        due = int((time.monotonic() - started) * args.rate)
        while sent < due:
            send_one()
            sent += 1
        gevent.sleep(PACE_SECONDS)
    deadline = time.monotonic() + 30
    while stored() < sent:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{stored()} of {sent} frames stored after 30 s")
        gevent.sleep(PACE_SECONDS)
    return (time.process_time() - cpu) / sent


def log_cell(urls: list[str], stream: str, args: argparse.Namespace) -> float:
    from mqks.server.journal.jetstream_log import JetStreamLog

    record = b"r" * args.size
    log = JetStreamLog(urls, stream, "bench", replicas=3)
    log.open()
    for _ in log.replay():
        pass

    def send_one() -> None:
        log.append(record)
        log.commit()

    try:
        return paced(args, send_one, lambda: log.poll()[0])
    finally:
        log.close(5)


def make_stream(urls: list[str], stream: str) -> None:
    import nats
    from nats.js.api import StorageType, StreamConfig

    async def make() -> None:
        nc = await nats.connect(servers=urls)
        await nc.jetstream().add_stream(StreamConfig(name=stream, subjects=[f"{stream}.log"], num_replicas=3,
                                                     storage=StorageType.FILE))
        await nc.close()

    asyncio.run(make())


def socket_cell(urls: list[str], stream: str, args: argparse.Namespace) -> float:
    make_stream(urls, stream)
    host, port = urls[0].rpartition("/")[2].split(":")
    sock = gsocket.create_connection((host, int(port)))
    sock.recv(65536)  # INFO
    sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"no_responders":true,"protocol":1}'
                 b"\r\nSUB _BENCH.* 1\r\nPING\r\n")
    record, subject, stored, k = b"r" * args.size, f"{stream}.log".encode(), [0], [0]

    def read_pubacks() -> None:
        buffer = b""
        while True:
            chunk = sock.recv(1 << 16)
            if not chunk:
                return
            buffer += chunk
            while True:
                end = buffer.find(b"\r\n")
                if end < 0:
                    break
                line = buffer[:end]
                if line.startswith(b"MSG "):
                    size = int(line.rpartition(b" ")[2])
                    if len(buffer) < end + 2 + size + 2:
                        break
                    if "seq" in json.loads(buffer[end + 2:end + 2 + size]):
                        stored[0] += 1
                    buffer = buffer[end + 2 + size + 2:]
                    continue
                if line == b"PING":
                    sock.sendall(b"PONG\r\n")
                buffer = buffer[end + 2:]

    reader = gevent.spawn(read_pubacks)

    def send_one() -> None:
        k[0] += 1
        headers = b"NATS/1.0\r\nMqks-Epoch: 1\r\nMqks-Frame: %d\r\nNats-Msg-Id: %b.1.%d\r\n\r\n" % (
            k[0], subject, k[0])
        sock.sendall(b"HPUB %b _BENCH.%d %d %d\r\n%b%b\r\n" % (subject, k[0], len(headers),
                                                              len(headers) + len(record), headers, record))

    try:
        return paced(args, send_one, lambda: stored[0])
    finally:
        reader.kill()
        sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bridge_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=int, default=400, help="frames a second")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--size", type=int, default=2000, help="bytes a frame")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args(argv)
    directory = tempfile.mkdtemp(prefix="mqks-bench-nats-")
    found: dict[str, list[float]] = {cell: [] for cell in CELLS}
    try:
        urls = [node.url for node in nats_local.up(directory, 3, "bridge")]
        for rep in range(args.reps):
            for cell in CELLS:
                stream = f"bridgecost{os.getpid()}{cell}{rep}"
                if cell == "pacing":
                    found[cell].append(paced(args, lambda: None, lambda: 1 << 62))  # nothing to wait for
                elif cell == "log":
                    found[cell].append(log_cell(urls, stream, args))
                else:
                    found[cell].append(socket_cell(urls, stream, args))
    finally:
        try:
            nats_local.down(directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    pacing = statistics.median(found["pacing"])
    print(f"{args.rate} frames/s of {args.size} B, one commit each, R3, fsync always; CPU of this process per "
          f"stored frame, the pacing ({pacing * 1e6:.0f} µs) taken off:")
    for cell in CELLS[1:]:
        runs = ", ".join(f"{(value - pacing) * 1e6:,.0f}" for value in found[cell])
        print(f"  {cell:7} {(statistics.median(found[cell]) - pacing) * 1e6:6,.0f} µs  (runs: {runs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

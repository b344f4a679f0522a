"""The Python clients' own rates: mqks.aio (asyncio, and uvloop where installed) and the gevent client beside
nats-py against NATS on the same machine.

    .venv/bin/python -m bench.clients                 # 3 interleaved runs per cell, medians (~2 min)
    .venv/bin/python -m bench.clients --messages 50000 --reps 1 --json bench/results/clients.json

The servers (mqksd, nats-server core) run pinned to core 1, each client in its own process pinned to core 0,
so a cell measures what one core of Python client gets through one broker core. Cells, 100-byte payloads:
- publish: N fire-and-forget publishes in a loop, then a round trip (mqks `ping`, NATS `flush`): the broker
  has read them all.
- confirmed: N publishes acknowledged by the broker, 1,000 in flight (mqks `confirm=True` under
  `asyncio.gather` / greenlets; NATS has no core equivalent: no peer cell).
- consume: N messages from one publisher to one consumer in the same process, until the consumer has all.
- ack each: as consume, through a manual-ack consumer (prefetch 1,000) that acks every message on its own
  line (`await msg.ack()`, `msg.ack()`); NATS core has no acks: no peer cell.
The goal (issue 29): mqks.aio's pipelined publishes at least 1.0x nats-py's, same event loop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench import peers

PAYLOAD = "x" * 100
IN_FLIGHT = 1000
CLIENT_CORE, SERVER_CORE = 0, 1
CELLS = ("publish", "confirmed", "consume", "ack_each")
# (client, loop): the loop is "asyncio" or "uvloop" for the asyncio clients, "gevent" for the gevent client
CLIENTS = (("mqks.aio", "asyncio"), ("mqks.aio", "uvloop"), ("mqks gevent", "gevent"), ("nats-py", "asyncio"),
           ("nats-py", "uvloop"))
NO_PEER_CELL = {"confirmed", "ack_each"}  # NATS core has neither


# --- one measurement, in its own process (`python -m bench.clients --one ...`) ---

async def mqks_aio_cell(cell: str, port: int, n: int) -> float:
    from mqks import aio

    async with aio.Client("127.0.0.1", port) as client:
        queue, event = f"bench-{os.getpid()}-{cell}", f"e-{os.getpid()}-{cell}"
        consumer = None
        if cell in ("consume", "ack_each"):
            manual = cell == "ack_each"
            consumer = await client.consume(queue, [event], manual_ack=manual, prefetch=IN_FLIGHT if manual else 0,
                                            max_buffered=10_000)
        start = time.perf_counter()
        if cell == "confirmed":
            import asyncio
            for first in range(0, n, IN_FLIGHT):
                await asyncio.gather(*(client.publish(event, PAYLOAD, confirm=True)
                                       for _ in range(min(IN_FLIGHT, n - first))))
        else:
            for _ in range(n):
                await client.publish(event, PAYLOAD)
        if consumer is None:
            await client.ping()
        else:
            got = 0
            async for message in consumer:
                if cell == "ack_each":
                    await message.ack()
                got += 1
                if got == n:
                    break
            await client.ping()
        return n / (time.perf_counter() - start)


def mqks_gevent_cell(cell: str, port: int, n: int) -> float:
    import gevent
    from gevent.event import Event

    from mqks.client import Client

    client = Client("127.0.0.1", port).connect()
    try:
        queue, event = f"bench-{os.getpid()}-{cell}", f"e-{os.getpid()}-{cell}"
        done = Event()
        got = 0
        if cell in ("consume", "ack_each"):
            manual = cell == "ack_each"

            def on_message(message: Any) -> None:
                nonlocal got
                if manual:
                    message.ack()
                got += 1
                if got == n:
                    done.set()

            client.consume(queue, [event], on_message, manual_ack=manual, prefetch=IN_FLIGHT if manual else 0)
        start = time.perf_counter()
        if cell == "confirmed":
            for first in range(0, n, IN_FLIGHT):
                gevent.joinall([gevent.spawn(client.publish, event, PAYLOAD, confirm=True)
                                for _ in range(min(IN_FLIGHT, n - first))], raise_error=True)
        else:
            for i in range(n):
                client.publish(event, PAYLOAD)
                if i % 1000 == 999:
                    gevent.sleep(0)  # let the writer and the consumer run, as a real publisher's loop would
        if cell in ("consume", "ack_each"):
            done.wait()
        client.ping()
        return n / (time.perf_counter() - start)
    finally:
        client.close()


async def nats_cell(cell: str, port: int, n: int) -> float:
    import asyncio

    import nats

    nc = await nats.connect(f"nats://127.0.0.1:{port}", max_reconnect_attempts=0,
                            pending_size=64 * 1024 * 1024)
    try:
        subject, payload = f"bench.{os.getpid()}.{cell}", PAYLOAD.encode()
        got = 0
        done = asyncio.Event()
        if cell == "consume":
            async def on_message(_message: Any) -> None:
                nonlocal got
                got += 1
                if got == n:
                    done.set()

            await nc.subscribe(subject, cb=on_message, pending_msgs_limit=n + 1, pending_bytes_limit=-1)
            await nc.flush()
        start = time.perf_counter()
        for _ in range(n):
            await nc.publish(subject, payload)
        await nc.flush()
        if cell == "consume":
            await done.wait()
        return n / (time.perf_counter() - start)
    finally:
        await nc.close()


def one(client: str, loop: str, cell: str, port: int, n: int) -> float:
    """One cell's rate in this process."""
    if client == "mqks gevent":
        return mqks_gevent_cell(cell, port, n)
    coroutine = mqks_aio_cell(cell, port, n) if client == "mqks.aio" else nats_cell(cell, port, n)
    if loop == "uvloop":
        import uvloop
        return uvloop.run(coroutine)
    import asyncio
    return asyncio.run(coroutine)


# --- the run: servers, interleaved reps, medians, ratios ---

def available(loop: str) -> bool:
    if loop != "uvloop":
        return True
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def measure(client: str, loop: str, cell: str, port: int, n: int, timeout: float) -> float:
    """One cell in a child process pinned to the client core."""
    cmd = ["taskset", "-c", str(CLIENT_CORE), sys.executable, "-m", "bench.clients", "--one", client, loop, cell,
           str(port), str(n)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          cwd=os.path.dirname(peers.BENCH_DIR))
    if done.returncode != 0:
        raise RuntimeError(f"{client} ({loop}) {cell} failed: {done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--cells", default=",".join(CELLS), help=f"a comma-separated subset of {','.join(CELLS)}")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--one", nargs=5, metavar=("CLIENT", "LOOP", "CELL", "PORT", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        client, loop, cell, port, n = args.one
        print(one(client, loop, cell, int(port), int(n)))
        return 0
    finder = peers.PeerFinder()
    finder.resolve(["nats-server"])
    log_dir = tempfile.mkdtemp(prefix="bench-clients-")
    mqks = peers.start_mqks(SERVER_CORE, log_dir)
    nats = peers.start_nats(finder.paths["nats-server"], SERVER_CORE, log_dir) if "nats-server" in finder.paths \
        else None
    runs: dict[tuple[str, str, str], list[float]] = {}
    try:
        for _ in range(args.reps):
            for cell in args.cells.split(","):
                for client, loop in CLIENTS:
                    if not available(loop) or (client == "nats-py" and (nats is None or cell in NO_PEER_CELL)):
                        continue
                    port = nats.port if client == "nats-py" and nats is not None else mqks.port
                    rate = measure(client, loop, cell, port, args.messages, args.timeout)
                    runs.setdefault((cell, client, loop), []).append(rate)
    finally:
        mqks.stop()
        if nats is not None:
            nats.stop()
    rows = [{"cell": cell, "client": client, "loop": loop, "median": statistics.median(rates), "min": min(rates),
             "max": max(rates), "runs": rates} for (cell, client, loop), rates in runs.items()]
    print(f"{args.messages:,} messages, 100-byte payloads, medians of {args.reps} (servers on core {SERVER_CORE}, "
          f"each client alone on core {CLIENT_CORE}); msg/s")
    print(f"{'cell':<10} {'client':<12} {'loop':<8} {'median':>10} {'range':>22}")
    for row in rows:
        print(f"{row['cell']:<10} {row['client']:<12} {row['loop']:<8} {row['median']:>10,.0f} "
              f"{row['min']:>10,.0f}..{row['max']:<10,.0f}")
    median = {(row["cell"], row["client"], row["loop"]): row["median"] for row in rows}
    ratios = []
    for cell in CELLS:
        for loop in ("asyncio", "uvloop"):
            mine, theirs = median.get((cell, "mqks.aio", loop)), median.get((cell, "nats-py", loop))
            if mine and theirs:
                ratios.append({"what": f"{cell}: mqks.aio / nats-py ({loop})", "ratio": mine / theirs})
        mine, gevent_rate = median.get((cell, "mqks.aio", "asyncio")), median.get((cell, "mqks gevent", "gevent"))
        if mine and gevent_rate:
            ratios.append({"what": f"{cell}: mqks.aio (asyncio) / mqks gevent client", "ratio": mine / gevent_rate})
    print()
    for ratio in ratios:
        print(f"{ratio['what']:<52} {ratio['ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"messages": args.messages, "reps": args.reps, "rows": rows, "ratios": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long a side client waits for a ping while other connections flood the broker.

    .venv/bin/python -m bench.fairness [--flooders 1] [--seconds 6] [--port 0]

Starts mqksd, lets `--flooders` connections pipeline `publish` lines flat out (nobody
consumes), and has one side connection ping in a loop, one ping in flight at a time.
Prints the side client's ping round trips (p50, p99, max) and how many lines the flood
got through, so a starving read loop shows up as a max close to the flood's length.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time

from .peers import free_port

# a process of its own per flooder: a thread would share the side client's GIL and be measured with it
FLOOD_SCRIPT = """
import socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
chunk = b"p publish nobody.listens x\\n" * 20_000
while True:
    sock.sendall(chunk)
"""


def start_broker(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "mqks.server", "--port", str(port), "--log-level", "warning"])
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("mqksd did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flooders", type=int, default=1, help="connections that flood (default 1)")
    parser.add_argument("--seconds", type=float, default=6.0, help="how long the flood lasts (default 6)")
    parser.add_argument("--port", type=int, default=0, help="use a running broker on this port instead")
    args = parser.parse_args()
    port = args.port or free_port()
    proc = None if args.port else start_broker(port)
    try:
        side = socket.create_connection(("127.0.0.1", port))
        side.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        flooders = [subprocess.Popen([sys.executable, "-c", FLOOD_SCRIPT, str(port)]) for _ in range(args.flooders)]
        waits = []
        end = time.monotonic() + args.seconds
        buffer = b""
        side.settimeout(max(0.1, end - time.monotonic()))
        while time.monotonic() < end:
            started = time.monotonic()
            side.sendall(b"pg ping\n")
            try:
                while b"\n" not in buffer:
                    buffer += side.recv(4096)
            except TimeoutError:
                waits.append(time.monotonic() - started)  # unanswered until the flood ended
                break
            buffer = buffer.partition(b"\n")[2]
            waits.append(time.monotonic() - started)
            time.sleep(0.001)
        for flooder in flooders:
            flooder.kill()
            flooder.wait()
        waits_ms = sorted(w * 1000 for w in waits)
        print(f"flooders={args.flooders} flood={args.seconds:.0f}s pings answered during it={len(waits)}")
        print(f"side ping wait ms: p50 {statistics.median(waits_ms):.2f}  "
              f"p99 {waits_ms[int(len(waits_ms) * 0.99) - 1]:.2f}  max {waits_ms[-1]:.2f}")
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()

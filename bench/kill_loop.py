"""kill -9 a durable broker again and again under confirmed load; count what was lost and duplicated.

    .venv/bin/python -m bench.kill_loop [--rounds 50] [--fsync always] [--per-round 2000]

Each round starts mqksd on the same data dir, runs a producer that pipelines `publish --confirm`
and a consumer that acks what it gets, waits until `--per-round` more publishes are confirmed,
then SIGKILLs the broker mid-flow. At the end it drains the queue and prints how many confirmed
messages never arrived (must be 0) and how many arrived more than once (acks not yet on disk at
the kill come back). CI runs the same check for 5 rounds (tests/e2e/test_durability.py).
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from .peers import free_port

READY_SECONDS = 30.0


class Line:
    """A blocking line connection."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buffer = b""

    def send(self, *lines: bytes) -> None:
        self.sock.sendall(b"".join(line + b"\n" for line in lines))

    def line(self) -> bytes:
        while b"\n" not in self.buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    def barrier(self) -> list[bytes]:
        self.send(b"bar ping")
        lines = []
        while (line := self.line()) != b"bar ok ":
            lines.append(line)
        return lines

    def close(self) -> None:
        self.sock.close()


def start(port: int, data_dir: str, fsync: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "mqks.server", "--port", str(port), "--data-dir", data_dir,
                             "--fsync", fsync, "--log-level", "warning"], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + READY_SECONDS
    while time.monotonic() < deadline:
        try:
            Line(port).close()
            return proc
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise SystemExit("mqksd did not start")


def produce(port: int, ids: itertools.count, stop: threading.Event, confirmed: set[bytes]) -> None:
    try:
        conn = Line(port)
        while not stop.is_set():
            batch = [b"p%d" % next(ids) for _ in range(50)]
            conn.send(*(b"%b publish --confirm kill.loop x" % rid for rid in batch))
            for _ in batch:
                rid, status = conn.line().split(b" ")[:2]
                if status == b"ok":
                    confirmed.add(rid)
    except (OSError, ConnectionError):
        pass  # killed mid-batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50, help="kills (default 50)")
    parser.add_argument("--fsync", default="always", choices=["always", "everysec", "no"])
    parser.add_argument("--per-round", type=int, default=2000, help="confirmed publishes before each kill")
    args = parser.parse_args()
    data_dir = tempfile.mkdtemp(prefix="mqks-kill-loop-")
    port = free_port()
    confirmed: set[bytes] = set()
    received: list[bytes] = []
    ids = itertools.count()
    try:
        proc = start(port, data_dir, args.fsync)
        setup = Line(port)
        setup.send(b"rb rebind --confirm kill.q kill.loop")
        assert setup.line() == b"rb ok "
        setup.close()
        for round_ in range(args.rounds):
            consumer = Line(port)
            consumer.send(b"c consume kill.q --manual-ack")
            stop = threading.Event()
            thread = threading.Thread(target=produce, args=(port, ids, stop, confirmed))
            thread.start()
            target = len(confirmed) + args.per_round
            while len(confirmed) < target:
                for line in consumer.barrier():
                    msg_id = line.split(b" ")[2]
                    received.append(msg_id)
                    consumer.send(b"a ack c " + msg_id)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            stop.set()
            thread.join(30)
            consumer.close()
            proc = start(port, data_dir, args.fsync)
            print(f"round {round_ + 1}: {len(confirmed)} confirmed so far", flush=True)
        consumer = Line(port)
        consumer.send(b"c consume kill.q")
        while more := consumer.barrier():
            received += [line.split(b" ")[2] for line in more]
        consumer.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    lost = confirmed - set(received)
    duplicates = len(received) - len(set(received))
    print(f"{args.rounds} kills, fsync {args.fsync}: {len(confirmed)} confirmed, {len(lost)} lost, "
          f"{duplicates} duplicates ({duplicates / max(1, len(received)):.1%} of deliveries)")
    sys.exit(1 if lost else 0)


if __name__ == "__main__":
    main()

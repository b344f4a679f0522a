"""Print the events a queue receives: the ten-line client for watching the pipeline's output.

    .venv/bin/python pipelines/print_events.py --port 25000 --queue stats.printer --events stats.events.counted
"""

import argparse
import socket

parser = argparse.ArgumentParser(description="Consume a queue and print each delivery.")
parser.add_argument("--host", default="127.0.0.1")
parser.add_argument("--port", type=int, default=25000)
parser.add_argument("--queue", default="stats.printer")
parser.add_argument("--events", default="stats.events.counted")
args = parser.parse_args()

sock = socket.create_connection((args.host, args.port))
# --add keeps the queue's other bindings; drop the queue when this printer goes away
sock.sendall(f"p1 consume {args.queue} --add {args.events} --delete-queue-when-unused\n".encode())
for line in sock.makefile("r", encoding="utf-8", errors="replace"):
    print(line.rstrip("\n"), flush=True)

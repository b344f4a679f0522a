"""Publish sample events to a running MQKS broker, for the example pipeline.

    .venv/bin/python pipelines/feeder.py --port 25000 --rate 200 --duration 60

Each message is `{prefix}.{n} publish {event} {json}` with an event drawn from --events
(weighted: the first is the most common) and data like {"n": 7, "user": "u3", "amount": 12.5}.
A plain socket, no dependencies: it ends with a ping, so every message was routed when it exits.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import time
import uuid


def main() -> None:
    parser = argparse.ArgumentParser(description="Publish sample events to MQKS.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=25000)
    parser.add_argument("--events", default="page.viewed user.signed_up order.created order.paid",
                        help="space-separated event names (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=200.0, help="messages per second (default: %(default)s)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds to run; 0 runs until Ctrl-C")
    parser.add_argument("--count", type=int, default=0, help="stop after this many messages (0: no limit)")
    args = parser.parse_args()

    events = args.events.split()
    weights = [1.0 / (i + 1) for i in range(len(events))]
    prefix = f"feed.{uuid.uuid4().hex[:6]}"
    sock = socket.create_connection((args.host, args.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    started = time.monotonic()
    sent = 0
    per_event = dict.fromkeys(events, 0)
    try:
        while True:
            elapsed = time.monotonic() - started
            if args.duration and elapsed >= args.duration:
                break
            due = int(elapsed * args.rate) + 1 - sent
            if args.count:
                due = min(due, args.count - sent)
                if due <= 0:
                    break
            lines = []
            for event in random.choices(events, weights, k=max(0, due)):
                data = {"n": sent, "user": f"u{random.randrange(100)}", "amount": round(random.uniform(1, 100), 2)}
                lines.append(f"{prefix}.{sent} publish {event} {json.dumps(data)}\n")
                per_event[event] += 1
                sent += 1
            if lines:
                sock.sendall("".join(lines).encode())
            time.sleep(0.05)
    except KeyboardInterrupt:
        pass
    # ping barrier: the server answers in order, so every publish before it was routed
    sock.sendall(b"feeder.done ping done\n")
    answer = b""
    while b"feeder.done ok" not in answer:
        chunk = sock.recv(65536)
        if not chunk:
            raise SystemExit("the broker closed the connection")
        answer += chunk
    errors = [line for line in answer.decode(errors="replace").splitlines() if " error " in line]
    sock.close()
    print(f"published {sent} messages in {time.monotonic() - started:.1f}s: {per_event}")
    for line in errors[:10]:
        print("server error:", line)
    if errors:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

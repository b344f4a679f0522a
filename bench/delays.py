"""Delayed publishes at scale: the broker's memory per waiting message, and how late deliveries are.

    .venv/bin/python -m bench.delays [--messages 1000000] [--spread-seconds 10] [--lead-seconds 8]

Starts mqksd, binds a queue, and publishes `--messages` lines of `publish --at=T` whose due
times are spread evenly over `--spread-seconds`, the first `--lead-seconds` after the start
(so that all are still waiting when the publishing ends). Then it reads the broker's RSS
(minus its RSS before) per waiting message, and a consumer in its own process records when
each delivery arrives: lateness = arrival - due time, reported as p50, p99 and max, and any
delivery that came early (it must be none).

Beside it, the same number of delayed jobs put into beanstalkd (`put 0 <delay> 60 <bytes>`,
whole seconds: its only delay unit), for the memory per waiting message as a ratio.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time

from .fairness import start_broker
from .peers import find_binary, free_port, start_beanstalkd

# the consumer is a process of its own: it must not share a GIL with the publisher
CONSUMER_SCRIPT = """
import json, socket, sys, time
port, count = int(sys.argv[1]), int(sys.argv[2])
sock = socket.create_connection(("127.0.0.1", port))
sock.sendall(b"c1 consume delayq delayed.event\\n")
lateness, early, buffer, seen = [], 0, b"", 0
while seen < count:
    chunk = sock.recv(1 << 20)
    now_ms = time.time() * 1000
    if not chunk:
        break
    lines = (buffer + chunk).split(b"\\n")
    buffer = lines.pop()
    for line in lines:
        due_ms = float(line.rsplit(b" ", 1)[1]) * 1000
        late = now_ms - due_ms
        if late < 0:
            early += 1
        lateness.append(late)
        seen += 1
lateness.sort()
pick = lambda q: lateness[min(len(lateness) - 1, int(q * len(lateness)))]
print(json.dumps({"received": seen, "early": early, "p50_ms": pick(0.5), "p99_ms": pick(0.99),
                  "max_ms": lateness[-1]}))
"""


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def ask(sock: socket.socket, line: bytes) -> bytes:
    sock.sendall(line + b"\n")
    answer = b""
    while not answer.endswith(b"\n"):
        answer += sock.recv(1 << 16)
    return answer


def beanstalkd_bytes_per_delayed_job(messages: int, spread_seconds: float, lead_seconds: float) -> float | None:
    """RSS per job of beanstalkd holding `messages` delayed jobs with the same bodies; None without beanstalkd."""
    path = find_binary("beanstalkd")
    if path is None:
        return None
    with tempfile.TemporaryDirectory() as log_dir:
        server = start_beanstalkd(path, None, log_dir)
        try:
            sock = socket.create_connection(("127.0.0.1", server.port))
            baseline = rss_bytes(server.pid)
            first_due = time.time() + lead_seconds
            step = spread_seconds / messages
            answered, buffer, batch = 0, b"", []

            def read_answers(down_to: int) -> None:
                nonlocal answered, buffer
                while answered < down_to:  # beanstalkd stops reading while its answers wait unread
                    buffer += sock.recv(1 << 20)
                    answered += buffer.count(b"\r\n")
                    buffer = buffer[buffer.rfind(b"\r\n") + 2 :]

            for i in range(messages):
                due = first_due + i * step
                body = b"%.3f" % due
                batch.append(b"put 0 %d 60 %d\r\n%b\r\n" % (int(due - time.time()) + 1, len(body), body))
                if len(batch) == 2000:
                    sock.sendall(b"".join(batch))
                    batch.clear()
                    read_answers(i + 1 - 20_000)
            sock.sendall(b"".join(batch))
            read_answers(messages)  # every put answered: all jobs are in
            return (rss_bytes(server.pid) - baseline) / messages
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--spread-seconds", type=float, default=10.0)
    parser.add_argument("--lead-seconds", type=float, default=8.0,
                        help="the first due time, after the start; publishing must end before it")
    args = parser.parse_args()
    port = free_port()
    proc = start_broker(port)
    try:
        control = socket.create_connection(("127.0.0.1", port))
        ask(control, b"r1 rebind --confirm delayq delayed.event")
        baseline = rss_bytes(proc.pid)
        consumer = subprocess.Popen([sys.executable, "-c", CONSUMER_SCRIPT, str(port), str(args.messages)],
                                    stdout=subprocess.PIPE, text=True)
        publisher = socket.create_connection(("127.0.0.1", port))
        first_due = time.time() + args.lead_seconds
        step = args.spread_seconds / args.messages
        started = time.monotonic()
        batch = []
        for i in range(args.messages):
            due = first_due + i * step
            at = b"%.3f" % due  # the same text in the flag and the body: lateness is measured from what was asked
            batch.append(b"m%d publish --at=%b delayed.event %b\n" % (i, at, at))
            if len(batch) == 2000:
                publisher.sendall(b"".join(batch))
                batch.clear()
        publisher.sendall(b"".join(batch))
        figures = json.loads(ask(publisher, b"s1 stats").split(b" ", 2)[2])
        published_seconds = time.monotonic() - started
        waiting = figures["delayed"]
        rss = rss_bytes(proc.pid)
        if time.time() >= first_due:
            print(f"warning: publishing took {published_seconds:.1f} s, past the first due time; "
                  f"raise --lead-seconds for a clean memory figure", file=sys.stderr)
        out, _ = consumer.communicate(timeout=args.lead_seconds + args.spread_seconds + 120)
        late = json.loads(out)
        mqks_per_message = (rss - baseline) / max(1, waiting)
        beanstalkd_per_job = beanstalkd_bytes_per_delayed_job(args.messages, args.spread_seconds, args.lead_seconds)
        print(json.dumps({
            "messages": args.messages, "publish_seconds": round(published_seconds, 2),
            "waiting_when_measured": waiting, "rss_baseline_mb": round(baseline / 2**20, 1),
            "rss_with_all_waiting_mb": round(rss / 2**20, 1),
            "rss_bytes_per_delayed_message": round(mqks_per_message, 1),
            "beanstalkd_rss_bytes_per_delayed_job": beanstalkd_per_job and round(beanstalkd_per_job, 1),
            "memory_ratio_mqks_to_beanstalkd": beanstalkd_per_job and round(mqks_per_message / beanstalkd_per_job, 2),
            "received": late["received"], "early": late["early"],
            "late_p50_ms": round(late["p50_ms"], 2), "late_p99_ms": round(late["p99_ms"], 2),
            "late_max_ms": round(late["max_ms"], 2)}, indent=1))
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()

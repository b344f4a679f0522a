"""CPU time per message of the broker's hot path, in process: dispatcher, actions, state, outbox.

    .venv/bin/python -m bench.hot_path [--messages 500000] [--reps 5]
    MQKS_PURE=1 .venv/bin/python -m bench.hot_path    # the plain sources where the install compiled them

No sockets and no second process: the lines a client would send go through `run_lines`
exactly as the connection hands them over, and the deliveries pile up in an outbox that is
emptied between batches. It reports the best of `--reps` runs in CPU nanoseconds per message
(process time, so another busy process on the machine moves it far less than a throughput
figure). Use it to compare two revisions on a machine that is not quiet; the end-to-end figures
beside Redis and NATS come from `bench.run`.
"""

from __future__ import annotations

import argparse
import time
from collections import deque

from mqks.server import build
from mqks.server.dispatch.actions import actions_for, handlers_for, run_lines
from mqks.server.dispatch.process import Process
from mqks.server.wire.outbox import Outbox

BATCH_LINES = 2000  # about what one 64 KiB read holds


class BenchSession:
    """The `Session` a connection would be, with an outbox nobody flushes."""

    def __init__(self, process: Process) -> None:
        self.peer = "bench"
        self.peer_is_loopback = True
        self.eval_enabled = False
        self.process = process
        self.publisher = process.publisher
        self.outbox = Outbox(process.pending, 1 << 40)
        self.consumers_by_id = self.outbox.consumers_by_id
        self.actions = actions_for(False, True)
        self.handlers = handlers_for(False, True)
        self.closed = False

    def write(self, data: bytes) -> None:
        self.outbox.write(data)

    def ok(self, rid: bytes, data: bytes = b"") -> None:
        self.outbox.write(b"%b ok %b\n" % (rid, data))

    def error(self, rid: bytes, reason: str, line: bytes) -> None:
        raise AssertionError(f"{rid!r}: {reason} ({line[:80]!r})")

    def close(self) -> None:
        self.closed = True


def run(workload: str, messages: int) -> float:
    """CPU ns per message of one run of `workload`."""
    process = Process()
    session = BenchSession(process)
    rejected: deque = deque()
    if workload == "queued":
        run_lines(session, [b"r1 rebind q1 e1"], rejected)
    else:
        flags = b" --manual-ack" if workload in ("manual-ack", "ack-each") else b""
        run_lines(session, [b"c1 consume q1 e1" + flags], rejected)
    body = b"x" * 64
    batches = []
    for start in range(0, messages, BATCH_LINES):
        lines = [b"m%d publish e1 %b" % (i, body) for i in range(start, min(messages, start + BATCH_LINES))]
        if workload == "manual-ack":
            lines.append(b"a ack c1 " + b" ".join(b"m%d" % i for i in range(start, min(messages, start + BATCH_LINES))))
        elif workload == "ack-each":  # what msg.ack() and nc users send: one ack line per message
            lines += [b"a ack c1 m%d" % i for i in range(start, min(messages, start + BATCH_LINES))]
        batches.append(lines)
    outbox = session.outbox
    pending = process.pending
    started = time.process_time()
    for lines in batches:
        run_lines(session, lines, rejected)
        outbox.out.clear()
        outbox.out_bytes = 0
        outbox.flush_pending = False
        pending.clear()
    return (time.process_time() - started) / messages * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=500_000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(f"hot path: {build.kind}")
    for workload in ("auto-ack", "manual-ack", "ack-each", "queued"):
        best = min(run(workload, args.messages) for _ in range(args.reps))
        print(f"{workload:>10}: {best:7.1f} ns/msg (best of {args.reps})")


if __name__ == "__main__":
    main()

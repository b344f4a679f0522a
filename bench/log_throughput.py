"""Write-ahead log throughput: frames and records per second through commit + poll.

    .venv/bin/python -m bench.log_throughput [--seconds 2] [--fsync always] [--dir DIR]

For 1, 64 and 1024 records of 110 bytes per frame, two ways: lock-step (commit one frame,
wait until poll() says it is durable, then the next: the latency of one write + fdatasync +
wake) and pipelined (commit while fewer than --in-flight-bytes are unsynced, as the broker's
back-pressure does, so the writer thread groups many frames per fdatasync). Only durable
commits count. The log goes to a temporary directory beside --dir, deleted afterwards.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time

from mqks.server.journal.log import Log

RECORD = b"P 1 q1 1 ok m1 event=user.1.created " + b"d" * 74  # 110 bytes, a publish record's shape


def run(data_dir: str, fsync: str, records_per_frame: int, seconds: float, in_flight_bytes: int) -> dict:
    """Commit frames for `seconds`; the durable frames per second and the fsyncs it took."""
    wake = threading.Event()
    log = Log(data_dir, fsync=fsync, wake=wake.set)
    append, commit, poll = log.append, log.commit, log.poll
    batch = [RECORD] * records_per_frame
    started = time.perf_counter()
    deadline = started + seconds
    last = durable = 0
    while time.perf_counter() < deadline:
        while log.unsynced_bytes < in_flight_bytes:
            for record in batch:
                append(record)
            last = commit() or last
        wake.wait(1.0)
        wake.clear()
        durable, _ = poll()
    while durable < last:  # drain: every committed frame counts once durable
        wake.wait(1.0)
        wake.clear()
        durable, _ = poll()
    elapsed = time.perf_counter() - started
    stats = log.stats()
    log.close()
    return {"frames_per_second": durable / elapsed, "records_per_second": durable * records_per_frame / elapsed,
            "frames_per_fsync": durable / max(1, stats["fsyncs"]), "fsync_ms_p50": stats["fsync_ms_p50"],
            "fsync_ms_p99": stats["fsync_ms_p99"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--fsync", default="always", choices=["always", "everysec", "no"])
    parser.add_argument("--dir", default=None, help="where the temporary log goes (default: the system's temp dir)")
    parser.add_argument("--in-flight-bytes", type=int, default=8 << 20)
    args = parser.parse_args()
    print(f"fsync={args.fsync}, {len(RECORD)}-byte records, {args.seconds:g} s per row")
    print(f"{'mode':<10} {'records/frame':>13} {'frames/s':>12} {'records/s':>12} {'frames/fsync':>12} "
          f"{'fsync p50 ms':>12} {'p99 ms':>8}")
    for mode, in_flight in (("lock-step", 1), ("pipelined", args.in_flight_bytes)):
        for records_per_frame in (1, 64, 1024):
            data_dir = tempfile.mkdtemp(prefix="mqks-log-bench-", dir=args.dir)
            try:
                r = run(data_dir, args.fsync, records_per_frame, args.seconds, in_flight)
            finally:
                shutil.rmtree(data_dir)
            print(f"{mode:<10} {records_per_frame:>13} {r['frames_per_second']:>12,.0f} "
                  f"{r['records_per_second']:>12,.0f} {r['frames_per_fsync']:>12.1f} "
                  f"{r['fsync_ms_p50']:>12.3f} {r['fsync_ms_p99']:>8.3f}")


if __name__ == "__main__":
    main()

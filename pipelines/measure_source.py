"""Rows/s through the `mqks` source into Spark's `noop` sink, beside Spark's built-in `rate` source.

    .venv/bin/python pipelines/measure_source.py --port 25000 --messages 200000

mqks: publishes --messages messages of --data-bytes bytes into a fresh queue, then streams them
into `noop` with maxRecordsPerBatch=--max-records-per-batch until all were read and acked.
rate: `rate` (rowsPerSecond=--rate-rows-per-second) into `noop` for --rate-seconds.
Both figures are rows / sum of triggerExecution over the batches after the first one that had rows
(the first pays for starting the Python workers), on the same local[2] session.
"""

from __future__ import annotations

import argparse
import time
import uuid


def steady_rows_per_second(progress: list[dict]) -> tuple[float, int, int]:
    """(rows/s, rows, batches) over the batches with rows, the first one excluded."""
    with_rows = [p for p in progress if p["numInputRows"]]
    steady = with_rows[1:] or with_rows
    rows = sum(p["numInputRows"] for p in steady)
    millis = sum(p["durationMs"]["triggerExecution"] for p in steady)
    return (rows * 1000.0 / millis if millis else 0.0), rows, len(steady)


def publish(host: str, port: int, event: str, count: int, data_bytes: int) -> float:
    """Publish `count` messages; returns seconds until the server had routed them all."""
    from mqks.spark.line_client import LineClient

    client = LineClient(host, port)
    payload = ("x" * data_bytes).encode()
    started = time.monotonic()
    for lo in range(0, count, 10_000):
        client.send([b"m%d publish %s %s" % (i, event.encode(), payload) for i in range(lo, min(count, lo + 10_000))])
    client.send([b"measure.done ping done"])
    while not any(line.startswith(b"measure.done ok") for line in client.read_lines(30.0)):
        pass
    client.close()
    return time.monotonic() - started


def ask(host: str, port: int, line: str) -> bytes:
    from mqks.spark.line_client import LineClient

    client = LineClient(host, port)
    try:
        client.send([line.encode()])
        return client.read_lines(10.0)[0]
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="Measure rows/s: mqks source vs rate source, into noop.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=25000)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--data-bytes", type=int, default=100)
    parser.add_argument("--max-records-per-batch", type=int, default=20_000)
    parser.add_argument("--num-partitions", type=int, default=2)
    parser.add_argument("--rate-rows-per-second", type=int, default=500_000)
    parser.add_argument("--rate-seconds", type=float, default=30.0)
    args = parser.parse_args()

    from mqks.spark.session import local_session

    spark = local_session("mqks-measure")

    queue = f"measure.{uuid.uuid4().hex[:8]}"
    event = f"{queue}.e"
    answer = ask(args.host, args.port, f"bind rebind --confirm {queue} {event}")
    assert answer.startswith(b"bind ok"), answer
    seconds = publish(args.host, args.port, event, args.messages, args.data_bytes)
    print(f"published {args.messages} x {args.data_bytes} B in {seconds:.1f}s", flush=True)

    stream = (
        spark.readStream.format("mqks")
        .option("host", args.host)
        .option("port", str(args.port))
        .option("queue", queue)
        .option("maxRecordsPerBatch", str(args.max_records_per_batch))
        .option("numPartitions", str(args.num_partitions))
        .option("idleAckSeconds", "1")
        .load()
    )
    query = stream.writeStream.format("noop").start()
    started = time.monotonic()
    while sum(p["numInputRows"] for p in query.recentProgress) < args.messages:
        if time.monotonic() - started > 600:
            raise SystemExit("mqks source: timed out")
        time.sleep(0.5)
    wall = time.monotonic() - started
    progress = query.recentProgress
    query.stop()
    mqks_rate, rows, batches = steady_rows_per_second(progress)
    print(f"mqks -> noop: {mqks_rate:,.0f} rows/s steady ({rows} rows in {batches} batches); "
          f"{args.messages / wall:,.0f} rows/s wall clock including query start", flush=True)
    ask(args.host, args.port, f"dq delete_queue --confirm {queue}")

    rate = spark.readStream.format("rate").option("rowsPerSecond", str(args.rate_rows_per_second)).load()
    query = rate.writeStream.format("noop").start()
    time.sleep(args.rate_seconds)
    progress = query.recentProgress
    query.stop()
    rate_rate, rows, batches = steady_rows_per_second(progress)
    print(f"rate -> noop: {rate_rate:,.0f} rows/s steady ({rows} rows in {batches} batches; "
          f"rowsPerSecond={args.rate_rows_per_second})", flush=True)
    spark.stop()


if __name__ == "__main__":
    main()

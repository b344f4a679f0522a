"""Example pipeline: count events per name over tumbling windows, publish the counts back to MQKS.

    .venv/bin/python pipelines/event_counts.py --port 25000                       # local[2]
    spark-submit --master spark://host:7077 pipelines/event_counts.py --host broker --port 25000

It reads the queue --queue (bound to --events, added to its existing bindings) with the `mqks`
source, groups by `window(received_at, --window)` and `event` with a --watermark, and publishes
one `stats.events.counted` event per finished window and event, with data like
{"window_start": "...", "window_end": "...", "event": "page.viewed", "count": 42}.
With --parquet DIR it also appends the counts to Parquet. At-least-once end to end: a restart
from the same --checkpoint can count a message twice (see the README).

The watermark advances while no events come: the driver publishes a heartbeat event into its own
queue every --heartbeat-seconds, whose `received_at` moves the watermark on; heartbeats are dropped
after the watermark and never counted. So the last window is published about --watermark plus a
trigger after its end, even when the events stop.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Windowed event counts from an MQKS queue, published back as events.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=25000)
    parser.add_argument("--queue", default="pipeline.events", help="queue to read (default: %(default)s)")
    parser.add_argument("--events", default="page.* user.* order.*",
                        help="events or masks the queue gets, added to its bindings (default: %(default)s)")
    parser.add_argument("--out-event", default="stats.events.counted", help="event of the published counts")
    parser.add_argument("--window", default="10 seconds", help="tumbling window (default: %(default)s)")
    parser.add_argument("--watermark", default="5 seconds", help="lateness accepted (default: %(default)s)")
    parser.add_argument("--output-mode", choices=["append", "update"], default="append",
                        help="append: one final count per window; update: a running count every batch")
    parser.add_argument("--trigger", default="2 seconds", help="micro-batch interval (default: %(default)s)")
    parser.add_argument("--max-records-per-batch", type=int, default=50_000)
    parser.add_argument("--heartbeat-seconds", type=float, default=1.0,
                        help="how often the watermark is moved on while no events come (0: never)")
    parser.add_argument("--checkpoint", default="checkpoints/event-counts",
                        help="Spark checkpoint dir; reuse it to resume (default: %(default)s)")
    parser.add_argument("--parquet", default=None, help="also append the counts to Parquet files in this dir")
    parser.add_argument("--master", default=None,
                        help="Spark master when run with plain python (default: local[2]; spark-submit sets its own)")
    parser.add_argument("--run-seconds", type=float, default=0, help="stop after this long (0: until Ctrl-C)")
    return parser.parse_args(argv)


def build_session(master: str | None):
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("mqks-event-counts").config("spark.sql.shuffle.partitions", "2")
    if master:
        builder = builder.master(master)
    elif "PYSPARK_GATEWAY_PORT" not in os.environ:  # plain python, not spark-submit: run locally
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = builder.master("local[2]").config("spark.ui.enabled", "false")
    return builder.getOrCreate()


def bind_queue(host: str, port: int, queue: str, events: str) -> None:
    """Create the queue and add its bindings now: events published while Spark starts are kept."""
    from mqks.spark.line_client import LineClient, MqksError, split_answer

    client = LineClient(host, port)
    try:
        client.send([f"bind rebind --confirm {queue} --add {events}".encode()])
        answers: list[bytes] = []
        while not answers:
            answers = client.read_lines(10.0) or [b"bind error - no answer within 10s"]
        _, status, data = split_answer(answers[0])
        if status != b"ok":
            raise MqksError(f"cannot bind {queue} to {events}: {data.decode(errors='replace')}")
    finally:
        client.close()


def heartbeat_event(queue: str) -> str:
    return f"event_counts.heartbeat.{queue}"


def send_heartbeats(host: str, port: int, queue: str, seconds: float, stop: threading.Event) -> None:
    """Publish a heartbeat into the pipeline's queue every `seconds` until `stop`; a lost broker is retried."""
    from mqks.spark.line_client import LineClient

    event = heartbeat_event(queue).encode()
    client: LineClient | None = None
    beat = 0
    while not stop.wait(seconds):
        try:
            if client is None:
                client = LineClient(host, port)
            beat += 1
            client.send([b"hb.%d publish %b {}" % (beat, event)])
            client.read_lines(0.0)  # nothing is answered; drop anything unexpected
        except OSError:
            if client is not None:
                client.close()
            client = None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    heartbeat = heartbeat_event(args.queue)
    bind_queue(args.host, args.port, args.queue, f"{args.events} {heartbeat}")
    spark = build_session(args.master)
    spark.sparkContext.setLogLevel("WARN")
    from pyspark.sql import functions as F

    from mqks.spark import MqksDataSource

    spark.dataSource.register(MqksDataSource)

    events = (
        spark.readStream.format("mqks")
        .option("host", args.host)
        .option("port", str(args.port))
        .option("queue", args.queue)
        .option("events", args.events)
        .option("maxRecordsPerBatch", str(args.max_records_per_batch))
        .load()
    )
    counts = (
        events.withWatermark("received_at", args.watermark)
        # heartbeats have moved the watermark and go no further; the test of received_at keeps Spark
        # from pushing this filter below the watermark (it pushes filters that do not read the event time)
        .where((F.col("event") != heartbeat) | F.col("received_at").isNull())
        .groupBy(F.window("received_at", args.window).alias("window"), "event")
        .count()
        .select(
            F.col("window.start").alias("window_start"),
            F.col("window.end").alias("window_end"),
            "event",
            "count",
        )
    )
    as_events = counts.select(F.lit(args.out_event).alias("event"), counts_as_json())
    if args.parquet is None and args.output_mode == "append":
        query = (
            as_events.writeStream.format("mqks")
            .outputMode("append")
            .trigger(processingTime=args.trigger)
            .option("checkpointLocation", args.checkpoint)
            .option("host", args.host)
            .option("port", str(args.port))
            .start()
        )
    else:
        # Parquet, or update mode (which Python data source sinks do not take): one foreachBatch does both
        query = (
            counts.writeStream.foreachBatch(publish_and_store(args))
            .outputMode(args.output_mode)
            .trigger(processingTime=args.trigger)
            .option("checkpointLocation", args.checkpoint)
            .start()
        )

    print(f"event-counts: query {query.id} reads {args.queue} ({args.events}), publishes {args.out_event}", flush=True)
    stop_heartbeats = threading.Event()
    if args.heartbeat_seconds > 0:
        threading.Thread(target=send_heartbeats, args=(args.host, args.port, args.queue, args.heartbeat_seconds,
                                                       stop_heartbeats), daemon=True).start()
    started = time.monotonic()
    last_batch = -1
    try:
        while query.isActive:
            if args.run_seconds and time.monotonic() - started > args.run_seconds:
                break
            query.awaitTermination(2)
            for progress in query.recentProgress:
                if progress["batchId"] > last_batch:
                    last_batch = progress["batchId"]
                    if progress["numInputRows"]:
                        print(f"batch {last_batch}: {progress['numInputRows']} events in", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        stop_heartbeats.set()
        query.stop()
        spark.stop()


def counts_as_json():
    """The `data` column of a published count: {"window_start", "window_end", "event", "count"}."""
    from pyspark.sql import functions as F

    return F.to_json(F.struct("window_start", "window_end", "event", "count")).alias("data")


def publish_and_store(args: argparse.Namespace):
    """foreachBatch: publish the counts as events and, with --parquet, append them to Parquet."""
    from pyspark.sql import functions as F

    def write(batch, batch_id: int) -> None:
        query_id = batch.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId") or "counts"
        batch.persist()
        try:
            (
                batch.select(F.lit(args.out_event).alias("event"), counts_as_json())
                .write.format("mqks")
                .mode("append")
                .option("host", args.host)
                .option("port", str(args.port))
                .option("msgIdPrefix", f"{query_id[:8]}.{batch_id}")  # as the stream sink builds them
                .save()
            )
            if args.parquet is not None:
                batch.write.mode("append").parquet(args.parquet)
        finally:
            batch.unpersist()

    return write


if __name__ == "__main__":
    main()

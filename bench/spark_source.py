"""The `mqks` Spark source and sink beside Spark's own paths, on local-cluster with 1 and 2 executors.

    .venv/bin/python -m bench.spark_source [--messages 400000] [--executors 1,2] [--data-bytes 100]

Source: --messages messages of --data-bytes bytes wait in a queue; one Trigger.AvailableNow run
reads them into the `noop` sink (numPartitions = executors). Beside it, an in-memory Python
data source (the same seven columns built from Python lists in read(), no network) on the same
session and shape. Rows/s = rows / the summed triggerExecution of the batches with rows. The
driver's CPU per row is the CPU the driver JVM and its own Python workers used (executors and
the broker excluded), over the rows. Sink: `df.write.format("mqks")` of the same number of rows
beside `df.write.format("noop")`. Wrap it in `flock /work/bench.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="utf-8") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


def driver_cpu(driver_jvm: int) -> float:
    """CPU of the driver JVM and its Python workers; executor JVMs (other java processes) excluded."""
    total, stack = 0.0, [driver_jvm]
    while stack:
        pid = stack.pop()
        try:
            total += cpu_seconds(pid)
        except OSError:
            continue
        stack += [child for child in children(pid) if comm(child) != "java"]
    return total


def memory_source_class():
    from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
    from pyspark.sql.streaming.datasource import ReadMaxRows, SupportsTriggerAvailableNow

    from mqks.spark.source import SOURCE_SCHEMA

    class Part(InputPartition):
        def __init__(self, rows: int, data_bytes: int) -> None:
            super().__init__(None)
            self.rows, self.data_bytes = rows, data_bytes

    class Reader(DataSourceStreamReader, SupportsTriggerAvailableNow):
        def __init__(self, options) -> None:
            self.total = int(options["rows"])
            self.parts = int(options["parts"])
            self.batch_rows = int(options["batchRows"])
            self.data_bytes = int(options["dataBytes"])

        def initialOffset(self):
            return {"rows": 0}

        def getDefaultReadLimit(self):
            return ReadMaxRows(self.batch_rows)

        def prepareForTriggerAvailableNow(self) -> None:
            pass

        def latestOffset(self, start, limit):
            return {"rows": min(self.total, start["rows"] + self.batch_rows)}

        def partitions(self, start, end):
            rows = end["rows"] - start["rows"]
            return [Part(rows // self.parts + (1 if i < rows % self.parts else 0), self.data_bytes)
                    for i in range(self.parts)]

        def read(self, partition):
            import pyarrow as pa

            from mqks.spark.source import FETCH_ROWS

            left = partition.rows
            while left > 0:
                n = min(left, FETCH_ROWS)
                payload = b"x" * partition.data_bytes
                now_us = int(time.time() * 1_000_000)
                yield pa.RecordBatch.from_arrays([
                    pa.array([b"m%d" % i for i in range(n)], type=pa.string()),
                    pa.array([b"bench.e"] * n, type=pa.string()),
                    pa.array([payload] * n, type=pa.string()),
                    pa.array([0] * n, type=pa.int32()),
                    pa.array(["bench.q"] * n, type=pa.string()),
                    pa.array([now_us] * n, type=pa.timestamp("us", tz="UTC")),
                    pa.array(list(range(n)), type=pa.int64()),
                ], names=["msg_id", "event", "data", "retry", "queue", "received_at", "seq"])
                left -= n

    class MemorySource(DataSource):
        @classmethod
        def name(cls) -> str:
            return "memorybench"

        def schema(self) -> str:
            return SOURCE_SCHEMA

        def streamReader(self, schema):
            return Reader(self.options)

    return MemorySource


def steady_rate(progress: list[dict]) -> tuple[float, int]:
    with_rows = [p for p in progress if p["numInputRows"]]
    rows = sum(p["numInputRows"] for p in with_rows)
    millis = sum(p["durationMs"]["triggerExecution"] for p in with_rows)
    return (rows * 1000.0 / millis if millis else 0.0), rows


def publish(port: int, queue: str, count: int, data_bytes: int) -> None:
    from mqks.spark.line_client import LineClient

    client = LineClient("127.0.0.1", port)
    client.send([b"b rebind --confirm %s bench.e" % queue.encode()])
    payload = b"x" * data_bytes
    for lo in range(0, count, 10_000):
        client.send([b"m%d publish bench.e %s" % (i, payload) for i in range(lo, min(count, lo + 10_000))])
    client.send([b"done ping done"])
    while not any(line.startswith(b"done ok") for line in client.read_lines(60.0)):
        pass
    client.close()


def warm_up(spark, port: int, executors: int, args: argparse.Namespace) -> None:
    """One small run of each source first: the first batch of a session pays for starting Python workers."""
    queue = f"bench.warm.{executors}"
    publish(port, queue, 20_000, args.data_bytes)
    for reader in (spark.readStream.format("mqks").option("port", str(port)).option("queue", queue)
                   .option("numPartitions", str(executors)),
                   spark.readStream.format("memorybench").option("rows", "20000").option("parts", str(executors))
                   .option("batchRows", "5000").option("dataBytes", str(args.data_bytes))):
        reader.load().writeStream.format("noop").trigger(availableNow=True).start().awaitTermination()


def run(executors: int, args: argparse.Namespace, port: int) -> dict:
    from mqks.spark.session import local_session

    spark = local_session(f"bench-{executors}", master=f"local-cluster[{executors},1,1024]")
    spark.dataSource.register(memory_source_class())
    driver_jvm = spark.sparkContext._gateway.proc.pid  # type: ignore[union-attr]
    result: dict = {"executors": executors}
    try:
        warm_up(spark, port, executors, args)
        for rep in range(args.reps):
            queue = f"bench.q.{executors}.{rep}"
            publish(port, queue, args.messages, args.data_bytes)
            cpu_before = driver_cpu(driver_jvm)
            query = (spark.readStream.format("mqks").option("port", str(port)).option("queue", queue)
                     .option("maxRecordsPerBatch", str(args.batch_rows)).option("numPartitions", str(executors))
                     .load().writeStream.format("noop").trigger(availableNow=True).start())
            query.awaitTermination()
            rate, rows = steady_rate(query.recentProgress)
            cpu = driver_cpu(driver_jvm) - cpu_before
            memory = (spark.readStream.format("memorybench").option("rows", str(args.messages))
                      .option("parts", str(executors)).option("batchRows", str(args.batch_rows))
                      .option("dataBytes", str(args.data_bytes)).load()
                      .writeStream.format("noop").trigger(availableNow=True).start())
            memory.awaitTermination()
            memory_rate, memory_rows = steady_rate(memory.recentProgress)
            result.setdefault("memory_driver_cpu_us_per_row", []).append(
                (driver_cpu(driver_jvm) - cpu_before - cpu) * 1e6 / max(memory_rows, 1))
            result.setdefault("mqks_rows_per_s", []).append(rate)
            result.setdefault("memory_rows_per_s", []).append(memory_rate)
            result.setdefault("driver_cpu_us_per_row", []).append(cpu * 1e6 / max(rows, 1))
            assert rows == args.messages, f"read {rows} of {args.messages}"
        df = spark.range(args.messages).selectExpr("'bench.out' AS event", f"repeat('x', {args.data_bytes}) AS data")
        df = df.repartition(executors).cache()
        df.count()
        for fmt in ("noop", "mqks"):
            started = time.monotonic()
            df.write.format(fmt).mode("append").option("port", str(port)).save() if fmt == "mqks" else \
                df.write.format(fmt).mode("append").save()
            result[f"sink_{fmt}_rows_per_s"] = args.messages / (time.monotonic() - started)
    finally:
        spark.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=400_000)
    parser.add_argument("--data-bytes", type=int, default=100)
    parser.add_argument("--batch-rows", type=int, default=50_000)
    parser.add_argument("--executors", default="1,2")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from helpers import free_port

    port = free_port()
    broker = subprocess.Popen([sys.executable, "-m", "mqks.server", "--port", str(port)], stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        results = [run(int(n), args, port) for n in args.executors.split(",")]
    finally:
        broker.kill()
        broker.wait()
    best = {r["executors"]: r for r in results}
    for r in results:
        mq, mem = max(r["mqks_rows_per_s"]), max(r["memory_rows_per_s"])
        print(f"{r['executors']} executor(s): mqks {mq:,.0f} rows/s, in-memory Python source {mem:,.0f} rows/s, "
              f"ratio {mq / mem:.2f}x; driver CPU {min(r['driver_cpu_us_per_row']):.2f} us/row "
              f"(in-memory source: {min(r['memory_driver_cpu_us_per_row']):.2f}); "
              f"sink: mqks {r['sink_mqks_rows_per_s']:,.0f} rows/s, noop {r['sink_noop_rows_per_s']:,.0f} rows/s "
              f"({r['sink_mqks_rows_per_s'] / r['sink_noop_rows_per_s']:.2f}x)")
    if 1 in best and 2 in best:
        print(f"2 executors / 1: mqks {max(best[2]['mqks_rows_per_s']) / max(best[1]['mqks_rows_per_s']):.2f}x, "
              f"in-memory {max(best[2]['memory_rows_per_s']) / max(best[1]['memory_rows_per_s']):.2f}x "
              f"({os.cpu_count()} cores)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""The `mqks` Spark source and sink, each beside a Python data source that does no I/O, in one Spark session.

    .venv/bin/python -m bench.spark_source [--source-batches 12] [--sink-rows 200000] [--batch-rows 50000,10000]
                                           [--rounds 5] [--master local[2]] [--partitions 2] [--pure]

Source cell, per batch size: --source-batches x --batch-rows messages (or --messages) of --data-bytes
bytes wait in a queue; one Trigger.AvailableNow run reads them into Spark's `noop` sink in batches of
--batch-rows rows (numPartitions = --partitions). Its ceiling, run right after it on the same session
and shape: a Python stream reader whose read() yields the same seven columns from memory as Arrow
record batches (built by Arrow kernels, no network). Rows/s = rows / the summed triggerExecution of the
batches with rows; "steady" = batch rows / the median triggerExecution of the full batches (one slow
batch, another process's burst on a shared machine, moves the sum and not the median). A cell is a new
query: the JVM compiles its generated code over its first batches (the JIT's threads took ~1.7 us a row,
as much as everything else, in a 4-batch cell), so a cell of a few batches measures that more than the
source; 12 batches bring it to ~0.4 us a row.

Sink cell: `df.write.format("mqks")` of --sink-rows rows (a cached DataFrame of `event` and `data`,
one queue bound to the event) beside a Python `DataSourceWriter` that iterates its rows and drops
them (the ceiling), a `DataSourceArrowWriter` that drops its record batches, and Spark's JVM `noop`.
Rows/s = rows / the wall time of `save()`. Two more cells bound the sink from below and above, in the same
round: `floor`, the broker alone confirming the sink's lines (the same `{id} publish --confirm bench.out
{data}`, one raw socket per partition, the sink's window, no Spark), and `floor_quiet`, the same with
`publish --confirm-quiet` and one `sync` a socket (one answer a task); `mqks_each`, the sink with
`quietConfirms=false` (an `ok` a row, as before quiet confirms); and `mqks-unconfirmed`, the sink's own
path with plain `publish` lines and one `ping` at the end of a task (not at-least-once: an unconfirmed
publish past a queue's --max-length is dropped, not refused): what a broker that confirmed a run of
publishes with one answer would give.

Every round runs every cell once, in turn (each round reverses the order of the one before); the
ratios are taken inside a round, and the report gives each one's median over the rounds. One round
runs first and is not reported: the first full-size run of a shape pays for the JIT and the
broker's heap. The driver's CPU per row (the driver JVM and its Python workers, executors and the
broker excluded) goes with each source cell. The broker says whether it runs compiled or as plain
Python (an edited module runs as plain Python until the next install): compare runs of one kind,
or pass --pure to both. Wrap it in `flock /work/bench.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MEMORY_BATCH_ROWS = 10_000  # Spark's own Arrow batch (spark.sql.execution.arrow.maxRecordsPerBatch)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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
    """`memorybench`: the source's seven columns from memory as Arrow record batches, no network."""
    from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
    from pyspark.sql.streaming.datasource import ReadMaxRows, SupportsTriggerAvailableNow

    from mqks.spark.source import SOURCE_SCHEMA

    class Part(InputPartition):
        def __init__(self, first: int, rows: int, data_bytes: int) -> None:
            super().__init__(None)
            self.first, self.rows, self.data_bytes = first, rows, data_bytes

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
            rows, first, parts = end["rows"] - start["rows"], start["rows"], []
            for i in range(self.parts):
                count = rows // self.parts + (1 if i < rows % self.parts else 0)
                parts.append(Part(first, count, self.data_bytes))
                first += count
            return parts

        def read(self, partition):
            import pyarrow as pa
            import pyarrow.compute as pc

            payload = pa.scalar("x" * partition.data_bytes)
            done = 0
            while done < partition.rows:
                n = min(partition.rows - done, MEMORY_BATCH_ROWS)
                seq = pa.array(range(partition.first + done, partition.first + done + n), type=pa.int64())
                now_us = int(time.time() * 1_000_000)
                yield pa.RecordBatch.from_arrays([
                    pc.binary_join_element_wise("m", pc.cast(seq, pa.string()), ""),
                    pa.repeat(pa.scalar("bench.e"), n),
                    pa.repeat(payload, n),
                    pa.repeat(pa.scalar(0, pa.int32()), n),
                    pa.repeat(pa.scalar("bench.q"), n),
                    pa.repeat(pa.scalar(now_us, pa.timestamp("us", tz="UTC")), n),
                    seq,
                ], names=["msg_id", "event", "data", "retry", "queue", "received_at", "seq"])
                done += n

    class MemorySource(DataSource):
        @classmethod
        def name(cls) -> str:
            return "memorybench"

        def schema(self) -> str:
            return SOURCE_SCHEMA

        def streamReader(self, schema):
            return Reader(self.options)

    return MemorySource


def null_sink_classes():
    """`nullrows` (a Python DataSourceWriter that drops its rows) and `nullarrow` (the same over Arrow batches)."""
    from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, DataSourceWriter, WriterCommitMessage

    class Dropped(WriterCommitMessage):
        def __init__(self, count: int) -> None:
            self.count = count

    class RowWriter(DataSourceWriter):
        def write(self, iterator):
            count = 0
            for _ in iterator:
                count += 1
            return Dropped(count)

    class ArrowWriter(DataSourceArrowWriter):
        def write(self, iterator):
            return Dropped(sum(batch.num_rows for batch in iterator))

    class NullRows(DataSource):
        @classmethod
        def name(cls) -> str:
            return "nullrows"

        def writer(self, schema, overwrite):
            return RowWriter()

    class NullArrow(DataSource):
        @classmethod
        def name(cls) -> str:
            return "nullarrow"

        def writer(self, schema, overwrite):
            return ArrowWriter()

    return NullRows, NullArrow


def unconfirmed_sink_class():
    """`mqksunconfirmed`: the sink's lines without `--confirm`, one `ping` per task for all (a bound, not a sink)."""
    from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage

    class Sent(WriterCommitMessage):
        def __init__(self, count: int) -> None:
            self.count = count

    class Writer(DataSourceArrowWriter):
        def __init__(self, port: int) -> None:
            self.port = port

        def write(self, iterator):
            import pyarrow.compute as pc
            from pyspark import TaskContext

            from mqks.spark.line_client import LineClient

            client, count = None, 0
            context = TaskContext.get()
            prefix = f"u.{context.partitionId() if context is not None else 0}."
            try:
                for batch in iterator:
                    ids = pc.binary_join_element_wise(prefix, pc.cast(pc.add(pc.cast(pa_range(batch.num_rows),
                                                                                     "int64"), count), "string"), "")
                    lines = pc.binary_join_element_wise(ids, " publish ", batch.column(0), " ", batch.column(1),
                                                        "\n", "")
                    client = client or LineClient("127.0.0.1", self.port)
                    _, offsets, values = lines.buffers()  # a fresh array: its lines start at byte 0
                    client.send_block(memoryview(values)[: memoryview(offsets).cast("i")[len(lines)]])
                    count += batch.num_rows
                if client is not None:
                    client.send([b"u.done ping done"])
                    while not any(line.startswith(b"u.done ok") for line in client.read_lines(60.0)):
                        pass
            finally:
                if client is not None:
                    client.close()
            return Sent(count)

    def pa_range(count: int):
        import pyarrow as pa

        return pa.array(range(count))

    class Unconfirmed(DataSource):
        @classmethod
        def name(cls) -> str:
            return "mqksunconfirmed"

        def writer(self, schema, overwrite):
            return Writer(int(self.options["port"]))

    return Unconfirmed


def floor_rate(port: int, rows: int, connections: int, window: int, data_bytes: int, round_no: int,
               quiet: bool = False) -> float:
    """Rows/s the broker confirms of the sink's lines from `connections` raw sockets at the sink's window; `quiet`:
    `publish --confirm-quiet` lines with no window, then one `sync` each (answered once every one is stored)."""
    step = max(1, window // 2)  # the sink sends slices of half its window
    payload = b"x" * data_bytes
    per_connection = rows // connections
    verb = b"--confirm-quiet" if quiet else b"--confirm"
    blocks = [[b"".join(b"f%d.%d.%d publish %b bench.out %b\n" % (round_no, part, i, verb, payload)
                        for i in range(lo, min(per_connection, lo + step)))
               for lo in range(0, per_connection, step)] for part in range(connections)]
    ready = threading.Barrier(connections + 1)

    def send(part: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ready.wait()
            sent = confirmed = 0
            if quiet:
                sock.sendall(b"".join(blocks[part]) + b"s sync\n")
                answer = b""
                while not answer.endswith(b"\n"):
                    answer += sock.recv(1 << 20)
                assert answer == b"s ok \n", answer[:200]  # no refusal came before it
                return
            for block in blocks[part]:
                while sent - confirmed + step > window:
                    confirmed += sock.recv(1 << 20).count(b"\n")
                sock.sendall(block)
                sent += block.count(b"\n")
            while confirmed < sent:
                confirmed += sock.recv(1 << 20).count(b"\n")

    threads = [threading.Thread(target=send, args=(part,)) for part in range(connections)]
    for thread in threads:
        thread.start()
    ready.wait()
    started = time.monotonic()
    for thread in threads:
        thread.join()
    return per_connection * connections / (time.monotonic() - started)


def phases_ms(progress: list[dict]) -> dict[str, int]:
    """Spark's durationMs of the batches with rows, summed per phase (addBatch holds the tasks)."""
    summed: dict[str, int] = {}
    for p in progress:
        if p["numInputRows"]:
            for phase, millis in p["durationMs"].items():
                summed[phase] = summed.get(phase, 0) + millis
    return summed


def steady_rate(progress: list[dict]) -> tuple[float, int]:
    with_rows = [p for p in progress if p["numInputRows"]]
    rows = sum(p["numInputRows"] for p in with_rows)
    millis = sum(p["durationMs"]["triggerExecution"] for p in with_rows)
    return (rows * 1000.0 / millis if millis else 0.0), rows


def median_batch_rate(progress: list[dict], batch_rows: int) -> float:
    """Rows/s of a typical full batch: batch_rows / the median triggerExecution of the batches of batch_rows."""
    millis = [p["durationMs"]["triggerExecution"] for p in progress if p["numInputRows"] == batch_rows]
    return batch_rows * 1000.0 / statistics.median(millis) if millis else 0.0


def call(port: int, lines: list[bytes]) -> None:
    """Send `lines`, then wait for a ping's answer: the broker has read them all."""
    from mqks.spark.line_client import LineClient

    client = LineClient("127.0.0.1", port)
    try:
        for lo in range(0, len(lines), 10_000):
            client.send(lines[lo:lo + 10_000])
        client.send([b"done ping done"])
        while not any(line.startswith(b"done ok") for line in client.read_lines(60.0)):
            pass
    finally:
        client.close()


def publish(port: int, queue: str, count: int, data_bytes: int) -> None:
    payload = b"x" * data_bytes
    call(port, [b"b rebind --confirm %s bench.e" % queue.encode()]
         + [b"m%d publish bench.e %s" % (i, payload) for i in range(count)])


def source_rows(args: argparse.Namespace, batch_rows: int) -> int:
    return args.messages or args.source_batches * batch_rows


def source_rate(spark, fmt: str, options: dict[str, str]) -> tuple[float, int, list[dict]]:
    reader = spark.readStream.format(fmt)
    for key, value in options.items():
        reader = reader.option(key, value)
    query = reader.load().writeStream.format("noop").trigger(availableNow=True).start()
    query.awaitTermination()
    rate, rows = steady_rate(query.recentProgress)
    return rate, rows, query.recentProgress


def warm_up(spark, port: int, args: argparse.Namespace) -> None:
    """One small run of each source and sink first: a session's first job pays for starting Python workers."""
    publish(port, "bench.warm", 20_000, args.data_bytes)
    source_rate(spark, "mqks", {"port": str(port), "queue": "bench.warm", "numPartitions": str(args.partitions)})
    source_rate(spark, "memorybench", {"rows": "20000", "parts": str(args.partitions), "batchRows": "5000",
                                       "dataBytes": str(args.data_bytes)})
    df = spark.range(20_000).selectExpr("'bench.warm.out' AS event", "'x' AS data").repartition(args.partitions)
    for fmt in ("nullrows", "nullarrow", "mqks", "mqksunconfirmed"):
        df.write.format(fmt).mode("append").option("port", str(port)).save() if fmt.startswith("mqks") else \
            df.write.format(fmt).mode("append").save()


def source_round(spark, port: int, args: argparse.Namespace, batch_rows: int, round_no: int, driver_jvm: int,
                 broker_pid: int) -> dict:
    queue = f"bench.q.{batch_rows}.{round_no}"
    messages = source_rows(args, batch_rows)
    publish(port, queue, messages, args.data_bytes)
    cells: dict = {}
    runs = [("mqks", {"port": str(port), "queue": queue, "maxRecordsPerBatch": str(batch_rows),
                      "numPartitions": str(args.partitions)}),
            ("memory", {"rows": str(messages), "parts": str(args.partitions), "batchRows": str(batch_rows),
                        "dataBytes": str(args.data_bytes)})]
    if round_no % 2:
        runs.reverse()  # neither always goes first
    for name, options in runs:
        cpu_before, broker_before = driver_cpu(driver_jvm), cpu_seconds(broker_pid)
        rate, rows, progress = source_rate(spark, "mqks" if name == "mqks" else "memorybench", options)
        assert rows == messages, f"{name} read {rows} of {messages}"
        cells[name] = rate
        cells[f"{name}_steady"] = median_batch_rate(progress, batch_rows)
        cells[f"{name}_ms"] = phases_ms(progress)
        cells[f"{name}_driver_us_per_row"] = (driver_cpu(driver_jvm) - cpu_before) * 1e6 / rows
        cells[f"{name}_broker_us_per_row"] = (cpu_seconds(broker_pid) - broker_before) * 1e6 / rows
    cells["ratio"] = cells["mqks"] / cells["memory"]
    cells["ratio_steady"] = cells["mqks_steady"] / cells["memory_steady"]
    call(port, [b"d delete_queue %s" % queue.encode()])
    return cells


def sink_round(spark, port: int, args: argparse.Namespace, df, round_no: int) -> dict:
    call(port, [b"b rebind --confirm bench.sink bench.out"])
    cells: dict = {}
    formats = ["nullrows", "mqks", "nullarrow", "noop", "floor", "floor_quiet", "mqksunconfirmed", "mqks_each"]
    if round_no % 2:
        formats.reverse()
    for fmt in formats:
        if fmt.startswith("floor"):
            cells[fmt] = floor_rate(port, args.sink_rows, args.partitions, 1000, args.data_bytes, round_no,
                                    quiet=fmt == "floor_quiet")
            continue
        started = time.monotonic()
        writer = df.write.format("mqks" if fmt == "mqks_each" else fmt).mode("append")
        if fmt == "mqks_each":  # the sink as before publish --confirm-quiet: an ok a row, in confirm windows
            writer = writer.option("quietConfirms", "false")
        (writer.option("port", str(port)) if fmt.startswith("mqks") else writer).save()
        cells[fmt] = args.sink_rows / (time.monotonic() - started)
    cells["ratio"] = cells["mqks"] / cells["nullrows"]
    cells["ratio_each"] = cells["mqks_each"] / cells["nullrows"]
    cells["ratio_arrow"] = cells["mqks"] / cells["nullarrow"]
    cells["ratio_floor"] = cells["floor"] / cells["nullrows"]
    cells["ratio_floor_quiet"] = cells["floor_quiet"] / cells["nullrows"]
    cells["ratio_unconfirmed"] = cells["mqksunconfirmed"] / cells["nullrows"]
    call(port, [b"d delete_queue bench.sink"])
    return cells


def median_of(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def listed(rounds: list[dict], key: str = "ratio") -> str:
    return ", ".join(f"{r[key]:.2f}" for r in rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source-batches", type=int, default=12, help="full batches of each source cell")
    parser.add_argument("--messages", type=int, default=0, help="rows of each source cell, instead of "
                        "--source-batches full batches")
    parser.add_argument("--sink-rows", type=int, default=200_000, help="rows of each sink cell")
    parser.add_argument("--data-bytes", type=int, default=100)
    parser.add_argument("--batch-rows", default="50000,10000", help="source cells: rows per micro-batch")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--partitions", type=int, default=2, help="source numPartitions and the sink's partitions")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cells", default="source,sink")
    parser.add_argument("--pure", action="store_true", help="run the broker as plain Python (MQKS_PURE=1)")
    parser.add_argument("--workers", type=int, default=1, help="the broker's worker processes: a sink cell's "
                        "queue is one worker's, and a partition connected to the other forwards its rows there")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from mqks.spark.session import local_session

    cells = args.cells.split(",")
    batch_sizes = [int(n) for n in args.batch_rows.split(",")] if "source" in cells else []
    port = free_port()
    # --pure: the broker as plain Python whatever the build, so that two runs compare the same broker
    env = dict(os.environ, MQKS_PURE="1") if args.pure else os.environ
    workers = ["--workers", str(args.workers)] if args.workers > 1 else []
    broker = subprocess.Popen([sys.executable, "-m", "mqks.server", "--port", str(port), *workers],
                              stderr=subprocess.PIPE, env=env)
    results: dict = {"source": {n: [] for n in batch_sizes}, "sink": []}
    try:
        assert broker.stderr is not None
        banner = "-"
        while banner and "in memory, " not in banner:  # with workers, the supervisor's lines come first
            banner = broker.stderr.readline().decode(errors="replace").strip()  # "": it ended
        # "... in memory, compiled (mypyc))", "... pure Python (MQKS_PURE=1))", "... pure Python: the build is ..."
        mode = banner.split("in memory, ", 1)[-1].rsplit(")", 1)[0].split(":")[0]
        results["broker"] = mode
        print(f"broker: {mode}", flush=True)
        threading.Thread(target=broker.stderr.read, daemon=True).start()  # never let its pipe fill
        spark = local_session("bench-spark", master=args.master)
        spark.dataSource.register(memory_source_class())
        for cls in (*null_sink_classes(), unconfirmed_sink_class()):
            spark.dataSource.register(cls)
        driver_jvm = spark.sparkContext._gateway.proc.pid  # type: ignore[union-attr]
        try:
            warm_up(spark, port, args)
            df = spark.range(args.sink_rows).selectExpr("'bench.out' AS event",
                                                       f"repeat('x', {args.data_bytes}) AS data")
            df = df.repartition(args.partitions).cache()
            df.count()
            # round 0 is not reported: the first full-size run of a shape pays for the JIT and the broker's heap
            for round_no in range(args.rounds + 1):
                for batch_rows in batch_sizes:
                    cell = source_round(spark, port, args, batch_rows, round_no, driver_jvm, broker.pid)
                    if not round_no:
                        continue
                    results["source"][batch_rows].append(cell)
                    phases = ", ".join(f"{phase} {cell['mqks_ms'][phase]}/{cell['memory_ms'].get(phase, 0)}"
                                       for phase in sorted(cell["mqks_ms"]) if cell["mqks_ms"][phase] > 20)
                    print(f"round {round_no} source {batch_rows:,}-row batches: mqks {cell['mqks']:,.0f} rows/s, "
                          f"memory Arrow {cell['memory']:,.0f} rows/s, {cell['ratio']:.2f}x, steady "
                          f"{cell['ratio_steady']:.2f}x (ms mqks/memory: {phases})", flush=True)
                if "sink" in cells:
                    cell = sink_round(spark, port, args, df, round_no)
                    if not round_no:
                        continue
                    results["sink"].append(cell)
                    print(f"round {round_no} sink: mqks {cell['mqks']:,.0f} rows/s, null rows writer "
                          f"{cell['nullrows']:,.0f}, null Arrow writer {cell['nullarrow']:,.0f}, "
                          f"noop {cell['noop']:,.0f}: {cell['ratio']:.2f}x the rows writer (an ok a row: "
                          f"{cell['mqks_each']:,.0f}, {cell['ratio_each']:.2f}x), "
                          f"{cell['ratio_arrow']:.2f}x the Arrow writer; broker floor {cell['floor']:,.0f} "
                          f"({cell['ratio_floor']:.2f}x), quiet {cell['floor_quiet']:,.0f} "
                          f"({cell['ratio_floor_quiet']:.2f}x), unconfirmed {cell['mqksunconfirmed']:,.0f} "
                          f"({cell['ratio_unconfirmed']:.2f}x)", flush=True)
        finally:
            spark.stop()
    finally:
        broker.kill()
        broker.wait()
    source_cells = ", ".join(f"{source_rows(args, n):,}" for n in batch_sizes)
    print(f"medians of {args.rounds} rounds, {args.master}, {args.partitions} partitions, source cells of "
          f"{source_cells} rows and {args.sink_rows:,} sink rows of {args.data_bytes} B, {os.cpu_count()} cores, "
          f"broker {results['broker']}:")
    for batch_rows, rounds in results["source"].items():
        print(f"  source, {batch_rows:,}-row batches: mqks {median_of(rounds, 'mqks'):,.0f} rows/s, memory Arrow "
              f"{median_of(rounds, 'memory'):,.0f}: ratio {median_of(rounds, 'ratio'):.2f}x "
              f"(rounds {listed(rounds)}), steady {median_of(rounds, 'ratio_steady'):.2f}x "
              f"(rounds {listed(rounds, 'ratio_steady')}); driver CPU "
              f"{median_of(rounds, 'mqks_driver_us_per_row'):.2f} us/row "
              f"(memory {median_of(rounds, 'memory_driver_us_per_row'):.2f}), broker "
              f"{median_of(rounds, 'mqks_broker_us_per_row'):.2f} us/row")
    if results["sink"]:
        rounds = results["sink"]
        print(f"  sink: mqks {median_of(rounds, 'mqks'):,.0f} rows/s, null rows writer "
              f"{median_of(rounds, 'nullrows'):,.0f}, null Arrow writer {median_of(rounds, 'nullarrow'):,.0f}, "
              f"noop {median_of(rounds, 'noop'):,.0f}: ratio {median_of(rounds, 'ratio'):.2f}x "
              f"(rounds {listed(rounds)}), "
              f"an ok a row (quietConfirms=false) {median_of(rounds, 'mqks_each'):,.0f} rows/s "
              f"({median_of(rounds, 'ratio_each'):.2f}x), "
              f"{median_of(rounds, 'ratio_arrow'):.2f}x the Arrow writer; the broker alone confirming the same "
              f"lines (no Spark) {median_of(rounds, 'floor'):,.0f} rows/s ({median_of(rounds, 'ratio_floor'):.2f}x), "
              f"quiet with one sync {median_of(rounds, 'floor_quiet'):,.0f} rows/s "
              f"({median_of(rounds, 'ratio_floor_quiet'):.2f}x), "
              f"the sink unconfirmed {median_of(rounds, 'mqksunconfirmed'):,.0f} rows/s "
              f"({median_of(rounds, 'ratio_unconfirmed'):.2f}x)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

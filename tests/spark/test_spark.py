"""The `mqks` PySpark data source against a real mqksd and a real local Spark session.

One SparkSession (local[2]) serves every test here; the failure test runs its streaming query
in a subprocess so that it can be SIGKILLed between reading a batch and committing it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BrokerProcess
from helpers import free_port, queue_row, queue_row_on
from waiting import wait_for

pytest.importorskip("pyspark", reason="pyspark is not installed: pip install -e '.[spark]'")
pytest.importorskip("pyarrow", reason="pyarrow is not installed: pip install -e '.[spark]'")

pytestmark = pytest.mark.spark

HERE = Path(__file__).resolve().parents[1]  # tests/: its helper jobs, beside the repository's root
WAIT_SECONDS = 90.0
POLL_SECONDS = 0.2  # a poll may run a Spark query: no need to ask more often


@pytest.fixture(scope="session")
def spark() -> Iterator:
    from mqks.spark.session import local_session

    session = local_session("mqks-tests")
    yield session
    session.stop()


def eventually(condition, what: str, timeout: float = WAIT_SECONDS):
    """`wait_for` with Spark's patience: batches take seconds, not milliseconds."""
    return wait_for(condition, what, timeout, interval=POLL_SECONDS)


@pytest.fixture(scope="module", params=[1], ids=["workers1"])
def broker(request) -> Iterator[BrokerProcess]:
    """One broker for the Spark tests, with one worker; the tests marked ON_BOTH run with two as well
    (a Spark run takes seconds, so the whole module twice would double the suite)."""
    server = BrokerProcess("--eval", "--workers", str(request.param))
    yield server
    server.kill()


# executors fetch from the queue's owner and settle anywhere: these run with two workers too
ON_BOTH = pytest.mark.parametrize("broker", [1, 2], ids=["workers1", "workers2"], indirect=True)


def queue_depths(broker, queue: str) -> tuple[int, int]:
    """(messages waiting, messages in flight: un-acked or leased) of one queue, from its `queues` row."""
    row = queue_row(broker, queue)
    return (row["depth"], row["unacked"] + row["leased"]) if row is not None else (0, 0)


def bind(broker, queue: str, *events: str) -> None:
    wire = broker.wire()
    try:
        wire.send(b"rb rebind --confirm %s --add %s" % (queue.encode(), " ".join(events).encode()))
        wire.expect(b"rb ok ")
    finally:
        wire.close()


def publish(broker, messages: list[tuple[str, str, str]]) -> None:
    """Publish (msg_id, event, data) triples; returns once the server has routed them all."""
    wire = broker.wire()
    try:
        for lo in range(0, len(messages), 1000):
            wire.send(*(f"{m} publish {e} {d}".encode() for m, e, d in messages[lo : lo + 1000]))
        assert wire.barrier() == []
    finally:
        wire.close()


def consume(wire, consumer_id: bytes, queue: str) -> None:
    """Start a plain consumer: a consume without --add is confirmed by `ok` alone."""
    wire.send(b"%s consume --confirm %s" % (consumer_id, queue.encode()))
    wire.expect(consumer_id + b" ok ")


def collect_deliveries(wire, consumer_id: bytes, count: int) -> list[tuple[bytes, bytes, bytes]]:
    """Read exactly `count` deliveries as (msg_id, head, data), then prove nothing else came."""
    prefix = consumer_id + b" ok "
    got = []
    while len(got) < count:
        line = wire.recv_line(timeout=30.0)
        assert line.startswith(prefix), line
        msg_id, head, data = line[len(prefix) :].split(b" ", 2)
        got.append((msg_id, head, data))
    assert wire.barrier() == []
    return got


def mqks_stream(spark, broker, queue: str, events: str = "", **options: str):
    reader = (
        spark.readStream.format("mqks")
        .option("host", broker.host)
        .option("port", str(broker.port))
        .option("queue", queue)
        .option("events", events)
    )
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


@ON_BOTH
def test_stream_delivers_5000_events_and_acks_them_all(spark, broker):
    queue = "spark.all"
    bind(broker, queue, "user.*.created")
    messages = [(f"m{i}", f"user.{i % 7}.created", json.dumps({"i": i, "text": "a b"})) for i in range(5000)]
    publish(broker, messages)
    assert queue_depths(broker, queue) == (5000, 0)

    stream = mqks_stream(spark, broker, queue, "user.*.created", maxRecordsPerBatch="1000", idleAckSeconds="1")
    query = stream.writeStream.format("memory").queryName("spark_all").start()
    try:
        eventually(lambda: spark.sql("select count(*) from spark_all").first()[0] >= 5000, "5000 rows in the sink")
        # the last batch is acked by the idle tick, not by a later batch
        eventually(lambda: queue_depths(broker, queue) == (0, 0), "the queue to drain with nothing un-acked")
    finally:
        query.stop()
    rows = spark.sql("select * from spark_all").collect()
    assert len(rows) == 5000
    assert {r.msg_id for r in rows} == {m for m, _, _ in messages}
    expected = {m: (e, d) for m, e, d in messages}
    assert all((r.event, r.data) == expected[r.msg_id] for r in rows)
    assert {r.queue for r in rows} == {queue}
    assert {r.retry for r in rows} == {0}
    assert all(r.received_at is not None for r in rows)


def test_what_is_published_right_after_start_is_read(spark, broker):
    """load() binds the queue: messages published the moment start() returns (seconds before Spark plans its first
    batch) wait for the query. Before issue 39 the queue was made at the first batch, and they went nowhere."""
    queue = "spark.fresh"
    stream = mqks_stream(spark, broker, queue, "fresh.e", idleAckSeconds="1")
    assert queue_row(broker, queue) is not None  # bound at load(), before any query runs
    query = stream.writeStream.format("memory").queryName("spark_fresh").start()
    try:
        ids = [f"f{i}" for i in range(100)]
        publish(broker, [(m, "fresh.e", "x") for m in ids])
        eventually(lambda: spark.sql("select count(*) from spark_fresh").first()[0] >= 100, "100 rows in the sink")
        eventually(lambda: queue_depths(broker, queue) == (0, 0), "the queue to drain with nothing un-acked")
    finally:
        query.stop()
    assert sorted(r.msg_id for r in spark.sql("select msg_id from spark_fresh").collect()) == sorted(ids)


def test_max_records_per_batch_bounds_every_batch(spark, broker):
    queue = "spark.limit"
    bind(broker, queue, "limit.e")
    publish(broker, [(f"l{i}", "limit.e", str(i)) for i in range(1000)])

    stream = mqks_stream(spark, broker, queue, maxRecordsPerBatch="300", idleAckSeconds="1")
    query = stream.writeStream.format("noop").start()
    try:
        def batch_sizes() -> list[int]:
            return [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]

        eventually(lambda: sum(batch_sizes()) >= 1000, "1000 rows read")
        eventually(lambda: queue_depths(broker, queue) == (0, 0), "the queue to drain")
    finally:
        query.stop()
    sizes = batch_sizes()
    print(f"batch sizes with maxRecordsPerBatch=300: {sizes}")
    assert sum(sizes) == 1000
    assert max(sizes) == 300  # the limit bites: 1000 messages were waiting before the start


def test_batch_write_publishes_each_row_once(spark, broker):
    queue = "spark.sink"
    bind(broker, queue, "sink.0", "sink.1", "sink.2")
    wire = broker.wire()
    try:
        consume(wire, b"c1", queue)
        n = 2000
        df = spark.range(n).selectExpr(
            "concat('sink.', cast(id % 3 as string)) as event",
            "named_struct('i', id, 'text', concat('row ', cast(id as string))) as data",
        )
        df.write.format("mqks").mode("append").option("host", broker.host).option("port", str(broker.port)).save()
        got = collect_deliveries(wire, b"c1", n)
    finally:
        wire.close()
    by_i = {}
    for msg_id, head, data in got:
        payload = json.loads(data)
        by_i[payload["i"]] = (head, payload, msg_id)
    assert sorted(by_i) == list(range(n))
    for i, (head, payload, _) in by_i.items():
        assert head == b"event=sink.%d" % (i % 3)
        assert payload == {"i": i, "text": f"row {i}"}
    assert len({msg_id for _, _, msg_id in by_i.values()}) == n  # one id per row


@ON_BOTH
def test_stream_write_publishes_with_deterministic_ids(spark, broker, tmp_path):
    source_queue, out_queue = "spark.pipe.in", "spark.pipe.out"
    bind(broker, source_queue, "pipe.in")
    bind(broker, out_queue, "piped.pipe.in")
    publish(broker, [(f"p{i}", "pipe.in", f"payload {i}") for i in range(500)])
    wire = broker.wire()
    try:
        consume(wire, b"c2", out_queue)
        stream = mqks_stream(spark, broker, source_queue, idleAckSeconds="1")
        query = (
            stream.selectExpr("concat('piped.', event) as event", "data")
            .writeStream.format("mqks")
            .option("host", broker.host)
            .option("port", str(broker.port))
            .option("checkpointLocation", str(tmp_path / "checkpoint"))
            .option("msgIdPrefix", "pipe")
            .start()
        )
        try:
            got = collect_deliveries(wire, b"c2", 500)
        finally:
            query.stop()
    finally:
        wire.close()
    assert sorted(data for _, _, data in got) == sorted(f"payload {i}".encode() for i in range(500))
    assert {head for _, head, _ in got} == {b"event=piped.pipe.in"}
    # {msgIdPrefix}.{batch}.{partition}.{row}: the batch id keeps the ids of different batches apart
    for msg_id, _, _ in got:
        prefix, batch, partition, row = msg_id.split(b".")
        assert prefix == b"pipe" and batch.isdigit() and partition.isdigit() and row.isdigit(), msg_id
    assert len({msg_id for msg_id, _, _ in got}) == 500


def test_batch_write_uses_the_msg_id_column_when_given(spark, broker):
    queue = "spark.ids"
    bind(broker, queue, "ids.e")
    wire = broker.wire()
    try:
        consume(wire, b"c3", queue)
        df = spark.createDataFrame(
            [("own.1", "ids.e", "plain text, with spaces"), (None, "ids.e", "")],
            "msg_id STRING, event STRING, data STRING",
        ).coalesce(1)
        df.write.format("mqks").mode("append").option("host", broker.host).option("port", str(broker.port)).save()
        got = collect_deliveries(wire, b"c3", 2)
    finally:
        wire.close()
    assert got[0] == (b"own.1", b"event=ids.e", b"plain text, with spaces")
    default_id, head, data = got[1]
    assert (head, data) == (b"event=ids.e", b"")
    assert default_id.endswith(b".0.1")  # {write id}.{partition}.{row}: the second row of partition 0


def test_sink_fails_with_the_server_reason(spark, broker):
    df = spark.createDataFrame([("--not-an-event", "x")], "event STRING, data STRING")
    with pytest.raises(Exception) as failure:
        df.write.format("mqks").mode("append").option("host", broker.host).option("port", str(broker.port)).save()
    text = str(failure.value)
    assert "refused publish" in text and "publish: event" in text, text[-2000:]


@ON_BOTH
def test_a_refusal_among_the_sinks_quiet_publishes_fails_its_task(spark, broker):
    """The sink's publishes are quiet, answered only when refused; a refusal still fails the task (with two workers
    it may come from the worker that owns the queue)."""
    wire = broker.wire()
    try:
        wire.send(b"rb rebind --confirm spark.sink.full full.e --max-length=10")
        wire.expect(b"rb ok ")
    finally:
        wire.close()
    df = spark.range(100).selectExpr("'full.e' AS event", "cast(id AS string) AS data").coalesce(1)
    with pytest.raises(Exception) as failure:
        df.write.format("mqks").mode("append").option("host", broker.host).option("port", str(broker.port)).save()
    text = str(failure.value)
    assert "refused publish" in text and "queue spark.sink.full is full (--max-length=10)" in text, text[-2000:]


def _spark_process(cmd: list[str], log: Path) -> subprocess.Popen:
    """A Python script that starts its own Spark, logging to `log`; stop it with `_kill_group`."""
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    with open(log, "ab") as log_file:
        # its own process group: SIGKILL takes the JVM and the Python workers with it
        return subprocess.Popen([sys.executable, *cmd], stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


CLUSTER = "local-cluster[2,1,1024]"  # two executor JVMs of one core each, as on a real cluster


def _run_job(broker, queue: str, checkpoint: Path, out: Path, log: Path, block_batch: int | None = None,
             stall_executor_batch: int | None = None, master: str = CLUSTER) -> subprocess.Popen:
    cmd = [
        str(HERE / "spark_failure_job.py"),
        "--port", str(broker.port), "--queue", queue, "--master", master,
        "--checkpoint", str(checkpoint), "--out", str(out), "--max-records-per-batch", "100",
    ]
    if block_batch is not None:
        cmd += ["--block-batch", str(block_batch)]
    if stall_executor_batch is not None:
        cmd += ["--stall-executor-batch", str(stall_executor_batch)]
    return _spark_process(cmd, log)


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _recorded(out: Path) -> list[tuple[str, str, int]]:
    """(file name, msg_id, retry) for every row any run recorded."""
    rows = []
    for path in sorted(out.glob("batch-*.txt")):
        for line in path.read_text().splitlines():
            msg_id, retry = line.split()
            rows.append((path.name, msg_id, int(retry)))
    return rows


@pytest.mark.timeout(300)  # two Spark processes start one after the other
def test_killed_driver_restarts_from_checkpoint_without_loss(broker, tmp_path):
    queue = "spark.crash"
    bind(broker, queue, "crash.e")
    ids = [f"k{i}" for i in range(1000)]
    publish(broker, [(m, "crash.e", "x") for m in ids])
    checkpoint, out, log = tmp_path / "checkpoint", tmp_path / "out", tmp_path / "job.log"

    # local[2]: what dies is the driver with its executors; the executor's own death is the next test's (two
    # executor JVMs per run here cost half a minute for nothing)
    first = _run_job(broker, queue, checkpoint, out, log, block_batch=3, master="local[2]")
    try:
        outcome = eventually(
            lambda: "blocked" if (out / "blocked").exists() else "exited" if first.poll() is not None else None,
            "the job to block in batch 3", 150,
        )
        assert outcome == "blocked", f"the job exited {first.returncode} before blocking: {log.read_text()[-3000:]}"
        assert first.poll() is None, log.read_text()[-3000:]  # still holding the batch it read
        blocked_batch, blocked_rows = map(int, (out / "blocked").read_text().split())
    finally:
        _kill_group(first)
    blocked_ids = {m for name, m, _ in _recorded(out) if name.startswith(f"batch-{blocked_batch}-{first.pid}")}
    assert len(blocked_ids) == blocked_rows > 0

    second = _run_job(broker, queue, checkpoint, out, log, block_batch=None, master="local[2]")
    try:
        eventually(lambda: {m for _, m, _ in _recorded(out)} >= set(ids) or second.poll() is not None,
                 "every message to be processed after the restart", 150)
        assert second.poll() is None, log.read_text()[-3000:]
        eventually(lambda: queue_depths(broker, queue) == (0, 0), "the queue to drain after the restart")
    finally:
        _kill_group(second)

    recorded = _recorded(out)
    counts = Counter(m for _, m, _ in recorded)
    duplicates = {m: c for m, c in counts.items() if c > 1}
    print(f"failure test: {len(ids)} messages, {len(recorded)} processed, {sum(c - 1 for c in duplicates.values())} "
          f"duplicates (batch {blocked_batch} had {blocked_rows} rows when the job was killed)")
    assert set(counts) == set(ids)  # none lost, nothing foreign
    # duplicates come only from the batch that was read but never committed
    assert set(duplicates) <= blocked_ids
    assert all(c == 2 for c in duplicates.values())
    assert all(retry > 0 for name, m, retry in recorded if m in duplicates and f"-{second.pid}." in name)


@pytest.mark.timeout(300)
def test_killed_executor_delays_nothing_and_loses_nothing(broker, tmp_path):
    queue = "spark.executor.kill"
    bind(broker, queue, "executor.kill")
    ids = [f"x{i}" for i in range(600)]
    publish(broker, [(m, "executor.kill", "x") for m in ids])
    checkpoint, out, log = tmp_path / "checkpoint", tmp_path / "out", tmp_path / "job.log"

    job = _run_job(broker, queue, checkpoint, out, log, stall_executor_batch=2)
    try:
        eventually(lambda: (out / "stalled").exists() or job.poll() is not None, "a task to stall in its executor", 150)
        assert job.poll() is None, log.read_text()[-3000:]
        executor_pid, stalled_rows = map(int, wait_for(lambda: (out / "stalled").read_text().split() or None,
                                                       "the stalled executor's pid"))
        os.kill(executor_pid, signal.SIGKILL)  # the executor JVM with its Python workers' parent
        # Spark retries the task on the other executor: the retry fetches under the same lease,
        # which first gives back what the killed attempt held, so nothing waits for the lease to expire
        eventually(lambda: {m for _, m, _ in _recorded(out)} >= set(ids) or job.poll() is not None,
                   "every message to be processed after the executor died", 150)
        assert job.poll() is None, log.read_text()[-3000:]
        eventually(lambda: queue_depths(broker, queue) == (0, 0), "the queue to drain with nothing in flight")
    finally:
        _kill_group(job)
    recorded = _recorded(out)
    counts = Counter(m for _, m, _ in recorded)
    redelivered = {m for _, m, retry in recorded if retry > 0}
    print(f"executor kill: {len(ids)} messages, {len(recorded)} processed, "
          f"{sum(c - 1 for c in counts.values())} duplicates, {len(redelivered)} came back with retry > 0 "
          f"(the killed task held {stalled_rows})")
    assert set(counts) == set(ids)
    assert len(redelivered) == stalled_rows  # the killed attempt's messages, released by the retry's fetch
    assert all(c == 1 for c in counts.values())  # the killed attempt's rows never reached the sink


def _reader(broker, queue: str, **options: str):
    """The stream reader without Spark: the calls Spark's driver-side runner makes, made by hand."""
    from mqks.spark.source import MqksStreamReader, SourceOptions, source_struct

    options = {"host": broker.host, "port": str(broker.port), "queue": queue, **options}
    return MqksStreamReader(SourceOptions.parse(options), source_struct())


def _read(reader, partitions) -> list[tuple[str, int]]:
    """What executors would read: (msg_id, retry) of every row of every partition."""
    rows = []
    for partition in partitions:
        for batch in reader.read(partition):
            rows += zip(batch.column("msg_id").to_pylist(), batch.column("retry").to_pylist(), strict=True)
    return rows


def test_a_retried_read_acks_only_what_its_last_fetch_delivered(broker):
    from pyspark.sql.streaming.datasource import ReadMaxRows

    queue = "spark.retry"
    bind(broker, queue, "retry.e")
    publish(broker, [(f"r{i}", "retry.e", "x") for i in range(10)])
    reader = _reader(broker, queue, numPartitions="1")
    try:
        start = reader.initialOffset()
        end = reader.latestOffset(start, ReadMaxRows(6))
        assert [part[1] for part in end["parts"]] == [6]
        parts = reader.partitions(start, end)
        first = _read(reader, parts)
        assert first == [(f"r{i}", 0) for i in range(6)]
        assert queue_depths(broker, queue) == (4, 6)
        # a task retry (or a recomputed partition) reads again under the same lease: what the first
        # attempt held comes back first, with retry 1, and only the second attempt's rows are acked
        assert _read(reader, parts) == [(f"r{i}", 1) for i in range(6)]
        assert queue_depths(broker, queue) == (4, 6)
        reader.commit(end)
        assert queue_depths(broker, queue) == (4, 0)
        reader.commit(end)  # committing again acks nothing more
        assert queue_depths(broker, queue) == (4, 0)
    finally:
        reader.stop()


def test_a_part_is_fetched_small_first_and_without_a_small_last_fetch():
    from mqks.spark.source import fetch_rows

    def plan(rows: int) -> list[int]:
        asks = []
        while rows > 0:
            asks.append(fetch_rows(rows, first=not asks))
            rows -= asks[-1]
        return asks

    assert plan(5_000) == [5_000]  # a 10,000-row batch's part: one round trip, not two
    assert plan(25_000) == [4_096, 20_904]  # a 50,000-row batch's part: two round trips, not three
    assert plan(50_000) == [4_096, 20_000, 20_000, 5_904]
    assert plan(7) == [7]


def test_a_part_read_in_several_fetches_holds_them_all_under_one_lease(broker, monkeypatch):
    from pyspark.sql.streaming.datasource import ReadMaxRows

    import mqks.spark.source

    monkeypatch.setattr(mqks.spark.source, "FETCH_ROWS", 3)  # 10 rows: fetches of 3, 3, 3 and 1, pipelined
    queue = "spark.chunks"
    bind(broker, queue, "chunks.e")
    publish(broker, [(f"k{i}", "chunks.e", "x y") for i in range(12)])
    reader = _reader(broker, queue, numPartitions="1")
    try:
        start = reader.initialOffset()
        end = reader.latestOffset(start, ReadMaxRows(10))
        parts = reader.partitions(start, end)
        assert _read(reader, parts) == [(f"k{i}", 0) for i in range(10)]
        assert queue_depths(broker, queue) == (2, 10)
        # a retry releases all four fetches' messages first (the first fetch is not --add)
        assert _read(reader, parts) == [(f"k{i}", 1) for i in range(10)]
        reader.commit(end)
        assert queue_depths(broker, queue) == (2, 0)
    finally:
        reader.stop()


@ON_BOTH
def test_a_new_run_acks_the_batch_an_earlier_run_left_by_its_leases(broker):
    from pyspark.sql.streaming.datasource import ReadMaxRows

    queue = "spark.sessions"
    bind(broker, queue, "sessions.e")
    publish(broker, [(f"s{i}", "sessions.e", "x") for i in range(10)])
    earlier = _reader(broker, queue)
    start = earlier.initialOffset()
    end = earlier.latestOffset(start, ReadMaxRows(10))
    assert len(_read(earlier, earlier.partitions(start, end))) == 10
    earlier.stop()  # the driver dies after the sink committed the batch, before the source's commit
    later = _reader(broker, queue)
    try:
        # no new data, but the batch of the earlier run is un-acked: an empty batch lets Spark commit it
        tick = later.latestOffset(end, ReadMaxRows(10))
        assert tick != end and tick["parts"] == [] and later.partitions(end, tick) == []
        assert queue_depths(broker, queue) == (0, 10)
        later.commit(end)
        assert queue_depths(broker, queue) == (0, 0)
        assert later.latestOffset(tick, ReadMaxRows(10)) == tick  # nothing more to do
    finally:
        later.stop()


def test_a_durable_broker_restart_returns_leased_messages_and_loses_none(make_broker, tmp_path):
    from pyspark.sql.streaming.datasource import ReadMaxRows

    server = make_broker("--eval", "--data-dir", str(tmp_path / "data"))
    queue = "spark.restart"
    bind(server, queue, "restart.e")
    wire = server.wire()
    try:
        wire.send(*(b"d%d publish --confirm restart.e x" % i for i in range(20)))
        for i in range(20):
            wire.expect(b"d%d ok " % i)
    finally:
        wire.close()
    reader = _reader(server, queue, reconnectSeconds="30")
    try:
        start = reader.initialOffset()
        end = reader.latestOffset(start, ReadMaxRows(20))
        assert len(_read(reader, reader.partitions(start, end))) == 20
        wire = server.wire()
        try:  # a confirm waits for every record before it: the leases' records are on disk now
            wire.send(b"sync publish --confirm sync.e x")
            wire.expect(b"sync ok ")
        finally:
            wire.close()
        server.kill()
        server.restart()
        reader.commit(end)  # reconnects; the leases died with the broker, so it acks nothing
        assert queue_depths(server, queue) == (20, 0)
        again = reader.latestOffset(end, ReadMaxRows(20))
        rows = _read(reader, reader.partitions(end, again))
        assert sorted(rows) == sorted((f"d{i}", 1) for i in range(20))  # back, with their retry raised
        reader.commit(again)
        assert queue_depths(server, queue) == (0, 0)
    finally:
        reader.stop()


def expect_block(wire, rid: bytes, kind: bytes, first: int, count: int, lines: list[bytes], headers: bytes = b""):
    """A `fetch --runs` block: its header line, naming the bytes of `lines`, then those lines."""
    wire.expect(b"%b ok %b %d %d %d%b" % (rid, kind, first, count, sum(len(line) + 1 for line in lines), headers))
    assert [wire.recv_line() for _ in lines] == lines


@ON_BOTH
def test_fetch_runs_sends_stored_runs_as_they_are_and_tails_after_the_redelivered(broker):
    queue = "spark.runs"
    bind(broker, queue, "runs.e")
    # deep enough to be packed (messages.py): 4096 tails, then runs of 1024 (4096.., 5120..), then 856 tails
    publish(broker, [(f"u{i}", "runs.e", f"d{i} with spaces") for i in range(7000)])

    def tails(first: int, count: int) -> list[bytes]:
        return [b" ok u%d event=runs.e d%d with spaces" % (i, i) for i in range(first, first + count)]

    wire = broker.wire()
    try:
        wire.send(b"f1 fetch spark.runs --lease=R1 --max=2 --runs")
        expect_block(wire, b"f1", b"--tails", 0, 2, tails(0, 2))
        wire.expect(b"f1 ok --end 2")
        wire.send(b"r1 settle R1 --release")
        wire.expect(b"r1 ok 2")
        # a retry's fetch: the messages that came back carry their own seq (and retry), the blocks come after them
        wire.send(b"f2 fetch spark.runs --lease=R2 --max=4 --runs")
        for line in (b"f2 ok u0 event=runs.e,retry=1,seq=0 d0 with spaces",
                     b"f2 ok u1 event=runs.e,retry=1,seq=1 d1 with spaces"):
            wire.expect(line)
        expect_block(wire, b"f2", b"--tails", 2, 2, tails(2, 2))
        wire.expect(b"f2 ok --end 4")
        # a stored run that fits goes whole, as one line (its event in the header); one that does not is split
        wire.send(b"f3 fetch spark.runs --lease=R2 --max=6000 --max-bytes=1000000 --runs --add",
                  b"f4 fetch spark.runs --lease=R3 --max=10 --max-bytes=100 --runs")
        expect_block(wire, b"f3", b"--tails", 4, 4092, tails(4, 4092))
        packed = b"\xff".join(b"u%d\xffd%d with spaces" % (i, i) for i in range(4096, 5120))
        expect_block(wire, b"f3", b"--packed", 4096, 1024, [packed], b" 1024 runs.e")
        expect_block(wire, b"f3", b"--tails", 5120, 884, tails(5120, 884))
        wire.expect(b"f3 ok --end 6000")
        # the byte limit holds inside a run (40-byte tails: two fit in 100)
        expect_block(wire, b"f4", b"--tails", 6004, 2, tails(6004, 2))
        wire.expect(b"f4 ok --end 2")
        wire.send(b"s settle R2 R3 --ack")
        wire.expect(b"s ok 6006")
        assert wire.barrier() == []
    finally:
        wire.close()
    assert queue_depths(broker, queue) == (994, 0)


def test_the_source_reads_the_one_run_of_a_broker_from_before_the_blocks():
    """`fetch --runs` answered one run after a `--seq-from` line before the blocks: still read, seqs counted on."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema

    from mqks.spark.source import _decode, source_struct

    schema = source_struct()
    block = bytearray(b"r1 ok m0 event=old.e,retry=1,seq=3 a b\nr1 ok --seq-from 7\nr1 ok m7 event=old.e c d\n"
                      b"r1 ok m8 event=old.e e\nr1 ok --end 3\n")
    batches = _decode(block, b"r1", 3, "old", schema.fieldNames(), to_arrow_schema(schema, timezone="UTC"), pa)
    rows = [(row["msg_id"], row["seq"], row["retry"], row["data"]) for batch in batches for row in batch.to_pylist()]
    assert rows == [("m0", 3, 1, "a b"), ("m7", 7, 0, "c d"), ("m8", 8, 0, "e")]


def test_the_source_counts_seqs_on_from_each_blocks_first():
    """A `--tails` and a `--packed` block of one answer, far into a queue: each row's seq is its block's first
    plus its place, the packed rows' event is their stretch's."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema

    from mqks.spark.source import _decode, source_struct

    schema = source_struct()
    tails = b" ok m9000000000 event=far.e a b\n ok m9000000001 event=far.e c\n"
    packed = b"m9000000002\xffd\xffm9000000003\xffe f\xffm9000000004\xffg\n"
    block = bytearray(b"r1 ok --tails 9000000000 2 %d\n%br1 ok --packed 9000000002 3 %d 2 far.e 1 far.f\n%b"
                      b"r1 ok --end 5\n" % (len(tails), tails, len(packed), packed))
    batches = _decode(block, b"r1", 5, "far", schema.fieldNames(), to_arrow_schema(schema, timezone="UTC"), pa)
    rows = [(row["msg_id"], row["seq"], row["event"], row["data"]) for batch in batches for row in batch.to_pylist()]
    assert rows == [("m9000000000", 9_000_000_000, "far.e", "a b"), ("m9000000001", 9_000_000_001, "far.e", "c"),
                    ("m9000000002", 9_000_000_002, "far.e", "d"), ("m9000000003", 9_000_000_003, "far.e", "e f"),
                    ("m9000000004", 9_000_000_004, "far.f", "g")]


def test_the_source_reads_a_broker_without_fetch_runs_line_by_line(broker, monkeypatch):
    """A broker from before `fetch --runs` refuses the flag: the executor asks again without it, and remembers."""
    import socket as sockets

    import mqks.spark.source
    from mqks.spark.source import MqksPartition, SourceOptions, fetch_part, source_struct

    monkeypatch.setattr(mqks.spark.source, "_WITHOUT_RUNS", set())
    asked: list[bytes] = []
    listener = sockets.create_server(("127.0.0.1", 0))

    def older_broker() -> None:
        conn, _ = listener.accept()
        with conn:
            buffer = b""
            while True:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    rid, action, args = (line + b" ").split(b" ", 2)
                    asked.append(action + b" " + args.split()[-1] if args.strip() else action)
                    if action == b"hello" or b"--runs" in args:
                        reason = b"unknown action" if action == b"hello" else b"fetch: unexpected '--runs'; ..."
                        conn.sendall(b"%b error e1 %b\n" % (rid, reason))
                    else:
                        conn.sendall(b"".join(b"%b ok m%d event=old.e,seq=%d data %d\n" % (rid, i, 7 + i, i)
                                              for i in range(3)) + b"%b ok --end 3\n" % rid)

    thread = threading.Thread(target=older_broker, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    try:
        options = SourceOptions.parse({"port": str(port), "queue": "old"})
        batches = list(fetch_part(options, source_struct(), MqksPartition("old", "spark.s.1.0", 3, 0)))
    finally:
        mqks.spark.source._CLIENTS.pop(("127.0.0.1", port)).close()
        listener.close()
    rows = [row for batch in batches for row in zip(batch.column("msg_id").to_pylist(),
                                                     batch.column("seq").to_pylist(), strict=True)]
    assert rows == [("m0", 7), ("m1", 8), ("m2", 9)]
    assert asked[-2:] == [b"fetch --runs", b"fetch --lease-seconds=300.0"]  # refused once, then asked as before
    assert ("127.0.0.1", port) in mqks.spark.source._WITHOUT_RUNS


def test_a_failed_write_task_retried_publishes_every_row_again_and_loses_none(broker):
    """What Spark does with a task that fails: it runs it again. Rows the failed attempt sent may come twice,
    none is lost, and the retry's ids are the first attempt's."""
    import pyarrow as pa
    from pyspark.sql.types import StringType, StructField, StructType

    from mqks.spark.sink import MqksBatchWriter, SinkOptions

    queue = "spark.sink.retry"
    bind(broker, queue, "retry.out")
    schema = StructType([StructField("event", StringType()), StructField("data", StringType())])
    writer = MqksBatchWriter(SinkOptions.parse({"host": broker.host, "port": str(broker.port),
                                                "confirmWindow": "7"}), schema)

    def batches(fail_after: int | None):
        for first in range(0, 100, 25):
            if fail_after is not None and first >= fail_after:
                raise RuntimeError("the executor died")
            yield pa.RecordBatch.from_arrays([pa.array(["retry.out"] * 25), pa.array([f"row {first + i}" for i in
                                                                                     range(25)])],
                                             names=["event", "data"])

    with pytest.raises(RuntimeError):
        writer.write(batches(fail_after=50))
    done = writer.write(batches(fail_after=None))
    assert (done.count, done.first_msg_id, done.last_msg_id) == (100, f"{writer.write_id}.0.0",
                                                                  f"{writer.write_id}.0.99")
    wire = broker.wire()
    try:
        consume(wire, b"c9", queue)
        # everything waiting is delivered on the consume line, before the barrier's answer
        got = [line.split(b" ", 4)[2::2] for line in wire.barrier()]
    finally:
        wire.close()
    counts = Counter(data for _, data in got)
    assert set(counts) == {b"row %d" % i for i in range(100)}  # none lost
    # duplicates only of what the failed attempt sent (its unconfirmed tail may have died with its connection)
    assert {data for data, seen in counts.items() if seen > 1} <= {b"row %d" % i for i in range(50)}
    assert max(counts.values()) <= 2
    assert {msg_id for msg_id, _ in got} == {b"%s.0.%d" % (writer.write_id.encode(), i) for i in range(100)}


def bytes_out(broker) -> int:
    """What the broker's client connections were sent so far, summed over its workers."""
    wire = broker.wire()
    try:
        wire.send(b"st stats")
        line = wire.recv_line()
        assert line.startswith(b"st ok "), line
        return json.loads(line[6:])["bytes_out"]
    finally:
        wire.close()


@ON_BOTH  # two workers take quiet publishes too: a copy for the other worker's queue is confirmed quietly there
@pytest.mark.parametrize("quiet", ["true", "false"])
def test_the_sink_keeps_its_windows_and_builds_rows_that_need_python_one_by_one(spark, broker, quiet):
    queue = "spark.sink.window"
    bind(broker, queue, "window.*")
    n = 3000
    df = spark.range(n).selectExpr(
        "CASE WHEN id % 1000 = 7 THEN 'window.été' ELSE 'window.a' END AS event",  # not ASCII: per row
        "concat('row ', cast(id AS string), ' ', repeat('x', 200)) AS data").coalesce(1)
    before = bytes_out(broker)
    # 1 KiB of unconfirmed publishes: a few rows a slice, a window bisected by bytes
    (df.write.format("mqks").mode("append").option("host", broker.host).option("port", str(broker.port))
     .option("confirmWindow", "5").option("confirmWindowBytes", "1024").option("quietConfirms", quiet).save())
    # no consumer yet: what the broker sent meanwhile went to the sink (its hello, then an `ok` a row or one sync's)
    # and to the stats line before: under 4 bytes a row (an `ok` line has 5 and its msg id) means quiet confirms, on
    # one worker and on two
    assert (bytes_out(broker) - before < 4 * n) is (quiet == "true")
    wire = broker.wire()
    try:
        consume(wire, b"c8", queue)
        got = collect_deliveries(wire, b"c8", n)
    finally:
        wire.close()
    assert sorted(int(data.split(b" ")[1]) for _, _, data in got) == list(range(n))
    assert {head for _, head, _ in got} == {b"event=window.a", "event=window.été".encode()}
    with pytest.raises(Exception) as refused:
        (spark.createDataFrame([("window.a", "two\nlines")], "event STRING, data STRING").write.format("mqks")
         .mode("append").option("host", broker.host).option("port", str(broker.port)).save())
    assert "contains a newline" in str(refused.value)


def test_plan_splits_rows_over_queues_by_depth_and_bytes_over_parts():
    from mqks.spark.source import plan_parts

    assert plan_parts({"a": 0, "b": 0}, 100, 1000, 2) == []
    assert plan_parts({"a": 300}, 100, 1000, 2) == [["a", 50, 500], ["a", 50, 500]]
    parts = plan_parts({"a": 30, "b": 10, "c": 0}, 1000, 0, 4)
    assert [(q, rows) for q, rows, _ in parts] == [("a", 10), ("a", 10), ("a", 10), ("b", 10)]  # 4 parts by depth
    assert {max_bytes for _, _, max_bytes in parts} == {0}  # no byte limit (Trigger.Once)


@pytest.mark.parametrize(("options", "message"), [
    ({"queue": "q", "maxRecordPerBatch": "5"}, "unknown option(s) maxrecordperbatch; known options: host, port"),
    ({"queue": "q", "port": "abc"}, "port='abc' is not a whole number; expected 1..65535"),
    ({"queue": "q", "port": "70000"}, "port=70000 is out of range; expected 1..65535"),
    ({"queue": "q", "maxBytesPerBatch": "10"}, "maxBytesPerBatch=10 is out of range"),
    ({"queue": "q", "leaseSeconds": "3", "idleAckSeconds": "5"}, "leaseSeconds=3 must exceed idleAckSeconds=5"),
    ({}, "exactly one of the options queue=<name> or queues="),
    ({"queues": "a b", "events": "e"}, "events binds one queue"),
])
def test_source_options_are_checked_with_their_names(options, message):
    from mqks.spark.source import SourceOptions

    with pytest.raises(ValueError) as refused:
        SourceOptions.parse({key.lower(): value for key, value in options.items()})  # Spark lower-cases them
    assert message in str(refused.value)


@pytest.mark.parametrize(("options", "message"), [
    ({"port": "abc"}, "port='abc' is not a whole number; expected 1..65535"),
    ({"port": "70000"}, "port=70000 is out of range"),
    ({"confirmwindow": "0"}, "confirmWindow=0 is out of range; expected 1..1000000"),
    ({"quietconfirms": "maybe"}, "quietConfirms='maybe' must be true or false"),
    ({"msgidprefx": "p"},
     "unknown option(s) msgidprefx; known options: host, port, seeds, tls, tlsCa, token, confirmWindow"),
])
def test_sink_options_are_checked_with_their_names(options, message):
    from mqks.spark.sink import SinkOptions

    with pytest.raises(ValueError) as refused:
        SinkOptions.parse(options)
    assert message in str(refused.value)


def test_bad_options_and_a_user_schema_fail_before_the_query_starts(spark, broker):
    with pytest.raises(Exception, match="unknown option"):
        spark.readStream.format("mqks").option("queue", "q").option("maxRecordPerBatch", "5").load()
    with pytest.raises(Exception, match="the schema is fixed"):
        (spark.readStream.format("mqks").schema("msg_id STRING").option("queue", "q")
         .option("port", str(broker.port)).load().writeStream.format("noop").start().awaitTermination(60))


@pytest.mark.timeout(300)
def test_available_now_three_runs_process_each_message_once_and_leave_it_acked(spark, broker, tmp_path):
    queue = "spark.available.now"
    bind(broker, queue, "now.e")
    ids = [f"n{i}" for i in range(5000)]
    publish(broker, [(m, "now.e", "x") for m in ids])
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    batches = []
    for _ in range(3):
        query = (mqks_stream(spark, broker, queue, maxRecordsPerBatch="1000").writeStream.format("parquet")
                 .option("path", str(out)).option("checkpointLocation", str(checkpoint))
                 .trigger(availableNow=True).start())
        assert query.awaitTermination(120), "an AvailableNow run did not end"
        batches.append([p["numInputRows"] for p in query.recentProgress])
        assert queue_depths(broker, queue) == (0, 0)  # acked when the run ends, not by the next run
    rows = spark.read.parquet(str(out)).select("msg_id").collect()
    print(f"AvailableNow: batches per run {batches}")
    assert sorted(r.msg_id for r in rows) == sorted(ids)  # each message once
    assert batches[0][:5] == [1000] * 5 and sum(batches[0]) == 5000
    assert sum(batches[1]) == sum(batches[2]) == 0


@pytest.mark.timeout(300)
def test_messages_larger_than_the_byte_limit_flow_in_bounded_batches(spark, make_broker):
    server = make_broker("--eval", "--max-line-bytes", str(4 << 20))
    queue = "spark.large"
    bind(server, queue, "large.e")
    big = "b" * (1 << 20)
    wire = server.wire()
    try:
        wire.send(b"huge publish large.e " + b"h" * (3 << 20))  # larger than the whole batch limit
        for i in range(40):
            wire.send(f"l{i} publish large.e {big}".encode())
        assert wire.barrier() == []
    finally:
        wire.close()
    stream = mqks_stream(spark, server, queue, maxBytesPerBatch=str(4 << 20), idleAckSeconds="1")
    query = stream.selectExpr("msg_id", "length(data) AS size").writeStream.format("memory").queryName(
        "spark_large").start()
    try:
        eventually(lambda: spark.sql("select count(*) from spark_large").first()[0] >= 41, "41 large rows")
        eventually(lambda: queue_depths(server, queue) == (0, 0), "the queue to drain")
    finally:
        query.stop()
    sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    print(f"1 MiB messages with maxBytesPerBatch=4 MiB: rows per batch {sizes}")
    # two partitions of 2 MiB each: the 3 MiB message went alone in one (instead of blocking the queue),
    # two 1 MiB messages in the other; later batches hold at most two 1 MiB messages per partition
    assert sizes[0] <= 3 and max(sizes) <= 4
    got = dict(spark.sql("select msg_id, size from spark_large").collect())
    assert got.pop("huge") == 3 << 20 and got == {f"l{i}": 1 << 20 for i in range(40)}


@ON_BOTH
def test_several_queues_and_masks_in_one_source_with_a_queue_column(spark, broker):
    bind(broker, "spark.multi.a", "multi.a")
    bind(broker, "spark.multi.b", "multi.b")
    bind(broker, "spark.other", "multi.other")
    publish(broker, [(f"a{i}", "multi.a", "x") for i in range(30)] + [(f"b{i}", "multi.b", "y") for i in range(20)]
            + [(f"o{i}", "multi.other", "z") for i in range(10)])
    reader = (spark.readStream.format("mqks").option("port", str(broker.port))
              .option("queues", "spark.multi.*, spark.other").option("idleAckSeconds", "1").load())
    query = reader.writeStream.format("memory").queryName("spark_multi").start()
    try:
        eventually(lambda: spark.sql("select count(*) from spark_multi").first()[0] >= 60, "60 rows")
        eventually(lambda: queue_depths(broker, "spark.multi.a") == (0, 0) == queue_depths(broker, "spark.other"),
                   "the queues to drain")
    finally:
        query.stop()
    by_queue = dict(spark.sql("select queue, count(*) from spark_multi group by queue").collect())
    assert by_queue == {"spark.multi.a": 30, "spark.multi.b": 20, "spark.other": 10}


@pytest.mark.timeout(240)
def test_example_pipeline_publishes_the_last_window_after_events_stop(broker, tmp_path):
    counts_queue = "spark.counts.printer"
    bind(broker, counts_queue, "stats.events.counted")
    log = tmp_path / "pipeline.log"
    cmd = [
        str(HERE.parent / "pipelines" / "event_counts.py"),
        "--port", str(broker.port), "--queue", "spark.pipeline", "--events", "page.*",
        "--window", "2 seconds", "--watermark", "1 second", "--trigger", "1 second", "--heartbeat-seconds", "0.5",
        "--checkpoint", str(tmp_path / "checkpoint"), "--run-seconds", "200",
    ]
    job = _spark_process(cmd, log)
    wire = broker.wire()
    try:
        consume(wire, b"c4", counts_queue)
        # the pipeline binds its queue before Spark starts: events published from then on are counted
        eventually(lambda: _queue_exists(broker, "spark.pipeline") or job.poll() is not None,
                   "the pipeline to bind its queue")
        publish(broker, [(f"v{i}", "page.viewed", "{}") for i in range(300)])
        # no event is published after these: only the pipeline's heartbeats can close their window
        counted = 0
        while counted < 300:
            assert job.poll() is None, log.read_text()[-3000:]
            line = wire.recv_line(timeout=180.0)
            _msg_id, head, data = line[len(b"c4 ok ") :].split(b" ", 2)
            assert head == b"event=stats.events.counted", line
            count = json.loads(data)
            assert set(count) == {"window_start", "window_end", "event", "count"}, count
            assert count["event"] == "page.viewed", count  # heartbeats are never counted
            counted += count["count"]
        assert counted == 300
    finally:
        wire.close()
        _kill_group(job)


def _queue_exists(broker, queue: str) -> bool:
    return queue_row(broker, queue) is not None


@pytest.mark.timeout(300)
def test_spark_submit_recipe_works_where_mqks_is_not_installed(broker, tmp_path):
    """The README's `spark-submit` recipe, with a Python that has pyspark and pyarrow but no mqks."""
    import sysconfig

    bare = tmp_path / "bare"  # a cluster node's Python: the job's dependencies, not mqks
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    bare_python = bare / "bin" / "python"
    ask_site = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    bare_site = Path(subprocess.run([str(bare_python), "-c", ask_site], check=True, capture_output=True,
                                    text=True).stdout.strip())
    # a plain path line: the directory's own .pth files (mqks's editable install) are not read
    (bare_site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    missing = subprocess.run([str(bare_python), "-c", "import mqks"], capture_output=True, text=True)
    assert "No module named 'mqks'" in missing.stderr

    # the recipe: mqks as plain files, a regular package (zipimport cannot import namespace packages), zipped
    repo = HERE.parent
    pyfiles, dist = tmp_path / "build" / "pyfiles", tmp_path / "dist"
    # MQKS_COMPILE=0: a zip loads no compiled module, and compiling them took half a minute of this test
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(pyfiles), str(repo)],
                   check=True, capture_output=True, env=dict(os.environ, MQKS_COMPILE="0"))
    assert not list(pyfiles.rglob("*.so")), "MQKS_COMPILE=0 compiled something"
    (pyfiles / "mqks" / "__init__.py").touch()
    dist.mkdir()
    subprocess.run([sys.executable, "-m", "zipfile", "-c", str(dist / "mqks.zip"), "mqks"], cwd=pyfiles, check=True)

    counts_queue = "spark.submit.counts"
    bind(broker, counts_queue, "stats.events.counted")
    log = tmp_path / "submit.log"
    env = dict(os.environ, PYSPARK_PYTHON=str(bare_python), PYSPARK_DRIVER_PYTHON=str(bare_python),
               SPARK_LOCAL_IP="127.0.0.1", PYTHONPATH=str(dist / "mqks.zip"))
    submit = Path(sys.executable).parent / "spark-submit"
    cmd = [str(submit), "--master", "local-cluster[1,1,1024]", "--conf", "spark.ui.enabled=false",
           "--py-files", str(dist / "mqks.zip"), str(repo / "pipelines" / "event_counts.py"),
           "--port", str(broker.port), "--queue", "spark.submit", "--events", "page.*", "--window", "2 seconds",
           "--watermark", "1 second", "--trigger", "1 second", "--heartbeat-seconds", "0.5",
           "--checkpoint", str(tmp_path / "checkpoint"), "--run-seconds", "250"]
    with open(log, "ab") as log_file:
        job = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    wire = broker.wire()
    try:
        consume(wire, b"c5", counts_queue)
        eventually(lambda: _queue_exists(broker, "spark.submit") or job.poll() is not None,
                   "the pipeline to bind its queue", 150)
        assert job.poll() is None, log.read_text()[-3000:]
        publish(broker, [(f"sub{i}", "page.viewed", "{}") for i in range(50)])
        counted = 0
        while counted < 50:
            assert job.poll() is None, log.read_text()[-3000:]
            line = wire.recv_line(timeout=180.0)
            counted += json.loads(line.split(b" ", 4)[4])["count"]
        assert counted == 50
    finally:
        wire.close()
        _kill_group(job)


def test_a_broker_away_longer_than_reconnect_seconds_fails_with_the_option_named():
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from mqks.spark.line_client import MqksConnectionError
    from mqks.spark.source import MqksStreamReader, SourceOptions, source_struct

    options = SourceOptions.parse({"port": str(free_port()), "queue": "q", "reconnectSeconds": "1"})
    reader = MqksStreamReader(options, source_struct())
    with pytest.raises(MqksConnectionError, match=r"unreachable for 1s \(reconnectSeconds\)"):
        reader.latestOffset(reader.initialOffset(), ReadMaxRows(10))


def test_the_driver_asks_again_while_a_worker_restarts_instead_of_failing_the_query(make_broker, caplog):
    """A settle (every worker) refused with "worker N is restarting" is sent again once it is back, as after a
    lost connection (CI: a commit failed the query during a cluster failover)."""
    from conftest import child_pids

    from mqks.spark.options import Endpoint
    from mqks.spark.source import Control

    server = make_broker("--workers", "2")
    victim = max(child_pids(server.proc.pid))
    # the supervisor, stopped, cannot restart the worker: the window stays open until SIGCONT (a restart takes
    # 0.2 s here, which a loaded machine's polls can miss)
    server.signal(signal.SIGSTOP)
    try:
        os.kill(victim, signal.SIGKILL)

        def refused_meanwhile() -> bool:
            try:  # a fresh connection each time: one accepted by the killed worker is reset
                wire = server.wire()
                try:
                    wire.send(b"s settle nothing-held --ack")
                    answer = wire.recv_line()
                finally:
                    wire.close()
            except OSError:
                return False
            assert answer == b"s ok 0" or b"is restarting" in answer, answer
            return b"is restarting" in answer
        wait_for(refused_meanwhile, "a settle refused while the worker restarts")
        control = Control(Endpoint("127.0.0.1", server.port, reconnect_seconds=30))
        answers: dict = {}
        with caplog.at_level("WARNING", logger="mqks.spark"):
            asking = threading.Thread(target=lambda: answers.update(control.call([("settle", "nothing-held --ack")])))
            asking.start()
            wait_for(lambda: "is restarting" in caplog.text, "the driver refused while the worker restarts")
            assert asking.is_alive()  # it asks again rather than failing the query
    finally:
        server.signal(signal.SIGCONT)
    asking.join(60)
    assert not asking.is_alive()
    control.close()
    assert [data for data in answers.values()] == [[b"0"]]


def test_sink_and_source_over_tls_with_a_token(spark, make_broker, tmp_path):
    from helpers import free_port, unique
    from tls_certs import make_certs

    from mqks.spark.source import MqksStreamReader, SourceOptions, source_struct

    certs = make_certs(tmp_path)
    token = "spark-s3cret-token"
    (tmp_path / "tokens").write_text(token + "\n")
    tls_port = free_port()
    server = make_broker("--eval", *certs.server_args(tls_port), "--auth-token-file", str(tmp_path / "tokens"))
    security = {"tls": "true", "tlsCa": certs.ca, "token": token}
    out_queue, in_queue = unique("spark.tls.out"), unique("spark.tls.in")
    wire = server.wire()  # the plain port: a token is needed there too
    try:
        wire.send(b"a auth " + token.encode())
        wire.expect(b"a ok ")
        wire.send(b"rb rebind --confirm %s tls.out" % out_queue.encode(),
                  b"rb2 rebind --confirm %s tls.in" % in_queue.encode())
        wire.expect(b"rb ok ")
        wire.expect(b"rb2 ok ")
        consume(wire, b"c1", out_queue)
        writer = spark.range(50).selectExpr("'tls.out' as event", "cast(id as string) as data").write.format("mqks")
        writer = writer.mode("append").option("host", "localhost").option("port", str(tls_port))
        for key, value in security.items():
            writer = writer.option(key, value)
        writer.save()
        assert sorted(int(data) for _, _, data in collect_deliveries(wire, b"c1", 50)) == list(range(50))

        wire.send(*(b"s%d publish tls.in x%d" % (i, i) for i in range(10)))
        assert wire.barrier() == []
        reader = MqksStreamReader(SourceOptions.parse({"host": "localhost", "port": str(tls_port), "queue": in_queue,
                                                       **security}), source_struct())
        try:
            from pyspark.sql.streaming.datasource import ReadMaxRows

            start = reader.initialOffset()
            end = reader.latestOffset(start, ReadMaxRows(10))
            rows = [msg_id for msg_id, _ in _read(reader, reader.partitions(start, end))]
            assert rows == [f"s{i}" for i in range(10)]  # fetched by the "executor" over TLS with the token
            reader.commit(end)
            wait_for(lambda: (row := queue_row_on(wire, in_queue)) and (row["depth"], row["unacked"] + row["leased"])
                     == (0, 0), "the acks over TLS")
        finally:
            reader.stop()
    finally:
        wire.close()
    assert token not in server.log()


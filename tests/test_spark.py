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
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import eval_value, wait_for

pytest.importorskip("pyspark", reason="pyspark is not installed: pip install -e '.[spark]'")
pytest.importorskip("pyarrow", reason="pyarrow is not installed: pip install -e '.[spark]'")

pytestmark = pytest.mark.spark

HERE = Path(__file__).resolve().parent
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


def queue_depths(broker, queue: str) -> tuple[int, int]:
    """(messages waiting, messages un-acked) of one queue, read from the server's state."""
    return eval_value(
        broker,
        "(lambda q: (q.depth(), sum(len(c.unacked) for c in q.consumers)) if q else (0, 0))"
        f"(state.queues.get({queue.encode()!r}))",
    )


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
    query_prefix = query.id[:8].encode()
    for msg_id, _, _ in got:
        prefix, batch, partition, row = msg_id.split(b".")
        assert prefix == query_prefix and batch.isdigit() and partition.isdigit() and row.isdigit(), msg_id


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


def _spark_process(cmd: list[str], log: Path) -> subprocess.Popen:
    """A Python script that starts its own Spark, logging to `log`; stop it with `_kill_group`."""
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    with open(log, "ab") as log_file:
        # its own process group: SIGKILL takes the JVM and the Python workers with it
        return subprocess.Popen([sys.executable, *cmd], stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _run_job(broker, queue: str, checkpoint: Path, out: Path, log: Path, block_batch: int | None) -> subprocess.Popen:
    cmd = [
        str(HERE / "spark_failure_job.py"),
        "--port", str(broker.port), "--queue", queue,
        "--checkpoint", str(checkpoint), "--out", str(out), "--max-records-per-batch", "100",
    ]
    if block_batch is not None:
        cmd += ["--block-batch", str(block_batch)]
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
def test_killed_query_restarts_from_checkpoint_without_loss(broker, tmp_path):
    queue = "spark.crash"
    bind(broker, queue, "crash.e")
    ids = [f"k{i}" for i in range(1000)]
    publish(broker, [(m, "crash.e", "x") for m in ids])
    checkpoint, out, log = tmp_path / "checkpoint", tmp_path / "out", tmp_path / "job.log"

    first = _run_job(broker, queue, checkpoint, out, log, block_batch=3)
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

    second = _run_job(broker, queue, checkpoint, out, log, block_batch=None)
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


def _reader(broker, queue: str, **options: str):
    """The stream reader without Spark: the calls Spark's driver-side runner makes, made by hand."""
    from mqks.spark.source import MqksStreamReader, SourceOptions

    options = {"host": broker.host, "port": str(broker.port), "queue": queue, **options}
    return MqksStreamReader(SourceOptions.parse(options), None)


def test_reader_ignores_offsets_of_another_session(broker):
    from pyspark.sql.streaming.datasource import ReadMaxRows

    queue = "spark.sessions"
    bind(broker, queue, "sessions.e")
    publish(broker, [(f"s{i}", "sessions.e", "x") for i in range(10)])
    reader = _reader(broker, queue)
    try:
        start = reader.initialOffset()
        end = eventually(lambda: (lambda e: e if e != start else None)(reader.latestOffset(start, ReadMaxRows(10))),
                       "10 deliveries")
        assert end["seq"] == 10 and end["session"] == reader.session
        earlier_run = {"session": "an-earlier-run", "seq": 10, "tick": 0}
        # a batch re-run or a commit from an earlier run: no rows, no acks
        assert reader.partitions({"session": "an-earlier-run", "seq": 4, "tick": 0}, earlier_run) == []
        reader.commit(earlier_run)
        assert queue_depths(broker, queue) == (0, 10)
        partitions = reader.partitions(start, end)
        assert sum(len(p.msg_ids) for p in partitions) == 10
        assert len(partitions) == 2  # numPartitions defaults to 2
        reader.commit(end)
        assert queue_depths(broker, queue) == (0, 0)
    finally:
        reader.stop()


def test_reader_starts_a_new_session_when_the_broker_restarts(make_broker):
    from pyspark.sql.streaming.datasource import ReadMaxRows

    server = make_broker("--eval")
    queue = "spark.restart"
    bind(server, queue, "restart.e")
    publish(server, [("r1", "restart.e", "x")])
    reader = _reader(server, queue)
    try:
        start = reader.initialOffset()
        end = eventually(lambda: (lambda e: e if e != start else None)(reader.latestOffset(start, ReadMaxRows(10))),
                       "a delivery")
        server.kill()
        server.restart()
        bind(server, queue, "restart.e")
        publish(server, [("r2", "restart.e", "y")])
        # the batch planned before the restart now belongs to a dead session
        after = eventually(lambda: (lambda e: e if e != end else None)(reader.latestOffset(end, ReadMaxRows(10))),
                         "a delivery after the restart")
        assert after["session"] != end["session"] and after["seq"] == 1
        assert reader.partitions(start, end) == []
        rows = [m for p in reader.partitions(end, after) for m in p.msg_ids]
        assert rows == [b"r2"]
        reader.commit(end)  # the dead session's commit acks nothing and does not fail
        reader.commit(after)
        assert queue_depths(server, queue) == (0, 0)
    finally:
        reader.stop()


def test_prefetch_must_exceed_max_records_per_batch():
    from mqks.spark.source import SourceOptions

    with pytest.raises(ValueError, match="prefetch"):
        SourceOptions.parse({"queue": "q", "maxRecordsPerBatch": "100", "prefetch": "100"})
    assert SourceOptions.parse({"queue": "q", "maxRecordsPerBatch": "100"}).prefetch == 200


@pytest.mark.timeout(240)
def test_example_pipeline_publishes_window_counts(broker, tmp_path):
    counts_queue = "spark.counts.printer"
    bind(broker, counts_queue, "stats.events.counted")
    log = tmp_path / "pipeline.log"
    cmd = [
        str(HERE.parent / "pipelines" / "event_counts.py"),
        "--port", str(broker.port), "--queue", "spark.pipeline", "--events", "page.* tick.*",
        "--window", "2 seconds", "--watermark", "1 second", "--trigger", "1 second",
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
        counted = 0
        deadline = time.monotonic() + 180
        ticks = 0
        while counted < 300:
            assert job.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"counted {counted} of 300; {log.read_text()[-3000:]}"
            # later events move the watermark, so that append mode emits the finished windows
            publish(broker, [(f"t{ticks}", "tick.now", "{}")])
            ticks += 1
            try:
                line = wire.recv_line(timeout=1.0)
            except TimeoutError:
                continue
            _msg_id, head, data = line[len(b"c4 ok ") :].split(b" ", 2)
            assert head == b"event=stats.events.counted", line
            count = json.loads(data)
            assert set(count) == {"window_start", "window_end", "event", "count"}, count
            if count["event"] == "page.viewed":
                counted += count["count"]
        assert counted == 300
    finally:
        wire.close()
        _kill_group(job)


def _queue_exists(broker, queue: str) -> bool:
    return eval_value(broker, f"{queue.encode()!r} in state.queues")


def test_sink_and_source_over_tls_with_a_token(spark, make_broker, tmp_path):
    from helpers import free_port, unique
    from tls_certs import make_certs

    from mqks.spark.source import MqksStreamReader, SourceOptions

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
                                                       **security}), None)
        try:
            from pyspark.sql.streaming.datasource import ReadMaxRows

            start = reader.initialOffset()
            end = eventually(lambda: (lambda e: e if e["seq"] >= 10 else None)(
                reader.latestOffset(start, ReadMaxRows(10))), "10 deliveries over TLS")
            rows = [m for p in reader.partitions(start, end) for m in p.msg_ids]
            assert rows == [b"s%d" % i for i in range(10)]
            reader.commit(end)
            wait_for(lambda: b"ok (0, 0)" in eval_on_authenticated(wire, in_queue), "the acks over TLS")
        finally:
            reader.stop()
    finally:
        wire.close()
    assert token not in server.log()


def eval_on_authenticated(wire, queue: str) -> bytes:
    wire.send(b"ev _eval (lambda q: (q.depth(), sum(len(c.unacked) for c in q.consumers)))(state.queues[%r])"
              % queue.encode())
    return wire.recv_line()

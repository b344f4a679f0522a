"""The `mqks` streaming source: a driver-side manual-ack consumer that acks on Spark's commit.

Flow: latestOffset() reads deliveries off one blocking socket into a buffer and numbers them
(`seq`); partitions() ships the rows of (start, end] inside the partitions, so executors never
touch the network; commit(end) acks every row up to `end` with batch ack lines and waits for the
confirm. Invariants (at-least-once):
- a message is acked only after Spark committed the batch that held it;
- offsets carry a session id: a commit or a batch re-run from another session (an earlier run,
  or before a reconnect) acks nothing and yields no rows; those messages come back by redelivery;
- nothing connects in __init__: the constructor also runs in Spark's planner process.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit, ReadMaxRows
from pyspark.sql.types import StructType

from mqks.client.wire import answer_error, consume_line, encode_token, is_update, split_answer, split_header_fields
from mqks.spark.line_client import LineClient, MqksConnectionError, MqksError, Security

log = logging.getLogger("mqks.spark")

SOURCE_SCHEMA = "msg_id STRING, event STRING, data STRING, retry INT, queue STRING, received_at TIMESTAMP"
POLL_SECONDS = 0.05  # the longest latestOffset() waits for a first delivery: keeps an idle query cheap
ACK_TIMEOUT_SECONDS = 60.0
ACK_LINE_BYTES = 60_000  # far below the server's default --max-line-bytes (1 MiB)
CONNECT_ATTEMPTS = 5
ARROW_BATCH_ROWS = 10_000


def _option(options: Mapping[str, str], name: str, default: str | None = None) -> str | None:
    value = options.get(name)
    return default if value is None or value == "" else str(value)


def _int_option(options: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = _option(options, name, str(default))
    try:
        value = int(raw)  # type: ignore[arg-type]
    except ValueError:
        raise ValueError(f"mqks option {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"mqks option {name}={value} must be >= {minimum}")
    return value


@dataclass(frozen=True, slots=True)
class SourceOptions:
    """The reader's options, checked once on the driver."""

    host: str
    port: int
    security: Security  # tls, tlsCa, token
    queue: str
    events: tuple[str, ...]
    max_records_per_batch: int
    prefetch: int
    num_partitions: int
    idle_ack_seconds: float

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        queue = _option(options, "queue")
        if queue is None:
            raise ValueError("mqks source needs option queue=<name>")
        encode_token(queue, "mqks option queue", dashes_ok=True)
        events = tuple((_option(options, "events", "") or "").replace(",", " ").split())
        max_records = _int_option(options, "maxRecordsPerBatch", 10_000, 1)
        prefetch = _int_option(options, "prefetch", 2 * max_records, 1)
        if prefetch <= max_records:
            # batch N+1 must be able to form while batch N is still un-acked (commits are lazy)
            raise ValueError(f"mqks option prefetch={prefetch} must exceed maxRecordsPerBatch={max_records}")
        idle = _option(options, "idleAckSeconds", "5")
        try:
            idle_seconds = float(idle)  # type: ignore[arg-type]
        except ValueError:
            raise ValueError(f"mqks option idleAckSeconds={idle!r} is not a number") from None
        return cls(
            host=_option(options, "host", "127.0.0.1"),  # type: ignore[arg-type]
            port=_int_option(options, "port", 25000, 1),
            security=Security.parse(options, os.environ),
            queue=queue,
            events=events,
            max_records_per_batch=max_records,
            prefetch=prefetch,
            num_partitions=_int_option(options, "numPartitions", 2, 1),
            idle_ack_seconds=max(0.0, idle_seconds),
        )


class MqksPartition(InputPartition):
    """The rows of one slice of a micro-batch; executors only decode them."""

    def __init__(self, queue: str, msg_ids: list[bytes], bodies: list[bytes], received_at_us: list[int]) -> None:
        super().__init__(None)
        self.queue = queue
        self.msg_ids = msg_ids
        self.bodies = bodies  # b"event={event}[,retry={n}] {data}" as delivered
        self.received_at_us = received_at_us

    def __repr__(self) -> str:
        return f"MqksPartition(queue={self.queue!r}, rows={len(self.msg_ids)})"


def _strings(values: list[bytes]):
    """A pyarrow string array from UTF-8 bytes; invalid bytes become U+FFFD instead of failing the task."""
    import pyarrow as pa

    try:
        return pa.array(values, type=pa.string())
    except (pa.ArrowInvalid, UnicodeDecodeError):
        return pa.array([v.decode("utf-8", "replace") for v in values], type=pa.string())


def parse_body(body: bytes) -> tuple[bytes, int, bytes]:
    """`event={event}[,retry={n}] {data}` -> (event, retry, data), read as the Python client reads it."""
    head, _, data = body.partition(b" ")
    event, fields = split_header_fields(head[6:] if head.startswith(b"event=") else head)
    return event, fields.get(b"retry", 0), data


class MqksStreamReader(DataSourceStreamReader):
    """Consumes `queue` with --manual-ack --prefetch on the driver; acks a batch once Spark commits it."""

    def __init__(self, options: SourceOptions, schema: StructType) -> None:
        # no socket here: Spark also builds this object in its planner process
        self.options = options
        self.schema = schema
        self.client: LineClient | None = None
        self.session = ""
        self.consumer_id = b""
        self.delivery_prefix = b""
        self.consume_confirmed = False
        self.ack_rid_counter = 0
        self.ack_rids_waiting: set[bytes] = set()
        self._reset_buffer()

    def _reset_buffer(self) -> None:
        self.acked_seq = 0  # every seq <= acked_seq was acked (or belongs to a dead connection)
        self.received_seq = 0  # msg_ids[i] holds seq acked_seq + 1 + i
        self.msg_ids: list[bytes] = []
        self.bodies: list[bytes] = []
        self.received_at_us: list[int] = []
        self.last_planned_at = time.monotonic()  # when the last batch with rows was handed to Spark

    def __getstate__(self) -> dict:
        # the planner pickles this reader for read(); never ship a socket or a buffer
        return {"options": self.options, "schema": self.schema}

    def __setstate__(self, state: dict) -> None:
        MqksStreamReader.__init__(self, state["options"], state["schema"])

    def initialOffset(self) -> dict:
        return {"session": "", "seq": 0, "tick": 0}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.options.max_records_per_batch)

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        """The end of the next batch: new deliveries up to the limit, or a tick to flush idle acks."""
        self._ensure_connected()
        cap = limit.max_rows if isinstance(limit, ReadMaxRows) else self.options.prefetch
        self._pump(int(start.get("seq", 0)) if start.get("session") == self.session else 0, cap)
        own = start.get("session") == self.session  # after _pump: a reconnect starts a new session
        base = int(start.get("seq", 0)) if own else 0
        tick = int(start.get("tick", 0)) if own else 0
        end = min(self.received_seq, base + cap)
        now = time.monotonic()
        if end > base:
            self.last_planned_at = now
            return {"session": self.session, "seq": end, "tick": tick}
        if own and self.acked_seq < base and now - self.last_planned_at >= self.options.idle_ack_seconds:
            # An empty batch makes Spark commit the previous one: the last batch before a quiet
            # period gets acked too (Spark commits a source only while planning the next batch).
            self.last_planned_at = now
            return {"session": self.session, "seq": base, "tick": tick + 1}
        return start

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        """The rows of (start, end] split into numPartitions; none for another session's batch."""
        if end.get("session") != self.session or self.client is None:
            # a batch planned by an earlier run or connection: the broker has redelivered its rows
            log.info("mqks: batch %s..%s is from another session; its messages come back by redelivery", start, end)
            return []
        first = int(start.get("seq", 0)) if start.get("session") == self.session else 0
        last = int(end["seq"])
        if first < self.acked_seq:
            log.warning("mqks: rows %d..%d were acked already; planning from %d", first, self.acked_seq, self.acked_seq)
            first = self.acked_seq
        lo, hi = first - self.acked_seq, last - self.acked_seq
        count = hi - lo
        if count <= 0:
            return []
        parts = min(self.options.num_partitions, count)
        step, extra = divmod(count, parts)
        partitions: list[InputPartition] = []
        i = lo
        for p in range(parts):
            j = i + step + (1 if p < extra else 0)
            partitions.append(
                MqksPartition(self.options.queue, self.msg_ids[i:j], self.bodies[i:j], self.received_at_us[i:j])
            )
            i = j
        return partitions

    def read(self, partition: InputPartition) -> Iterator:
        """Runs on executors: decode the shipped rows into Arrow batches; no network."""
        import pyarrow as pa
        from pyspark.sql.pandas.types import to_arrow_schema

        assert isinstance(partition, MqksPartition)
        arrow_schema = to_arrow_schema(self.schema, timezone="UTC")
        names = self.schema.fieldNames()
        total = len(partition.msg_ids)
        for lo in range(0, total, ARROW_BATCH_ROWS):
            hi = min(total, lo + ARROW_BATCH_ROWS)
            events, retries, data = [], [], []
            for body in partition.bodies[lo:hi]:
                event, retry, payload = parse_body(body)
                events.append(event)
                retries.append(retry)
                data.append(payload)
            columns = {
                "msg_id": _strings(partition.msg_ids[lo:hi]),
                "event": _strings(events),
                "data": _strings(data),
                "retry": pa.array(retries, type=pa.int32()),
                "queue": pa.array([partition.queue] * (hi - lo), type=pa.string()),
                "received_at": pa.array(partition.received_at_us[lo:hi], type=pa.timestamp("us", tz="UTC")),
            }
            yield pa.RecordBatch.from_arrays([columns[name] for name in names], schema=arrow_schema)

    def commit(self, end: dict) -> None:
        """Ack every row up to `end` (batch ack lines, confirmed); ignore another session's offsets."""
        if end.get("session") != self.session or self.client is None:
            log.info("mqks: commit %s is from another session; nothing to ack", end)
            return
        upto = min(int(end["seq"]), self.received_seq)
        count = upto - self.acked_seq
        if count <= 0:
            return
        ids = self.msg_ids[:count]
        try:
            self._ack(ids)
        except MqksConnectionError as e:
            # the connection died: the server has requeued these rows; a new session starts next batch
            log.warning("mqks: could not ack %d messages (%s); they will be redelivered", count, e)
            return
        del self.msg_ids[:count], self.bodies[:count], self.received_at_us[:count]
        self.acked_seq = upto

    def stop(self) -> None:
        """Best effort: Spark usually kills this process instead; the broker requeues on disconnect."""
        self._drop_client()

    def _ensure_connected(self) -> None:
        if self.client is not None:
            return
        last_error: Exception | None = None
        for attempt in range(CONNECT_ATTEMPTS):
            try:
                self._connect()
                return
            except (OSError, MqksConnectionError) as e:
                last_error = e
                self._drop_client()
                time.sleep(min(2.0, 0.2 * 2**attempt))
            except MqksError:
                self._drop_client()  # the broker refused the consume: no point retrying
                raise
        raise MqksConnectionError(
            f"mqks source cannot consume {self.options.queue} at {self.options.host}:{self.options.port}: {last_error}"
        )

    def _connect(self) -> None:
        """A new connection is a new session: a fresh consumer and an empty buffer."""
        options = self.options
        self._reset_buffer()
        self.session = uuid.uuid4().hex
        self.consumer_id = f"spark.{self.session[:12]}".encode()
        self.delivery_prefix = self.consumer_id + b" ok "
        self.consume_confirmed = False
        self.ack_rids_waiting.clear()
        self.client = LineClient(options.host, options.port, security=options.security)
        events = [event.encode() for event in options.events]
        # --add keeps the queue's other bindings; never --delete-queue-when-unused: a Spark restart
        # would lose the queue
        line = consume_line(self.consumer_id, options.queue.encode(), events, add=True, confirm=True, manual_ack=True,
                            delete_queue_when_unused=None, prefetch=options.prefetch)
        self.client.send([line])
        deadline = time.monotonic() + ACK_TIMEOUT_SECONDS
        while not self.consume_confirmed:
            if time.monotonic() > deadline:
                raise MqksConnectionError(f"mqks: no confirm for consume on {options.queue}")
            self._handle(self.client.read_lines(1.0))
        log.info("mqks: session %s consumes %s (prefetch %d)", self.session, options.queue, options.prefetch)

    def _drop_client(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def _pump(self, base: int, cap: int) -> None:
        """Read deliveries: wait a little only if nothing new is buffered; stop once `cap` is reached."""
        assert self.client is not None
        wait = 0.0 if self.received_seq > base else POLL_SECONDS
        try:
            lines = self.client.read_lines(wait)
            while lines:
                self._handle(lines)
                if self.received_seq - base >= cap:
                    return
                lines = self.client.read_lines(0.0)
        except MqksConnectionError as e:
            # rows already handed to Spark stay in partitions; the broker requeues the rest
            log.warning("mqks: connection lost (%s); reconnecting with a new session", e)
            self._drop_client()
            self._ensure_connected()

    def _handle(self, lines: list[bytes]) -> None:
        """Buffer deliveries, note confirms; raise on an error answer."""
        prefix = self.delivery_prefix
        cut = len(prefix)
        now_us = int(time.time() * 1_000_000)
        for line in lines:
            if line.startswith(prefix):
                rest = line[cut:]
                if not rest:
                    self.consume_confirmed = True
                elif not is_update(rest):
                    msg_id, _, body = rest.partition(b" ")
                    self.msg_ids.append(msg_id)
                    self.bodies.append(body)
                    self.received_at_us.append(now_us)
                    self.received_seq += 1
                continue
            rid, status, data = split_answer(line)
            if status == b"ok":
                if rid in self.ack_rids_waiting:
                    self.ack_rids_waiting.discard(rid)
                elif rid == self.consumer_id:
                    self.consume_confirmed = True
                continue
            if status == b"error":
                raise answer_error(rid, data, f"mqks answered {rid.decode(errors='replace')}: ")
            log.warning("mqks: unexpected line %r", line[:200])

    def _ack(self, msg_ids: list[bytes]) -> None:
        """Pipeline `ack --confirm {cid} id...` lines and wait for every confirm."""
        assert self.client is not None
        head_bytes = len(self.consumer_id) + 32
        lines: list[bytes] = []
        chunk: list[bytes] = []
        size = head_bytes
        for msg_id in msg_ids:
            if chunk and size + len(msg_id) + 1 > ACK_LINE_BYTES:
                lines.append(self._ack_line(chunk))
                chunk, size = [], head_bytes
            chunk.append(msg_id)
            size += len(msg_id) + 1
        if chunk:
            lines.append(self._ack_line(chunk))
        try:
            self.client.send(lines)
            deadline = time.monotonic() + ACK_TIMEOUT_SECONDS
            while self.ack_rids_waiting:
                if time.monotonic() > deadline:
                    raise MqksConnectionError(f"mqks: no ack confirm within {ACK_TIMEOUT_SECONDS}s")
                self._handle(self.client.read_lines(1.0))
        except MqksConnectionError:
            self._drop_client()
            raise

    def _ack_line(self, msg_ids: list[bytes]) -> bytes:
        self.ack_rid_counter += 1
        rid = b"ack.%d" % self.ack_rid_counter
        self.ack_rids_waiting.add(rid)
        return b"%s ack --confirm %s %s" % (rid, self.consumer_id, b" ".join(msg_ids))

"""The `mqks` sink: every row becomes `{msg_id} publish --confirm-quiet {event} {data}` (or `--confirm`).

Runs in executor tasks (write(), an Arrow writer: a record batch's lines are built by Arrow's kernels,
never a Python object per row) and the driver (commit/abort). Each task opens its own connection. On a
broker whose `hello` lists `confirm_quiet` (one worker process, or --workers N; not a cluster's node) its
publishes are answered only when refused, and one `sync` at the end of the task answers once all are stored
(on every worker that got a copy); elsewhere it keeps at most
`confirmWindow` publishes and `confirmWindowBytes` unconfirmed and waits for every `ok`. Either way it
returns its commit message only once every row is confirmed, and fails with the server's reason on an
`error`. Guarantee: at-least-once. A retried task or a re-run batch publishes again under the same deterministic msg ids
`{query or msgIdPrefix}.{batch}.{partition}.{row}`.
"""

from __future__ import annotations

import datetime
import decimal
import logging
import time
import uuid
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pyspark.sql import Row
from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from mqks.client.wire import answer_error, encode_token, hello_info, split_answer
from mqks.spark.line_client import LineClient, MqksConnectionError, Security, connect_any
from mqks.spark.options import (
    check_known,
    host_option,
    int_option,
    lowered,
    port_option,
    security_option,
    seeds_option,
    text_option,
)

try:
    import ujson as _json  # the server's own dependency; escapes newlines as json does
except ImportError:  # a cluster node without ujson still works
    import json as _json  # type: ignore[no-redef]

log = logging.getLogger("mqks.spark")

CONFIRM_TIMEOUT_SECONDS = 60.0
HELLO_RID = b"sink.hello"
QUIET_SLICE_ROWS = 5_000  # quiet publishes go in slices this big (and QUIET_SLICE_BYTES), each a send
QUIET_SLICE_BYTES = 1 << 20
SYNC_RID = b"sink.sync"
CONFIRMED = " publish --confirm "
CONFIRMED_QUIETLY = " publish --confirm-quiet "  # answered only when refused; a `sync` answers for all


SINK_OPTIONS = ("host", "port", "seeds", "tls", "tlsCa", "token", "confirmWindow", "confirmWindowBytes", "msgIdPrefix",
                "quietConfirms")


@dataclass(frozen=True, slots=True)
class SinkOptions:
    """The writer's options, checked once on the driver."""

    host: str
    port: int
    security: Security  # tls, tlsCa, token
    confirm_window: int
    confirm_window_bytes: int
    msg_id_prefix: str | None
    seeds: tuple[tuple[str, int], ...] = ()  # tried in turn after host:port (a cluster's other nodes)
    quiet_confirms: bool = True  # quiet publishes and one sync where the broker takes them; False: an ok each

    def addresses(self) -> list[tuple[str, int]]:
        return [(self.host, self.port), *(seed for seed in self.seeds if seed != (self.host, self.port))]

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SinkOptions:
        options = lowered(options)
        check_known(options, SINK_OPTIONS, "sink")
        prefix = text_option(options, "msgIdPrefix")
        if prefix is not None:
            encode_token(prefix, "mqks option msgIdPrefix", dashes_ok=True)
        quiet = (text_option(options, "quietConfirms") or "true").lower()
        if quiet not in ("true", "false"):
            raise ValueError(f"mqks option quietConfirms={quiet!r} must be true or false")
        return cls(
            host=host_option(options),
            port=port_option(options),
            seeds=seeds_option(options),
            security=security_option(options),
            confirm_window=int_option(options, "confirmWindow", 1000, 1, 1_000_000),
            confirm_window_bytes=int_option(options, "confirmWindowBytes", 8 << 20, 1024, 1 << 34),
            msg_id_prefix=prefix,
            quiet_confirms=quiet == "true",
        )


@dataclass(frozen=True)
class PublishedMessage(WriterCommitMessage):
    """What one task published: `count` rows, msg ids first_msg_id..last_msg_id."""

    partition_id: int
    count: int
    first_msg_id: str | None
    last_msg_id: str | None


def _jsonable(value: Any) -> Any:
    if isinstance(value, Row):
        return value.asDict(recursive=True)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def encode_data(value: Any) -> bytes:
    """A row's `data` as one line of bytes: str as is, anything else JSON (which escapes newlines)."""
    if value is None:
        return b""
    if isinstance(value, str):
        if "\n" in value:
            raise ValueError("mqks sink: a str data value contains a newline; JSON-encode it or strip it")
        return value.encode("utf-8")
    value = _jsonable(value)
    if _json.__name__ == "ujson":
        text = _json.dumps(value, ensure_ascii=False, escape_forward_slashes=False, default=_json_default)
    else:
        text = _json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=_json_default)
    return text.encode("utf-8")


class _Publisher:
    """Shared by the batch and the streaming writer: publish rows, return a commit message."""

    options: SinkOptions
    schema: StructType
    write_id: str

    def _task_prefix(self) -> tuple[str, int]:
        """(msg id prefix, partition id): `{query[:8]}.{batch}` in a stream, the write's id otherwise."""
        from pyspark import TaskContext

        context = TaskContext.get()
        partition_id = context.partitionId() if context is not None else 0
        given = self.options.msg_id_prefix
        if context is not None:
            query_id = context.getLocalProperty("sql.streaming.queryId")
            batch_id = context.getLocalProperty("streaming.sql.batchId")
            if query_id and batch_id is not None:
                # a stream: the batch id is always in the id, or every batch would repeat the same ids
                return f"{given if given is not None else query_id[:8]}.{batch_id}", partition_id
        if given is not None:
            return given, partition_id
        # df.write: the writer is built once on the driver, so retries of a task reuse this id
        return self.write_id, partition_id

    def write(self, iterator: Iterator) -> PublishedMessage:
        """Publish every row of the task's Arrow record batches; return once the broker confirmed them all.

        A batch's lines are built by Arrow's kernels into one buffer and sent in slices of at most half the
        confirm window (rows and bytes; quiet publishes: QUIET_SLICE_ROWS, QUIET_SLICE_BYTES); the confirms are
        counted in bulk. A batch with values that need
        Python (data that is not a string, an id or event that is not printable ASCII) is built row by row.
        """
        names = self.schema.fieldNames()
        if "event" not in names:
            raise ValueError(f"mqks sink needs an 'event' column; got {names}")
        prefix, partition_id = self._task_prefix()
        publisher = _Confirmed(self.options)
        count = 0
        first_msg_id = last_msg_id = None
        try:
            for batch in iterator:
                if not batch.num_rows:
                    continue
                verb = CONFIRMED_QUIETLY if publisher.connect() else CONFIRMED
                lines, (first, last) = lines_of(batch, self.schema, f"{prefix}.{partition_id}.", count, verb)
                publisher.publish(lines)
                if first_msg_id is None:
                    first_msg_id = first
                last_msg_id = last
                count += batch.num_rows
            publisher.finish()
        except MqksConnectionError:
            raise  # an OSError too, and already says what broke
        except OSError as e:
            raise MqksConnectionError(f"mqks sink {self.options.host}:{self.options.port}: {e}") from e
        finally:
            publisher.close()
        return PublishedMessage(partition_id, count, first_msg_id, last_msg_id)


# a token the Arrow path sends as it is: printable ASCII without a space (Python's \s is a wider class, so
# anything else is checked row by row by encode_token)
PLAIN_TOKEN = "^[!-~]+$"


def lines_of(batch, schema: StructType, id_prefix: str, first_row: int,
             verb: str = CONFIRMED) -> tuple[Any, tuple[str, str]]:
    """A record batch -> (its publish lines as one Arrow array, each ending in a newline; (first, last) msg id).

    `verb` is the words between the msg id and the event: CONFIRMED, or CONFIRMED_QUIETLY.

    Ids are `{id_prefix}{row}` with rows counted from `first_row`, or the `msg_id` column's where given.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    names = schema.fieldNames()
    count = batch.num_rows
    event = batch.column(names.index("event"))
    data = batch.column(names.index("data")) if "data" in names else None
    given = batch.column(names.index("msg_id")) if "msg_id" in names else None
    ids = pc.binary_join_element_wise(id_prefix, pc.cast(pc.add(_counting(count, pa), first_row), pa.string()), "")
    if given is not None and pa.types.is_string(given.type):
        ids = pc.coalesce(given, ids)
    fast = (pa.types.is_string(event.type) and (data is None or pa.types.is_string(data.type))
            and (given is None or pa.types.is_string(given.type))
            and _plain_tokens(event, pc) and (given is None or _plain_tokens(given.drop_null(), pc))
            and (data is None or not _holds_newline(data)))
    if fast:
        body = pc.fill_null(data, "") if data is not None else ""
        lines = pc.binary_join_element_wise(ids, verb, event, " ", body, "\n", "")
    else:  # the per-row path's checks, errors and JSON
        lines = pa.array([line_of(row, names, msg_id, verb)
                          for row, msg_id in zip(_rows_of(batch, schema), ids.to_pylist(), strict=True)],
                         type=pa.binary())
    return lines, (ids[0].as_py(), ids[count - 1].as_py())


def _plain_tokens(column, pc) -> bool:
    """Whether every value of a string column is a token the per-row path would send as it is."""
    if column.null_count:
        return False
    values = pc.unique(column)
    if len(values) <= 100:  # an event column holds a few events: each checked as the per-row path checks it
        try:
            for value in values.to_pylist():
                encode_token(value, "", dashes_ok=True)
        except ValueError:
            return False
        return True
    return pc.all(pc.match_substring_regex(column, PLAIN_TOKEN)).as_py()


def _holds_newline(column) -> bool:
    """Whether a string column holds a newline: one search of its bytes (a kernel per value is 10x slower)."""
    _, offsets, values = column.buffers()
    if values is None:
        return False
    bounds = memoryview(offsets).cast("i")
    start, end = bounds[column.offset], bounds[column.offset + len(column)]
    return b"\n" in values.slice(start, end - start).to_pybytes()


def line_of(row: Row, names: list[str], default_id: str, verb: str = CONFIRMED) -> bytes:
    """One row's `{msg_id} publish --confirm {event} {data}\\n` (`verb`: see lines_of), checked as the broker wants
    it."""
    given = row[names.index("msg_id")] if "msg_id" in names else None
    # a leading "--" goes through: the broker's refusal says more than a local check
    rid = encode_token(default_id if given is None else given, "mqks sink msg_id", dashes_ok=True)
    event = encode_token(row[names.index("event")], "mqks sink event", dashes_ok=True)
    data = encode_data(row[names.index("data")]) if "data" in names else b""
    return b"%s%s%s %s\n" % (rid, verb.encode(), event, data)


def _rows_of(batch, schema: StructType) -> Iterator[Row]:
    """The batch's rows as Spark hands them to a row writer (Row, dict, datetime...): the same JSON as before."""
    from pyspark.sql.conversion import ArrowTableToRowsConversion
    from pyspark.sql.types import _create_row

    fields = schema.fieldNames()
    converters = [ArrowTableToRowsConversion._create_converter(field.dataType) for field in schema.fields]
    columns = [ArrowTableToRowsConversion._to_pylist(column) for column in batch.columns]
    for i in range(batch.num_rows):
        yield _create_row(fields, [convert(column[i]) for convert, column in zip(converters, columns, strict=True)])


_COUNTING: list = []  # this process's 0, 1, 2, ... as an Arrow int64 array, grown on demand


def _counting(count: int, pa):
    if not _COUNTING or len(_COUNTING[0]) < count:
        _COUNTING[:] = [pa.array(range(max(count, 1 << 16)), type=pa.int64())]
    return _COUNTING[0].slice(0, count)


class _Confirmed:
    """One task's connection, made at its first batch: quiet publishes and one `sync` where the broker takes them,
    else lines published with at most `confirmWindow` publishes and `confirmWindowBytes` unconfirmed (a line
    larger than the byte window still goes, alone)."""

    def __init__(self, options: SinkOptions) -> None:
        self.options = options
        self.client: LineClient | None = None
        self.quiet = False  # publishes say --confirm-quiet: only refusals are answered, then the sync
        self.in_flight: deque[tuple[int, int]] = deque()  # (rows, bytes) of each slice sent, oldest first
        self.rows = 0  # sent and not confirmed
        self.bytes = 0  # of the slices not wholly confirmed
        self.confirmed = 0  # of the oldest slice's rows

    def connect(self) -> bool:
        """Connect, once; True if the lines are to be quiet publishes (the broker's `hello` lists confirm_quiet)."""
        if self.client is None:
            self.client = connect_any(self.options.addresses(), self.options.security)
            if self.options.quiet_confirms:
                self.client.send([HELLO_RID + b" hello"])
                _, status, rest = split_answer(self._answer_to(HELLO_RID))
                info = hello_info(rest) if status == b"ok" else None  # an older broker has no hello: not quiet
                self.quiet = info is not None and "confirm_quiet" in info.get("extensions", ())
        return self.quiet

    def _answer_to(self, rid: bytes) -> bytes:
        """The next line answering `rid` (read after what came before it), within CONFIRM_TIMEOUT_SECONDS."""
        assert self.client is not None
        deadline = time.monotonic() + CONFIRM_TIMEOUT_SECONDS
        prefix = rid + b" "
        while time.monotonic() < deadline:
            for line in self.client.read_lines(1.0):
                if line.startswith(prefix):
                    return line
                _raise_refusal(line)
        raise MqksConnectionError(f"mqks sink: no answer to {rid.decode()} within {CONFIRM_TIMEOUT_SECONDS}s")

    def publish(self, lines) -> None:
        """Send `lines` (an Arrow array, each value a line with its newline), waiting while the window is full."""
        window, window_bytes = self.options.confirm_window, self.options.confirm_window_bytes
        if self.quiet:  # nothing to wait for but a refusal: the socket's own back-pressure bounds what is in flight
            window, window_bytes = QUIET_SLICE_ROWS * 2, QUIET_SLICE_BYTES * 2
        step_rows, step_bytes = max(1, window // 2), max(1, window_bytes // 2)
        _, offsets_buffer, data_buffer = lines.buffers()
        offsets = memoryview(offsets_buffer).cast("i")[lines.offset :]  # int32: a string or binary array
        data = memoryview(data_buffer)
        start, count = 0, len(lines)
        while start < count:
            end = min(count, start + step_rows)
            base = offsets[start]
            if offsets[end] - base > step_bytes:  # the most rows within step_bytes, at least one
                low, high = start + 1, end
                while low < high:
                    middle = (low + high + 1) // 2
                    if offsets[middle] - base <= step_bytes:
                        low = middle
                    else:
                        high = middle - 1
                end = low
            size = offsets[end] - base
            while self.in_flight and (self.rows + end - start > window or self.bytes + size > window_bytes):
                self._read_confirms()
            assert self.client is not None, "connect() comes first"
            self.client.send_block(data[base : base + size])
            if self.quiet:
                for line in self.client.read_lines(0.0):  # a refusal fails the task now, not at the sync
                    _raise_refusal(line)
            else:
                self.in_flight.append((end - start, size))
                self.rows += end - start
                self.bytes += size
            start = end

    def finish(self) -> None:
        """Wait until every publish sent is confirmed: a task's rows are in the broker before its commit message."""
        if self.quiet and self.client is not None:
            self.client.send([SYNC_RID + b" sync"])
            _raise_refusal(self._answer_to(SYNC_RID))  # after every earlier refusal: none came
        while self.in_flight:
            self._read_confirms()

    def _read_confirms(self) -> None:
        """Count the confirms that came (waiting for one); raise on the first refusal (they come back in order)."""
        assert self.client is not None
        deadline = time.monotonic() + CONFIRM_TIMEOUT_SECONDS
        while True:
            count, refused = self.client.count_lines(1.0, b" error ")
            if refused is not None:
                _raise_refusal(refused)
            if count:
                break
            if time.monotonic() > deadline:
                raise MqksConnectionError(f"mqks sink: no publish confirm within {CONFIRM_TIMEOUT_SECONDS}s")
        self.rows -= count
        self.confirmed += count
        while self.in_flight and self.confirmed >= self.in_flight[0][0]:
            rows, size = self.in_flight.popleft()
            self.confirmed -= rows
            self.bytes -= size

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def _raise_refusal(line: bytes) -> None:
    """Raise the broker's reason if `line` is an error (a refused publish, or a sync the log could not keep)."""
    rid, status, data = split_answer(line)
    if status != b"ok":
        raise answer_error(rid, data, f"mqks refused publish {rid.decode(errors='replace')}: ")


def _published(messages: list) -> int:
    return sum(m.count for m in messages if isinstance(m, PublishedMessage))


class MqksStreamWriter(_Publisher, DataSourceStreamArrowWriter):
    """`df.writeStream.format("mqks")`: publishes each micro-batch; at-least-once."""

    def __init__(self, options: SinkOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema
        self.write_id = uuid.uuid4().hex[:8]

    def commit(self, messages: list, batchId: int) -> None:
        log.info("mqks sink: batch %d published %d messages", batchId, _published(messages))

    def abort(self, messages: list, batchId: int) -> None:
        # publishes cannot be taken back; the re-run batch publishes again under the same msg ids
        log.warning("mqks sink: batch %d aborted after publishing %d messages", batchId, _published(messages))


class MqksBatchWriter(_Publisher, DataSourceArrowWriter):
    """`df.write.format("mqks")`: publishes every row once per successful task; at-least-once."""

    def __init__(self, options: SinkOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema
        self.write_id = uuid.uuid4().hex[:8]

    def commit(self, messages: list) -> None:
        log.info("mqks sink: write %s published %d messages", self.write_id, _published(messages))

    def abort(self, messages: list) -> None:
        log.warning("mqks sink: write %s aborted after publishing %d messages", self.write_id, _published(messages))

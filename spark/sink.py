"""The `mqks` sink: every row becomes `{msg_id} publish --confirm {event} {data}`.

Runs in executor tasks (write()) and the driver (commit/abort). Each task opens its own
connection, keeps at most `confirmWindow` publishes and `confirmWindowBytes` unconfirmed, waits for
every `ok` and fails with the server's reason on an `error`. Guarantee: at-least-once. A retried task or a re-run batch
publishes again under the same deterministic msg ids `{query or msgIdPrefix}.{batch}.{partition}.{row}`.
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
from pyspark.sql.datasource import DataSourceStreamWriter, DataSourceWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from mqks.client.wire import answer_error, encode_token, split_answer
from mqks.spark.line_client import LineClient, MqksConnectionError, MqksError, Security, connect_any
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
SEND_EVERY_ROWS = 256  # one sendall per this many publishes


SINK_OPTIONS = ("host", "port", "seeds", "tls", "tlsCa", "token", "confirmWindow", "confirmWindowBytes", "msgIdPrefix")


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

    def addresses(self) -> list[tuple[str, int]]:
        return [(self.host, self.port), *(seed for seed in self.seeds if seed != (self.host, self.port))]

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SinkOptions:
        options = lowered(options)
        check_known(options, SINK_OPTIONS, "sink")
        prefix = text_option(options, "msgIdPrefix")
        if prefix is not None:
            encode_token(prefix, "mqks option msgIdPrefix", dashes_ok=True)
        return cls(
            host=host_option(options),
            port=port_option(options),
            seeds=seeds_option(options),
            security=security_option(options),
            confirm_window=int_option(options, "confirmWindow", 1000, 1, 1_000_000),
            confirm_window_bytes=int_option(options, "confirmWindowBytes", 8 << 20, 1024, 1 << 34),
            msg_id_prefix=prefix,
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

    def write(self, iterator: Iterator[Row]) -> PublishedMessage:
        names = self.schema.fieldNames()
        if "event" not in names:
            raise ValueError(f"mqks sink needs an 'event' column; got {names}")
        event_at = names.index("event")
        data_at = names.index("data") if "data" in names else None
        msg_id_at = names.index("msg_id") if "msg_id" in names else None
        prefix, partition_id = self._task_prefix()
        window = self.options.confirm_window
        window_bytes = self.options.confirm_window_bytes
        client: LineClient | None = None
        lines: list[bytes] = []
        unconfirmed = 0
        sizes: deque[int] = deque()  # the unconfirmed publishes' sizes, oldest first
        unconfirmed_bytes = 0
        count = 0
        first_msg_id = last_msg_id = None
        try:
            for row in iterator:
                given = row[msg_id_at] if msg_id_at is not None else None
                msg_id = f"{prefix}.{partition_id}.{count}" if given is None else given
                # a leading "--" goes through: the broker's refusal says more than a local check
                rid = encode_token(msg_id, "mqks sink msg_id", dashes_ok=True)
                event = encode_token(row[event_at], "mqks sink event", dashes_ok=True)
                data = encode_data(row[data_at]) if data_at is not None else b""
                line = b"%s publish --confirm %s %s" % (rid, event, data)
                lines.append(line)
                if first_msg_id is None:
                    first_msg_id = msg_id
                last_msg_id = msg_id
                count += 1
                unconfirmed += 1
                sizes.append(len(line))
                unconfirmed_bytes += len(line)
                full = unconfirmed >= window or unconfirmed_bytes >= window_bytes
                if len(lines) >= SEND_EVERY_ROWS or full:
                    if client is None:
                        client = connect_any(self.options.addresses(), self.options.security)
                    client.send(lines)
                    lines = []
                    if full:
                        # wait until half the window (by count and by bytes) is confirmed
                        wait = 0
                        while unconfirmed - wait > window // 2 or unconfirmed_bytes > window_bytes // 2:
                            unconfirmed_bytes -= sizes.popleft()
                            wait += 1
                        confirmed = _read_confirms(client, wait)  # may read a few more than asked
                        unconfirmed -= confirmed
                        for _ in range(confirmed - wait):
                            unconfirmed_bytes -= sizes.popleft()
            if lines or unconfirmed:
                if client is None:
                    client = connect_any(self.options.addresses(), self.options.security)
                client.send(lines)
                _read_confirms(client, unconfirmed)
        except MqksConnectionError:
            raise  # an OSError too, and already says what broke
        except OSError as e:
            raise MqksConnectionError(f"mqks sink {self.options.host}:{self.options.port}: {e}") from e
        finally:
            if client is not None:
                client.close()
        return PublishedMessage(partition_id, count, first_msg_id, last_msg_id)


def _read_confirms(client: LineClient, count: int) -> int:
    """Read `count` publish answers (they come back in order); raise on the first error."""
    done = 0
    deadline = time.monotonic() + CONFIRM_TIMEOUT_SECONDS
    while done < count:
        lines = client.read_lines(1.0)
        if not lines and time.monotonic() > deadline:
            raise MqksConnectionError(f"mqks sink: no publish confirm within {CONFIRM_TIMEOUT_SECONDS}s")
        for line in lines:
            rid, status, data = split_answer(line)
            if status == b"error":
                raise answer_error(rid, data, f"mqks refused publish {rid.decode(errors='replace')}: ")
            if status != b"ok":
                raise MqksError(f"mqks sink: unexpected answer {line[:200]!r}")
            done += 1
        if lines:
            deadline = time.monotonic() + CONFIRM_TIMEOUT_SECONDS
    return done


def _published(messages: list) -> int:
    return sum(m.count for m in messages if isinstance(m, PublishedMessage))


class MqksStreamWriter(_Publisher, DataSourceStreamWriter):
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


class MqksBatchWriter(_Publisher, DataSourceWriter):
    """`df.write.format("mqks")`: publishes every row once per successful task; at-least-once."""

    def __init__(self, options: SinkOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema
        self.write_id = uuid.uuid4().hex[:8]

    def commit(self, messages: list) -> None:
        log.info("mqks sink: write %s published %d messages", self.write_id, _published(messages))

    def abort(self, messages: list) -> None:
        log.warning("mqks sink: write %s aborted after publishing %d messages", self.write_id, _published(messages))

"""The `mqks` streaming source: executors fetch under leases, the driver only plans and acks.

Flow: latestOffset() asks the broker how deep the queues are and plans the next batch as
parts (queue, rows, bytes), carried inside the offset; partitions() turns the parts into
InputPartitions named by lease `spark.{session}.{batch}.{part}`; read() runs on executors and
fetches its part from the broker under that lease; commit(end) settles the batch's leases
with `--ack` from the driver. With several broker workers an executor fetches on the queue
owner's direct address (the public connection's hello names it), so no fetch is relayed;
settles go anywhere (the broker sums a lease's settle over its workers). Invariants (at-least-once):
- a message is acked only after Spark committed the batch that read it (commit runs after
  the sink's commit and the commit log's entry);
- a lease acks what its last fetch delivered: a retried task, a re-run batch after a driver
  crash (same offsets, same lease ids) or a recomputed partition re-fetches, which releases
  what the lease held first; a lease never settled (a dead executor, a dead driver) expires
  after leaseSeconds and its messages come back with retry+1;
- nothing connects in __init__: the constructor also runs in Spark's planner process.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from mqks.client.errors import is_transient
from mqks.client.wire import encode_token, split_answer, split_header_fields
from mqks.spark.line_client import LineClient, MqksConnectionError, MqksError, connect_any
from mqks.spark.options import (
    Endpoint,
    check_known,
    float_option,
    host_option,
    int_option,
    lowered,
    port_option,
    security_option,
    seeds_option,
    text_option,
)

log = logging.getLogger("mqks.spark")

SOURCE_SCHEMA = ("msg_id STRING, event STRING, data STRING, retry INT, queue STRING, received_at TIMESTAMP, "
                 "seq BIGINT")
SOURCE_FIELDS = [("msg_id", "string"), ("event", "string"), ("data", "string"), ("retry", "int"),
                 ("queue", "string"), ("received_at", "timestamp"), ("seq", "bigint")]
SOURCE_OPTIONS = ("host", "port", "tls", "tlsCa", "token", "queue", "queues", "events", "maxRecordsPerBatch",
                  "maxBytesPerBatch", "numPartitions", "leaseSeconds", "idleAckSeconds", "reconnectSeconds", "seeds")
ANSWER_TIMEOUT_SECONDS = 60.0
# one fetch answer: bounded well below the broker's limit on unread output. 50,000-row batches against the memory
# reader (bench.spark_source, medians of 3 rounds, run by run): 20,000 0.87x, 0.87x, 1.04x; 10,000 0.97x, 0.89x,
# 0.86x; 5,000 0.75x: no size beat this one past the machine's noise
FETCH_ROWS = 20_000
# a part's first fetch: Spark takes its rows while the next, larger one is fetched and decoded (the first
# 20,000 held the first row back ~8 ms)
FIRST_FETCH_ROWS = 4_096
FETCH_BYTES = 8 << 20
NO_BYTE_LIMIT = 0


@dataclass(frozen=True, slots=True)
class SourceOptions:
    """The reader's options, checked once on the driver."""

    endpoint: Endpoint
    queues: tuple[str, ...]  # names and masks (`orders.*`) of queues to read
    events: tuple[str, ...]
    max_records_per_batch: int
    max_bytes_per_batch: int
    num_partitions: int
    lease_seconds: float
    idle_ack_seconds: float

    @property
    def host(self) -> str:
        return self.endpoint.host

    @property
    def port(self) -> int:
        return self.endpoint.port

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        options = lowered(options)
        check_known(options, SOURCE_OPTIONS, "source")
        queue = text_option(options, "queue")
        queues_text = text_option(options, "queues")
        if (queue is None) == (queues_text is None):
            raise ValueError("mqks source needs exactly one of the options queue=<name> or "
                             "queues=<names or masks, separated by commas or spaces>")
        queues = (queue,) if queue is not None else tuple(queues_text.replace(",", " ").split())  # type: ignore[union-attr]
        for name in queues:
            encode_token(name, "mqks option queue(s)")
        events = tuple((text_option(options, "events", "") or "").replace(",", " ").split())
        for event in events:
            encode_token(event, "mqks option events")
        if events and (len(queues) != 1 or "*" in queues[0]):
            raise ValueError("mqks option events binds one queue: use it with queue=<name>, not with several "
                             "queues or a mask")
        idle = float_option(options, "idleAckSeconds", 5.0, 0.0, 3600.0)
        lease = float_option(options, "leaseSeconds", 300.0, 1.0, 86_400.0)
        if lease <= idle:
            raise ValueError(f"mqks option leaseSeconds={lease:g} must exceed idleAckSeconds={idle:g}: a batch "
                             "stays leased until the next batch (or the idle tick) acks it")
        return cls(
            endpoint=Endpoint(host_option(options), port_option(options),
                              float_option(options, "reconnectSeconds", 60.0, 0.0, 86_400.0), security_option(options),
                              seeds_option(options)),
            queues=queues,
            events=events,
            max_records_per_batch=int_option(options, "maxRecordsPerBatch", 50_000, 1, 100_000_000),
            max_bytes_per_batch=int_option(options, "maxBytesPerBatch", 64 << 20, 1024, 1 << 40),
            num_partitions=int_option(options, "numPartitions", 2, 1, 10_000),
            lease_seconds=lease,
            idle_ack_seconds=idle,
        )


def source_struct() -> StructType:
    """SOURCE_SCHEMA as a StructType, built without a Spark session."""
    from pyspark.sql.types import (
        IntegerType,
        LongType,
        StringType,
        StructField,
        TimestampType,
    )

    types = {"string": StringType(), "int": IntegerType(), "bigint": LongType(), "timestamp": TimestampType()}
    return StructType([StructField(name, types[kind]) for name, kind in SOURCE_FIELDS])


def check_schema(schema: StructType) -> None:
    """The source's columns are fixed: a user schema that differs is refused before the query starts."""
    given = [(field.name, field.dataType.simpleString()) for field in schema.fields]
    if given != SOURCE_FIELDS:
        raise ValueError(f"mqks source: the schema is fixed ({SOURCE_SCHEMA}); do not call .schema() on the "
                         f"reader (got {schema.simpleString()}). Select or cast columns after load() instead")


class MqksPartition(InputPartition):
    """One part of a batch: fetch up to `rows` messages (and `max_bytes`) of `queue` under `lease_id`."""

    def __init__(self, queue: str, lease_id: str, rows: int, max_bytes: int) -> None:
        super().__init__(None)
        self.queue = queue
        self.lease_id = lease_id
        self.rows = rows
        self.max_bytes = max_bytes  # 0: no byte limit (Trigger.Once reads all)

    def __repr__(self) -> str:
        return f"MqksPartition({self.queue!r}, {self.lease_id!r}, rows={self.rows}, max_bytes={self.max_bytes})"


def lease_ids(offset: Mapping) -> list[str]:
    """The lease of every part of the batch that ends at `offset`."""
    return [f"spark.{offset['session']}.{offset['batch']}.{i}" for i in range(len(offset.get("parts") or ()))]


def plan_parts(depths: dict[str, int], rows: int, max_bytes: int, partitions: int) -> list[list]:
    """Split `rows` over the queues by depth, and each queue's share over partitions: [[queue, rows, bytes]]."""
    waiting = {queue: depth for queue, depth in sorted(depths.items()) if depth > 0}
    total = sum(waiting.values())
    rows = min(rows, total)
    parts: list[list] = []
    if rows <= 0:
        return parts
    for queue, depth in waiting.items():
        share = max(1, rows * depth // total)
        count = max(1, min(share, round(partitions * share / rows)))
        step, extra = divmod(share, count)
        for i in range(count):
            part_rows = step + (1 if i < extra else 0)
            part_bytes = max(1, max_bytes * part_rows // rows) if max_bytes else NO_BYTE_LIMIT
            parts.append([queue, part_rows, part_bytes])
    return parts


def worth_asking_again(error: MqksError) -> bool:
    """A lost connection, or a refusal that passes by itself (a worker restarting, a group failing over)."""
    return isinstance(error, MqksConnectionError) or is_transient(error)


class Control:
    """The driver's one connection: queue depths, bindings and settles; reconnects for `reconnect_seconds`."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.client: LineClient | None = None
        self.counter = 0

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def call(self, requests: list[tuple[str, str]]) -> dict[bytes, list[bytes]]:
        """Send `(action, args)` requests pipelined; their answers' data by rid. Retries whole on a lost link.

        Every request the source makes is idempotent (queues, rebind --add, settle by lease id:
        a repeated settle finds the lease gone and answers 0), so resending after a reconnect is safe;
        so is resending after a refusal that passes by itself (a worker restarting, a group failing over).
        """
        endpoint = self.endpoint
        deadline = time.monotonic() + endpoint.reconnect_seconds
        delay = 0.1
        while True:
            try:
                if self.client is None:
                    self.client = connect_any(endpoint.addresses(), endpoint.security)
                return self._exchange(requests)
            except (OSError, MqksError) as e:
                if isinstance(e, MqksError) and not worth_asking_again(e):
                    raise
                self.close()  # after a refusal too: a fresh hello routes by the new owners
                if time.monotonic() + delay > deadline:
                    raise MqksConnectionError(
                        f"mqks source: broker {endpoint.host}:{endpoint.port} unreachable for "
                        f"{endpoint.reconnect_seconds:g}s (reconnectSeconds): {e}") from e
                log.warning("mqks source: %s; retrying in %.1fs", e, delay)
                time.sleep(delay)
                delay = min(2.0, delay * 2)

    def _exchange(self, requests: list[tuple[str, str]]) -> dict[bytes, list[bytes]]:
        assert self.client is not None
        lines: list[bytes] = []
        waiting: dict[bytes, str] = {}
        for action, args in requests:
            self.counter += 1
            rid = b"src.%d" % self.counter
            lines.append(b"%b %b %b" % (rid, action.encode(), args.encode()))
            waiting[rid] = action
        self.client.send(lines)
        answers: dict[bytes, list[bytes]] = {rid: [] for rid in waiting}
        deadline = time.monotonic() + ANSWER_TIMEOUT_SECONDS
        while waiting:
            got = self.client.read_lines(1.0)
            if not got and time.monotonic() > deadline:
                raise MqksConnectionError(f"mqks source: no answer within {ANSWER_TIMEOUT_SECONDS:g}s")
            for line in got:
                rid, status, data = split_answer(line)
                if rid not in waiting:
                    continue
                action = waiting[rid]
                if status == b"error":
                    raise MqksError(f"mqks source: broker refused {action}: {data.decode(errors='replace')}")
                if action == "queues" and data != b"--end":
                    answers[rid].append(data)
                    continue
                answers[rid].append(data)
                del waiting[rid]
        return answers

    def depths(self, queues: tuple[str, ...]) -> dict[str, int]:
        """Messages waiting in each queue named or matched by a mask (absent queues: none)."""
        answers = self.call([("queues", name) for name in queues])
        depths: dict[str, int] = {}
        for rows in answers.values():
            for row in rows[:-1]:
                found = json.loads(row)
                depths[found["queue"]] = int(found["depth"])
        return depths

    def settle(self, leases: list[str]) -> int:
        """Ack what the leases hold now; returns how many messages that was."""
        if not leases:
            return 0
        chunks = [" ".join(leases[i : i + 500]) + " --ack" for i in range(0, len(leases), 500)]
        return sum(int(answer[0] or 0) for answer in self.call([("settle", chunk) for chunk in chunks]).values())


def bind_queues(control: Control, options: SourceOptions) -> None:
    """Create the named queues and add `events` to their bindings (rebind --add, idempotent): messages routed
    from now on wait for the query."""
    adds = " --add " + " ".join(options.events) if options.events else ""
    binds = [("rebind", f"--confirm {name}{adds}") for name in options.queues if "*" not in name]
    if binds:
        control.call(binds)


def bind_at_load(options: SourceOptions) -> None:
    """`load()`'s side of the source: bind its queues before the query starts. The reader is made only when the
    query plans its first batch, seconds after `start()` returned: what was published meanwhile went to no
    queue. A broker away for `reconnectSeconds` fails load()."""
    control = Control(options.endpoint)
    try:
        bind_queues(control, options)
    finally:
        control.close()


class MqksStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans batches of `queues` on the driver; executors fetch them under leases; commit acks them."""

    def __init__(self, options: SourceOptions, schema: StructType) -> None:
        # no socket here: Spark also builds this object in its planner process
        self.options = options
        self.schema = schema
        self.control: Control | None = None
        self.session = ""
        self.batch = 0
        self.tick = 0
        self.unsettled: dict[int, list[str]] = {}  # own batches planned and not yet committed: their leases
        self.last_planned_at = time.monotonic()
        self.budget: int | None = None  # Trigger.AvailableNow: messages left of what was there at the start

    def __getstate__(self) -> dict:
        # the planner pickles this reader for read(): options and schema only, never a socket
        return {"options": self.options, "schema": self.schema}

    def __setstate__(self, state: dict) -> None:
        MqksStreamReader.__init__(self, state["options"], state["schema"])

    def _control(self) -> Control:
        if self.control is None:
            self.session = uuid.uuid4().hex[:16]
            self.control = Control(self.options.endpoint)
            bind_queues(self.control, self.options)  # again: a queue deleted since load() comes back
            log.info("mqks source: session %s reads %s", self.session, " ".join(self.options.queues))
        return self.control

    def initialOffset(self) -> dict:
        return {"session": "", "batch": 0, "tick": 0, "parts": []}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.options.max_records_per_batch)

    def prepareForTriggerAvailableNow(self) -> None:
        """Trigger.AvailableNow: read what waits now, then stop (the last batch acked by a final empty one)."""
        self.budget = sum(self._control().depths(self.options.queues).values())
        log.info("mqks source: Trigger.AvailableNow reads the %d messages waiting now", self.budget)

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        """The next batch's plan, a tick that lets Spark commit the previous batch, or `start` (nothing new)."""
        control = self._control()
        options = self.options
        rows = options.max_records_per_batch
        max_bytes = options.max_bytes_per_batch
        if isinstance(limit, ReadMaxRows):
            rows = limit.max_rows
        elif isinstance(limit, ReadMaxBytes):
            max_bytes = limit.max_bytes
        elif isinstance(limit, ReadAllAvailable):
            rows, max_bytes = 1 << 62, NO_BYTE_LIMIT  # Trigger.Once: one batch of everything
        if self.budget is not None:
            rows = min(rows, self.budget)
        depths = control.depths(options.queues) if rows > 0 else {}
        parts = plan_parts(depths, rows, max_bytes, options.num_partitions)
        now = time.monotonic()
        if parts:
            self.batch += 1
            end = {"session": self.session, "batch": self.batch, "tick": self.tick, "parts": parts}
            self.unsettled[self.batch] = lease_ids(end)
            if self.budget is not None:
                self.budget -= sum(part[1] for part in parts)
            self.last_planned_at = now
            return end
        own = start.get("session") == self.session
        foreign_batch = not own and bool(start.get("parts"))
        idle = now - self.last_planned_at >= options.idle_ack_seconds or self.budget is not None
        if foreign_batch or (own and self.unsettled and idle):
            # An empty batch makes Spark commit the one before it: the last batch before a quiet
            # period, the end of an AvailableNow run, or the last batch of a previous run is acked now
            # (Spark commits a source only while it plans the next batch).
            self.tick += 1
            self.last_planned_at = now
            return {"session": self.session, "batch": self.batch, "tick": self.tick, "parts": []}
        return start

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        """The parts of the batch that ends at `end`, each under its lease (a re-run gets the same leases)."""
        return [MqksPartition(queue, lease, rows, max_bytes)
                for (queue, rows, max_bytes), lease in zip(end.get("parts") or (), lease_ids(end), strict=True)]

    def read(self, partition: InputPartition) -> Iterator:
        """Runs on executors: fetch the part under its lease, yield Arrow record batches."""
        assert isinstance(partition, MqksPartition)
        yield from fetch_part(self.options, self.schema, partition)

    def commit(self, end: dict) -> None:
        """Ack the leases of every batch up to `end`: this run's, or the one batch an earlier run left."""
        if end.get("session") == self.session:
            leases = []
            for batch in sorted(self.unsettled):
                if batch <= int(end.get("batch", 0)):
                    leases += self.unsettled.pop(batch)
        else:
            leases = lease_ids(end)  # a batch of an earlier run: its leases ack what its last fetch took
        if leases:
            acked = self._control().settle(leases)
            log.info("mqks source: batch %s committed, %d messages acked", end.get("batch"), acked)

    def stop(self) -> None:
        """Best effort: Spark usually kills this process instead; leases outlive the connection anyway."""
        if self.control is not None:
            self.control.close()


# one connection per address per executor Python worker, reused by tasks: the public one, and one
# per worker that owns a queue this process fetched
_CLIENTS: dict[tuple[str, int], LineClient] = {}


def _cached_client(key: tuple[str, int], fresh: bool) -> LineClient | None:
    """This process's open connection to `key`; None (and closed) if it is gone or `fresh` asks for a new one."""
    client = _CLIENTS.get(key)
    if client is not None and (fresh or client.closed):
        client.close()
        client = None
    return client


def _client(endpoint: Endpoint, fresh: bool) -> LineClient:
    """The public connection; its hello tells the slot map (a fresh one re-reads it)."""
    key = (endpoint.host, endpoint.port)
    client = _cached_client(key, fresh)
    if client is None:
        deadline = time.monotonic() + endpoint.reconnect_seconds
        delay = 0.1
        while True:
            try:
                client = _CLIENTS[key] = connect_any(endpoint.addresses(), endpoint.security, hello=True)
                break
            except OSError as e:
                if time.monotonic() + delay > deadline:
                    raise MqksConnectionError(f"mqks source: cannot reach {endpoint.host}:{endpoint.port} for "
                                              f"{endpoint.reconnect_seconds:g}s (reconnectSeconds): {e}") from e
                time.sleep(delay)
                delay = min(2.0, delay * 2)
    return client


def _fetch_client(endpoint: Endpoint, queue: bytes, fresh: bool) -> LineClient:
    """The connection a fetch of `queue` goes on: its owner's direct address when the broker names one.

    Routing only saves a hop (every worker serves a fetch), so a direct address that cannot be
    reached, or an older broker, means the public connection.
    """
    public = _client(endpoint, fresh)
    route = None if public.placement is None else public.placement.route(queue, endpoint.host,
                                                                          endpoint.security.tls)
    if route is None:
        return public
    key = (route.host, route.port)
    client = _cached_client(key, fresh)
    if client is None:
        try:
            client = _CLIENTS[key] = LineClient(route.host, route.port, security=endpoint.security,
                                                tls_hostname=endpoint.host)
        except (OSError, MqksError) as e:
            log.warning("mqks source: worker %d at %s:%d unreachable (%s); fetching through %s:%d", route.worker,
                        route.host, route.port, e, endpoint.host, endpoint.port)
            return public
    return client


def _answer(client: LineClient, rid: bytes) -> bytearray:
    """The answer to the fetch `rid` as one block, its `--end` line (or the broker's refusal) last.

    Lines of an earlier fetch abandoned on this connection may come first: they carry another rid.
    """
    end, refused = rid + b" ok --end ", rid + b" error "

    def whole(line: bytes) -> bool:  # not a message whose msg id is --end
        return line.startswith(refused) or line[len(end) :].isdigit()

    deadline = time.monotonic() + ANSWER_TIMEOUT_SECONDS
    while (block := client.read_through((end, refused), 1.0, whole)) is None:
        if time.monotonic() > deadline:
            raise MqksConnectionError(f"mqks source: no fetch answer within {ANSWER_TIMEOUT_SECONDS:g}s")
    return block


def _answer_count(block: bytearray, rid: bytes) -> int:
    """How many messages the answer `block` holds (its `--end` line says); raises on the broker's refusal."""
    last = bytes(block[block.rfind(b"\n", 0, len(block) - 1) + 1 : -1])
    if last.startswith(rid + b" error "):
        raise MqksError(f"mqks source: broker refused fetch: {last[len(rid) + 1 :][:300].decode(errors='replace')}")
    return int(last[len(rid) + 9 :])  # after "{rid} ok --end "


def _decode(block: bytearray, rid: bytes, count: int, queue: str, names: list[str], arrow_schema, pa) -> list:
    """A fetch answer -> record batches: each `--packed` or `--tails` block read in place by Arrow, the lines of
    redelivered messages (each with its seq) the slower way."""
    body_end = block.rfind(b"\n", 0, len(block) - 1) + 1  # the --end line starts here
    view = memoryview(block)
    mine = rid + b" ok "
    lines: list[bytes] = []  # redelivered messages' (or an older broker's)
    batches = []
    at = 0
    while at < body_end:
        newline = block.index(b"\n", at)
        line = bytes(view[at:newline])
        at = newline + 1
        if not line.startswith(mine):
            continue  # an earlier fetch's, abandoned on this connection
        fields = line[len(mine) :].split(b" ")
        if fields[0] == b"--seq-from" and len(fields) == 2 and fields[1].isdigit():  # a broker before the blocks
            run = [piece + b"\n" for piece in bytes(view[at:body_end]).split(b"\n") if piece.startswith(mine)]
            batches.append(run_batch(memoryview(b"".join(run)), len(run), int(fields[1]), len(mine), queue, names,
                                     arrow_schema, pa))
            break
        if fields[0] in BLOCKS and len(fields) >= 4 and all(field.isdigit() for field in fields[1:4]):
            first, rows, size = int(fields[1]), int(fields[2]), int(fields[3])
            body = view[at : at + size]
            at += size
            if fields[0] == b"--tails":
                batches.append(run_batch(body, rows, first, 4, queue, names, arrow_schema, pa))
            else:
                batches.append(packed_batch(body, rows, first, fields[4:], queue, names, arrow_schema, pa))
        else:
            lines.append(line)
    if lines:  # redelivered messages come first: each line carries its seq (and retry)
        batches.insert(0, to_record_batch(lines, queue, names, arrow_schema, pa, skip_fields=2))
    return batches


BLOCKS = (b"--tails", b"--packed")  # a fetch --runs answer's blocks (docs/protocol.md)


def fetch_part(options: SourceOptions, schema: StructType, partition: MqksPartition) -> Iterator:
    """Fetch a part in chunks under one lease (the first fetch replaces, the next ones `--add`)."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema

    arrow_schema = to_arrow_schema(schema, timezone="UTC")
    names = schema.fieldNames()
    queue_name = encode_token(partition.queue, "queue")
    lease = partition.lease_id.encode()
    # one rid per attempt: the late answer of an attempt that stopped early is never read as a retry's. A
    # connection belongs to this process, so a count is unique on it; a short rid, as every answer line repeats it
    # (the lease's 32-byte rid made 20 % of a 100-byte message's line: bytes the broker, the kernel and Arrow pay)
    rid = b"r%d" % next(_ATTEMPTS)
    try:
        yield from _fetch_chunks(options, partition, queue_name, lease, rid, names, arrow_schema, pa)
    except GeneratorExit:
        # Spark stopped reading this part early (a limit): what the lease holds may not all have
        # been used, so give it all back rather than let the batch's commit ack it (duplicates, not loss).
        # On the fetch's own connection: the broker reads it after the fetch still in flight there
        try:
            _fetch_release(_fetch_client(options.endpoint, queue_name, fresh=False), lease)
        except (OSError, MqksError):
            pass  # the lease expires instead
        raise


_ATTEMPTS = itertools.count()
# brokers (by address) older than `fetch --runs`: this process fetches from them in the per-line format
_WITHOUT_RUNS: set[tuple[str, int]] = set()


def _fetch_release(client: LineClient, lease: bytes) -> None:
    client.send([b"rl.%b settle %b --release" % (lease, lease)])


def fetch_rows(rows_left: int, first: bool) -> int:
    """How many rows a part's next fetch asks: FIRST_FETCH_ROWS first, FETCH_ROWS after, and all that is left
    when the rest would be under a quarter of that: a 5,000-row part is fetched at once, not as 4,096 + 904 (each
    fetch a round trip, and a batch Spark takes on its own)."""
    limit = min(FETCH_ROWS, FIRST_FETCH_ROWS) if first else FETCH_ROWS
    return rows_left if rows_left - limit < limit // 4 else limit


def _fetch_chunks(options: SourceOptions, partition: MqksPartition, queue_name: bytes, lease: bytes, rid: bytes,
                  names: list[str], arrow_schema, pa) -> Iterator:
    """Fetch until the part's rows or bytes are read, or the queue runs dry; a record batch per fetch (two when
    it holds redelivered messages).

    Each fetch asks `--runs`: the broker takes the never-delivered messages in bulk and the answer is read
    in place (run_batch). The next fetch is sent before this one's answer is decoded, so the broker works
    while we do.
    """
    rows_left, bytes_left = partition.rows, partition.max_bytes

    def fetch_line(add: bool, runs: bool) -> tuple[bytes, int, int]:
        chunk_rows = fetch_rows(rows_left, first=not add)
        chunk_bytes = min(bytes_left, FETCH_BYTES) if bytes_left else FETCH_BYTES
        line = b"%b fetch %b --max=%d --max-bytes=%d --lease=%b --lease-seconds=%r%b%b" % (
            rid, queue_name, chunk_rows, chunk_bytes, lease, options.lease_seconds, b" --add" if add else b"",
            b" --runs" if runs else b"")
        return line, chunk_rows, chunk_bytes

    # nothing yielded yet: a dead cached connection is replaced and the fetch sent again (same lease, not
    # --add: what a lost attempt took is released first), and so is a fetch refused while the queue's owner
    # restarts or fails over, until the endpoint's reconnectSeconds
    deadline = time.monotonic() + options.endpoint.reconnect_seconds
    fresh, delay, runs = False, 0.0, False
    while True:
        try:
            client = _fetch_client(options.endpoint, queue_name, fresh=fresh)
            runs = (client.host, client.port) not in _WITHOUT_RUNS
            line, chunk_rows, chunk_bytes = fetch_line(False, runs)
            client.send([line])
            answer = _answer(client, rid)
            count = _answer_count(answer, rid)
            break
        except MqksError as e:
            if runs and "unexpected '--runs'" in str(e):  # a broker from before the flag: ask as it understands
                _WITHOUT_RUNS.add((client.host, client.port))
                continue
            if not worth_asking_again(e) or time.monotonic() + delay > deadline:
                raise
            log.warning("mqks source: fetch of %s: %s; again in %.1fs", partition.queue, e, delay)
            time.sleep(delay)
            # a restart (maybe with another worker count) or a new owner: a fresh hello routes by the new map
            fresh, delay = True, min(2.0, max(0.1, delay * 2))
    while True:
        size = len(answer)
        rows_left -= count
        if bytes_left:
            bytes_left -= size
        dry = count < chunk_rows and size < chunk_bytes // 2  # the byte limit did not stop it
        more = rows_left > 0 and not dry and (not partition.max_bytes or bytes_left > 0)
        if more:
            line, chunk_rows, chunk_bytes = fetch_line(True, runs)
            client.send([line])
        if count:
            yield from _decode(answer, rid, count, partition.queue, names, arrow_schema, pa)
        if not more:
            return
        answer = _answer(client, rid)
        count = _answer_count(answer, rid)


_COUNTING: list = []  # this process's 0, 1, 2, ... as an Arrow int64 array, grown on demand (a run's seqs)


def _seqs(count: int, first_seq: int, pa):
    """first_seq, first_seq + 1, ... (count of them) as an Arrow int64 array."""
    import pyarrow.compute as pc

    if not _COUNTING or len(_COUNTING[0]) < count:
        _COUNTING[:] = [pa.array(range(max(count, FETCH_ROWS)), type=pa.int64())]
    # a typed scalar: a bare int is converted by type inference, which looks for dateutil on every call (absent
    # here: a search of sys.path each time, 4x the add itself)
    return pc.add(_COUNTING[0].slice(0, count), pa.scalar(first_seq, type=pa.int64()))


# by the fields a row splits into: per field, its index in each row's fields (field + width * row), grown on demand
_PICKS: dict[int, list] = {}


def _pick(count: int, field: int, pa, width: int = 3):
    picks = _PICKS.get(width)
    if picks is None or len(picks[0]) < count:
        size = max(count, FETCH_ROWS)
        picks = _PICKS[width] = [pa.array(range(one, width * size, width), type=pa.int64()) for one in range(width)]
    return picks[field].slice(0, count)


def _one_buffer(view: memoryview, pa, kind):
    """The bytes in `view` as a one-value Arrow array of `kind` (string or binary), not copied, not checked."""
    offsets = pa.py_buffer(pa.array([0, len(view)], pa.int32()).buffers()[1])
    return pa.Array.from_buffers(kind, 1, [None, offsets, pa.py_buffer(view)])


def packed_batch(lines: memoryview, count: int, first_seq: int, headers: list[bytes], queue: str, names: list[str],
                 arrow_schema, pa):
    """A `--packed` block -> a record batch: one line of `count` messages' `{msg_id}\\xff{data}`, 0xff between
    them too, with seqs from `first_seq`; the event of each stretch of them is in `headers` (`{n}`, `{header}` in
    turn), never on the line.

    Read in place as bytes (0xff is not UTF-8): split once by Arrow's kernels, each column checked as UTF-8 by
    its cast; the events are one value repeated per stretch. Invalid UTF-8 takes the Python path, which
    replaces it.
    """
    import pyarrow.compute as pc

    stretches = [(int(rows), split_header_fields(header)[0].decode("utf-8", "replace"))
                 for rows, header in zip(headers[::2], headers[1::2], strict=True)]
    if sum(rows for rows, _ in stretches) != count:
        raise MqksError(f"mqks source: a --packed block of {count} rows names events for another count")
    events = [pa.repeat(pa.scalar(event, type=pa.string()), rows) for rows, event in stretches]
    inner = lines[: len(lines) - 1]  # the last newline out
    fields = pc.split_pattern(_one_buffer(inner, pa, pa.binary()), b"\xff").values  # msg_id, data, msg_id...
    if len(fields) != 2 * count:
        raise MqksError(f"mqks source: a --packed block of {count} rows holds {len(fields)} fields")
    msg_ids, data = pc.take(fields, _pick(count, 0, pa, 2)), pc.take(fields, _pick(count, 1, pa, 2))
    try:
        msg_ids, data = msg_ids.cast(pa.string()), data.cast(pa.string())
    except pa.ArrowInvalid:
        msg_ids, data = _strings(msg_ids.to_pylist(), pa), _strings(data.to_pylist(), pa)
    columns = {"msg_id": msg_ids, "event": events[0] if len(events) == 1 else pa.concat_arrays(events), "data": data,
               "retry": pa.repeat(pa.scalar(0, type=pa.int32()), count), "seq": _seqs(count, first_seq, pa)}
    return _with_arrival(columns, count, queue, names, arrow_schema, pa)


def _with_arrival(columns: dict, count: int, queue: str, names: list[str], arrow_schema, pa):
    """The record batch of `columns` with the queue's name and this moment as each row's received_at."""
    now_us = int(time.time() * 1_000_000)
    columns["queue"] = pa.repeat(pa.scalar(queue, type=pa.string()), count)
    columns["received_at"] = pa.repeat(pa.scalar(now_us, type=pa.timestamp("us", tz="UTC")), count)
    return pa.RecordBatch.from_arrays([columns[name] for name in names], schema=arrow_schema)


def run_batch(lines: memoryview, count: int, first_seq: int, prefix_bytes: int, queue: str, names: list[str],
              arrow_schema, pa):
    """`count` lines `{prefix}{msg_id} event={event} {data}\\n` with seqs from `first_seq` -> a record batch (the
    prefix: ` ok ` in a `--tails` block, `{rid} ok ` in an older broker's run).

    Read in place: one Arrow string over the lines is split by Arrow's kernels at each line's
    `\\n{prefix}` and then at two spaces, never a Python object per line (measured: 0.13 us a row
    against 0.6 for lines split in Python first). A line that is not UTF-8 or holds more header fields
    (a request's reply token) takes the Python path.
    """
    import pyarrow.compute as pc

    try:
        text = _one_buffer(lines[prefix_bytes : len(lines) - 1], pa, pa.string())  # both newlines out
        text.validate(full=True)  # UTF-8: from_buffers checks nothing
        rows = pc.split_pattern(text, "\n" + bytes(lines[: prefix_bytes]).decode()).values
        fields = pc.split_pattern(rows, " ", max_splits=2).values  # msg_id, head, data of each row in turn
        if len(rows) != count or len(fields) != 3 * count:
            raise ValueError("a line without its fields")
        head = pc.take(fields, _pick(count, 1, pa))
        if not pc.all(pc.starts_with(head, "event=")).as_py() or pc.any(pc.match_substring(head, ",")).as_py():
            raise ValueError("a head with more than its event")
        columns = {
            "msg_id": pc.take(fields, _pick(count, 0, pa)),
            "event": pc.utf8_slice_codeunits(head, 6),
            "data": pc.take(fields, _pick(count, 2, pa)),
            "retry": pa.repeat(pa.scalar(0, type=pa.int32()), count),
            "seq": _seqs(count, first_seq, pa),
        }
    except (pa.ArrowInvalid, ValueError, UnicodeDecodeError):
        columns = _parse_lines([line[prefix_bytes:] for line in bytes(lines).split(b"\n")[:count]], pa)
        columns["seq"] = pa.array(range(first_seq, first_seq + count), type=pa.int64())
    return _with_arrival(columns, count, queue, names, arrow_schema, pa)


def to_record_batch(lines: list[bytes], queue: str, names: list[str], arrow_schema, pa, skip_fields: int = 0):
    """`{msg_id} event={event}[,retry=n],seq=s {data}` lines -> one Arrow record batch.

    `skip_fields` space-separated fields before msg_id are dropped (`{rid} ok ` of a fetch answer).
    Split in Arrow's compute kernels (measured: ~3.5x the rows/s of a Python loop); lines that are
    not UTF-8 or do not have that shape take the Python path, which reads fields as the client does.
    """
    import pyarrow.compute as pc

    count = len(lines)
    try:
        parts = pc.split_pattern(pa.array(lines, type=pa.string()), " ", max_splits=2 + skip_fields)
        if pc.min(pc.list_value_length(parts)).as_py() != 3 + skip_fields:
            raise ValueError("a line without its fields")
        head = pc.split_pattern(pc.list_element(parts, 1 + skip_fields), ",seq=", max_splits=1, reverse=True)
        meta_retry = pc.split_pattern(pc.list_element(head, 0), ",retry=", max_splits=1, reverse=True)
        retry_text = pc.list_element(pc.list_slice(meta_retry, 1, 2, return_fixed_size_list=True), 0)
        event = pc.list_element(meta_retry, 0)
        if not pc.all(pc.starts_with(event, "event=")).as_py():
            raise ValueError("a head without event=")
        if pc.any(pc.match_substring(event, ",reply=")).as_py():
            raise ValueError("a request's delivery: the Python path reads its reply field as the client does")
        columns = {
            "msg_id": pc.list_element(parts, skip_fields),
            "event": pc.utf8_slice_codeunits(event, 6),
            "data": pc.list_element(parts, 2 + skip_fields),
            "retry": pc.fill_null(pc.cast(retry_text, pa.int32()), 0),
            "seq": pc.cast(pc.list_element(pc.list_slice(head, 1, 2, return_fixed_size_list=True), 0), pa.int64()),
        }
        if columns["seq"].null_count:
            raise ValueError("a head without seq")
    except (pa.ArrowInvalid, ValueError, UnicodeDecodeError):
        columns = _parse_lines([line.split(b" ", skip_fields)[-1] for line in lines] if skip_fields else lines, pa)
    return _with_arrival(columns, count, queue, names, arrow_schema, pa)


def _parse_lines(lines: list[bytes], pa) -> dict:
    """The Python path of to_record_batch: fields read from the right, invalid UTF-8 replaced."""
    msg_ids, events, retries, seqs, data = [], [], [], [], []
    for line in lines:
        msg_id, _, rest = line.partition(b" ")
        head, _, payload = rest.partition(b" ")
        event, fields = split_header_fields(head[6:] if head.startswith(b"event=") else head)
        msg_ids.append(msg_id)
        events.append(event)
        retries.append(fields.get(b"retry", 0))
        seqs.append(fields.get(b"seq"))
        data.append(payload)
    return {"msg_id": _strings(msg_ids, pa), "event": _strings(events, pa), "data": _strings(data, pa),
            "retry": pa.array(retries, type=pa.int32()), "seq": pa.array(seqs, type=pa.int64())}


def _strings(values: list[bytes], pa):
    """A string array from UTF-8 bytes; invalid bytes become U+FFFD instead of failing the task."""
    try:
        return pa.array(values, type=pa.string())
    except (pa.ArrowInvalid, UnicodeDecodeError):
        return pa.array([v.decode("utf-8", "replace") for v in values], type=pa.string())

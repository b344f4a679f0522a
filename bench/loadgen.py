"""The one load generator: pipelined producers and bulk-counting consumers for every server.

A run forks a consumer process (one or many connections behind one selector) and a producer
process, pinned to the generator core when asked. The producer pre-builds its whole pipelined
buffer before the clock starts; replies are drained by a thread and only counted. The consumer
cuts each recv at its last newline and counts or parses whole chunks (`bytes.count`, one regex
per chunk), never one message at a time in Python. Push deliveries that need no answer
(MQKS auto-ack, Redis pub/sub, NATS) are counted by bench/bin/count, built from count.c with
gcc, after Python subscribed the sockets: Python's own receive path capped the fastest peers.
A shared counter lets the producer stay at most `window` messages ahead, so no broker has to
drop or buffer without bound. A confirmed flow (w5) also keeps at most `window` publishes
unconfirmed (the drain thread counts each server's confirm reply), ends only once every
publish is confirmed, and its consumer ends only once the server shows every message acked.
Every payload is 100 bytes: `T` + 19-digit monotonic ns + filler + the marker `|EOM|`.
"""

from __future__ import annotations

import ast
import multiprocessing as mp
import os
import re
import selectors
import shutil
import socket
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass, field

RECV_BYTES = 1 << 20
CHUNK_MESSAGES = 2000
MARKER = b"|EOM|"
FILLER = b"." * 75
TS_RE = re.compile(rb"T(\d{19})\.")
SETUP_TIMEOUT_SECONDS = 20.0
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
COUNTER_SOURCE = os.path.join(BENCH_DIR, "count.c")
COUNTER_BINARY = os.path.join(BENCH_DIR, "bin", "count")
ACKER_SOURCE = os.path.join(BENCH_DIR, "ack.c")
ACKER_BINARY = os.path.join(BENCH_DIR, "bin", "ack")  # built with the counter: a flow with one has both
READERS_HEADER = os.path.join(BENCH_DIR, "readers.h")  # the epoll loop both include

now_ns = time.monotonic_ns  # CLOCK_MONOTONIC: one clock for every process on the machine


def payload(ts_ns: int = 0) -> bytes:
    """100 bytes, timestamped, ending with the marker the consumers count."""
    return b"T%019d" % ts_ns + FILLER + MARKER


assert len(payload()) == 100


def pin(core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})


def connect(host: str, port: int, tls_ca: str | None = None) -> socket.socket:
    """A TCP connection; with `tls_ca`, TLS (1.2+) to a server whose certificate that CA signed."""
    sock = socket.create_connection((host, port), timeout=SETUP_TIMEOUT_SECONDS)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls_ca is not None:
        sock = ssl.create_default_context(cafile=tls_ca).wrap_socket(sock, server_hostname=host)
    return sock


def recv_tls(sock: ssl.SSLSocket, size: int) -> bytes:
    """A blocking TLS read, then every record already there, up to `size` bytes.

    A TLS read returns one record (16 KiB at most): parsing each alone would cap the consumer, not the
    server, far below what a plain 1 MiB recv allows.
    """
    first = sock.recv(size)
    if not first:
        return first
    parts, got = [first], len(first)
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        while got < size:
            try:
                part = sock.recv(size - got)
            except (ssl.SSLWantReadError, BlockingIOError):
                break
            if not part:
                break
            parts.append(part)
            got += len(part)
    finally:
        sock.settimeout(timeout)
    return b"".join(parts)


def read_until(sock: socket.socket, needle: bytes, buf: bytes = b"", count: int = 1) -> bytes:
    """Blocking read until `needle` occurs `count` times; returns everything read."""
    while buf.count(needle) < count:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed while waiting for {needle!r}; have {buf[-300:]!r}")
        buf += chunk
    return buf


def resp(*parts: bytes) -> bytes:
    """One Redis command in RESP."""
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def build_counter() -> str | None:
    """Compile bench/count.c into bench/bin/count, and bench/ack.c beside it, if needed; None (Python
    counts and acks) without gcc."""
    if build_c(ACKER_SOURCE, ACKER_BINARY) is None:
        return None
    return build_c(COUNTER_SOURCE, COUNTER_BINARY)


def build_c(source: str, binary: str) -> str | None:
    try:
        newest = max(os.path.getmtime(source), os.path.getmtime(READERS_HEADER))
        if os.path.exists(binary) and os.path.getmtime(binary) >= newest:
            return binary
        gcc = shutil.which("gcc") or shutil.which("cc")
        if not gcc:
            return None
        os.makedirs(os.path.dirname(binary), exist_ok=True)
        done = subprocess.run([gcc, "-O2", "-o", binary, source], capture_output=True, timeout=60)
        return binary if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


class ConsumerState:
    """Per-connection parsing state.

    `feed(data, start, end)` gets whole lines `data[start:end]` (offsets, so a big chunk is
    never copied) and returns (deliveries counted, bytes to send back).
    """

    errors = 0
    got = 0
    tail = b""
    push_only = True  # nothing to send back: bench/bin/count may count these bytes instead
    acks_in_c = False  # MQKS manual-ack deliveries that bench/bin/ack may take and ack instead
    error_needle = b""

    def feed(self, data: bytes, start: int, end: int) -> tuple[int, bytes]:
        return data.count(MARKER, start, end), b""


class Proto:
    """One server's dialect for one workload variant."""

    name = "?"
    producer_error = b"\n-ERR"
    barrier_request = b""
    barrier_reply = b""
    confirm_reply = b""  # occurs once in each publish's success reply (confirmed flows count it)
    limit = 0  # messages the consumer takes at most (0: no limit); a confirmed flow sets it to n

    def producer_setup(self, sock: socket.socket) -> None:
        pass

    def publish(self, start: int, count: int, ts_ns: int = 0) -> bytes:
        raise NotImplementedError

    def consumer_setup(self, sock: socket.socket, index: int) -> tuple[ConsumerState, bytes]:
        """Subscribe connection `index` (w2: 0-9 exact, 10-19 mask); returns state and first request."""
        raise NotImplementedError

    def memory_setup(self, sock: socket.socket) -> None:
        self.producer_setup(sock)

    def settled(self, sock: socket.socket, n: int) -> bool:
        """Asked on a side connection after the consumer got `n` messages: has the server taken
        every ack (delete) it sent? A confirmed flow ends when this says yes."""
        raise NotImplementedError


def ask(sock: socket.socket, request: bytes, end: bytes) -> bytes:
    """One request, its reply read up to and including `end`."""
    sock.sendall(request)
    return read_until(sock, end)


# MQKS


class MqksAckState(ConsumerState):
    push_only = False
    ID_RE = re.compile(rb"c0 ok (\S+) event=")

    def __init__(self, ack_each: bool = False) -> None:
        super().__init__()
        self.ack_each = ack_each  # one `ack` line per message, as msg.ack() and a person at nc send

    def feed(self, data: bytes, start: int, end: int) -> tuple[int, bytes]:
        ids = self.ID_RE.findall(data, start, end)
        if data.find(b" error ", start, end) >= 0:
            self.errors += data.count(b" error ", start, end)
        if not ids:
            return 0, b""
        if self.ack_each:  # still one write per chunk: the lines, joined in C
            return len(ids), b"a ack c0 " + b"\na ack c0 ".join(ids) + b"\n"
        # one batch ack per chunk (MQKS extension): a C join, not a loop
        return len(ids), b"a ack c0 " + b" ".join(ids) + b"\n"


class MqksAutoState(ConsumerState):
    error_needle = b" error "

    def feed(self, data: bytes, start: int, end: int) -> tuple[int, bytes]:
        if data.find(b" error ", start, end) >= 0:
            self.errors += data.count(b" error ", start, end)
        return data.count(MARKER, start, end), b""


class Mqks(Proto):
    name = "mqks"
    producer_error = b" error "
    barrier_request = b"z ping done\n"
    barrier_reply = b"z ok done"
    confirm_reply = b" ok "  # `{rid} ok \n`, sent once the message is durable under the fsync policy

    def __init__(self, manual_ack: bool = False, event: bytes = b"bench.ev", confirm: bool = False,
                 ack_each: bool = False, token: bytes | None = None) -> None:
        self.manual_ack = manual_ack
        self.event = event
        self.confirm = confirm
        self.ack_each = ack_each
        self.token = token  # sent with `auth` first on every connection (bench/scopes.py)

    def _auth(self, sock: socket.socket) -> None:
        if self.token is not None:
            sock.sendall(b"a auth " + self.token + b"\n")
            line = read_until(sock, b"\n").split(b"\n", 1)[0]
            if not line.startswith(b"a ok"):
                raise RuntimeError(f"mqks auth failed: {line!r}")

    def producer_setup(self, sock: socket.socket) -> None:
        self._auth(sock)

    def publish(self, start: int, count: int, ts_ns: int = 0) -> bytes:
        action = b" publish --confirm " if self.confirm else b" publish "
        tail = action + self.event + b" " + payload(ts_ns) + b"\n"
        return b"".join([b"m%d%s" % (i, tail) for i in range(start, start + count)])

    def consumer_setup(self, sock: socket.socket, index: int) -> tuple[ConsumerState, bytes]:
        if index < 10:
            queue, binding = b"bench.qx%d" % index, self.event
        else:
            queue, binding = b"bench.qm%d" % index, self.event.rsplit(b".", 1)[0] + b".*"
        flags = b" --manual-ack" if self.manual_ack else b""
        self._auth(sock)
        sock.sendall(b"c0 consume --confirm " + queue + b" " + binding + flags + b"\n")
        buf = b""
        while True:
            buf = read_until(sock, b"\n", buf)
            line, _, buf = buf.partition(b"\n")
            if line.rstrip() == b"c0 ok":
                break
            if b" error " in line:
                raise RuntimeError(f"mqks consume failed: {line!r}")
        return (MqksAckState(self.ack_each) if self.manual_ack else MqksAutoState()), b""

    def memory_setup(self, sock: socket.socket) -> None:
        sock.sendall(b"r rebind --confirm bench.w4q " + self.event + b"\n")
        buf = read_until(sock, b"\n")
        if not buf.startswith(b"r ok"):
            raise RuntimeError(f"mqks rebind failed: {buf!r}")

    def settled(self, sock: socket.socket, n: int) -> bool:
        line = ask(sock, b"e _eval state.stats()\n", b"\n").split(b"\n", 1)[0]
        if not line.startswith(b"e ok "):
            raise RuntimeError(f"mqks _eval failed: {line[:300]!r}")
        st = ast.literal_eval(line[5:].decode())
        return st.get("acked", 0) >= n and not st.get("messages_unacked")


# NATS core


class Nats(Proto):
    name = "nats"
    barrier_request = b"PING\r\n"
    barrier_reply = b"PONG"

    def __init__(self, subject: bytes = b"bench.ev") -> None:
        self.subject = subject

    def _handshake(self, sock: socket.socket) -> None:
        read_until(sock, b"\r\n")  # INFO
        sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"echo":false}\r\nPING\r\n')
        read_until(sock, b"PONG")

    def producer_setup(self, sock: socket.socket) -> None:
        self._handshake(sock)

    def publish(self, start: int, count: int, ts_ns: int = 0) -> bytes:
        return (b"PUB " + self.subject + b" 100\r\n" + payload(ts_ns) + b"\r\n") * count

    def consumer_setup(self, sock: socket.socket, index: int) -> tuple[ConsumerState, bytes]:
        self._handshake(sock)
        subject = self.subject if index < 10 else self.subject.rsplit(b".", 1)[0] + b".*"
        sock.sendall(b"SUB " + subject + b" 1\r\nPING\r\n")
        read_until(sock, b"PONG")
        return ConsumerState(), b""


# Redis pub/sub


class RedisPubSub(Proto):
    name = "redis-pubsub"
    barrier_request = resp(b"PING")
    barrier_reply = b"+PONG"

    def __init__(self, channel: bytes = b"bench.ev") -> None:
        self.channel = channel

    def publish(self, start: int, count: int, ts_ns: int = 0) -> bytes:
        return resp(b"PUBLISH", self.channel, payload(ts_ns)) * count

    def consumer_setup(self, sock: socket.socket, index: int) -> tuple[ConsumerState, bytes]:
        if index < 10:
            sock.sendall(resp(b"SUBSCRIBE", self.channel))
        else:
            sock.sendall(resp(b"PSUBSCRIBE", self.channel.rsplit(b".", 1)[0] + b".*"))
        read_until(sock, b":1\r\n")
        return ConsumerState(), b""


# Redis Streams


class RedisStreamState(ConsumerState):
    """One XREADGROUP in flight; a reply is complete when it holds as many markers as its header says."""

    push_only = False
    HEADER_RE = re.compile(rb"\*1\r\n\*2\r\n\$\d+\r\n[^\r]*\r\n\*(\d+)\r\n")
    ID_RE = re.compile(rb"\r\n\*2\r\n\$\d+\r\n(\d+-\d+)\r\n")

    def __init__(self, proto: RedisStreams) -> None:
        self.proto = proto
        self.parts: list[bytes] = []
        self.expected = -1
        self.seen = 0

    def feed(self, data: bytes, start: int, end: int) -> tuple[int, bytes]:
        body = data[start:end] if start or end < len(data) else data
        self.parts.append(body)
        n = body.count(MARKER)
        self.seen += n
        if self.expected < 0:
            head = b"".join(self.parts) if len(self.parts) > 1 else body
            m = self.HEADER_RE.search(head)
            if m is None:
                if b"-ERR" in head or b"-NOGROUP" in head:
                    self.errors += 1
                if b"*-1\r\n" in head:  # timed out empty: ask again
                    self.parts.clear()
                    return n, self.proto.read_request
                return n, b""
            self.expected = int(m.group(1))
        if self.seen < self.expected:
            return n, b""
        reply = b"".join(self.parts) if len(self.parts) > 1 else body
        self.parts.clear()
        self.expected = -1
        self.seen = 0
        if not self.proto.ack:
            return n, self.proto.read_request
        ids = self.ID_RE.findall(reply)
        if self.proto.ack_each:  # one XACK per entry, as a client acking each message sends
            stream = self.proto.stream
            return n, b"".join([resp(b"XACK", stream, b"g", entry) for entry in ids]) + self.proto.read_request
        return n, resp(b"XACK", self.proto.stream, b"g", *ids) + self.proto.read_request


class RedisStreams(Proto):
    name = "redis-streams"
    barrier_request = resp(b"PING")
    barrier_reply = b"+PONG"
    confirm_reply = b"$"  # XADD answers the new id as a bulk string, `$15\r\n...`
    READ_COUNT = 2000

    def __init__(self, ack: bool = False, stream: bytes = b"bench.ev", ack_each: bool = False) -> None:
        self.ack = ack
        self.ack_each = ack_each
        self.stream = stream
        noack = () if ack else (b"NOACK",)
        self.read_request = resp(b"XREADGROUP", b"GROUP", b"g", b"c", b"COUNT", b"%d" % self.READ_COUNT,
                                 b"BLOCK", b"1000", *noack, b"STREAMS", stream, b">")

    def publish(self, start: int, count: int, ts_ns: int = 0) -> bytes:
        return resp(b"XADD", self.stream, b"*", b"p", payload(ts_ns)) * count

    def consumer_setup(self, sock: socket.socket, index: int) -> tuple[ConsumerState, bytes]:
        sock.sendall(resp(b"XGROUP", b"CREATE", self.stream, b"g", b"$", b"MKSTREAM"))
        got = read_until(sock, b"\r\n")
        if not got.startswith(b"+OK"):
            raise RuntimeError(f"XGROUP CREATE failed: {got!r}")
        return RedisStreamState(self), self.read_request

    def settled(self, sock: socket.socket, n: int) -> bool:
        # XPENDING's summary starts with the count of delivered, un-acked entries: `*4\r\n:0\r\n...`;
        # the PING behind it marks the end of the summary, whatever its shape
        reply = ask(sock, resp(b"XPENDING", self.stream, b"g") + resp(b"PING"), b"+PONG\r\n")
        if not reply.startswith(b"*4\r\n:"):
            raise RuntimeError(f"XPENDING: {reply[:200]!r}")
        return reply[5:reply.index(b"\r\n", 5)] == b"0"


# beanstalkd


class BeanstalkState(ConsumerState):
    """Keeps `credit` reserves outstanding; deletes every job it got, in one write per chunk.

    With a `limit` it never asks for more jobs than that in all: a reserve left waiting at the
    end would hold back the deletes behind it (beanstalkd runs a connection's commands in turn).
    """

    push_only = False
    ID_RE = re.compile(rb"RESERVED (\d+) ")

    def __init__(self, limit: int = 0, asked: int = 0) -> None:
        self.limit = limit
        self.asked = asked

    def feed(self, data: bytes, start: int, end: int) -> tuple[int, bytes]:
        ids = self.ID_RE.findall(data, start, end)
        if not ids:
            return 0, b""
        more = len(ids)
        if self.limit:
            more = min(more, self.limit - self.asked)
            self.asked += more
        return len(ids), b"delete " + b"\r\ndelete ".join(ids) + b"\r\n" + b"reserve\r\n" * more


class Beanstalkd(Proto):
    name = "beanstalkd"
    producer_error = b"_"  # OUT_OF_MEMORY, JOB_TOO_BIG, BAD_FORMAT, EXPECTED_CRLF, UNKNOWN_COMMAND
    barrier_request = b"stats-tube bench\r\n"
    barrier_reply = b"OK "
    confirm_reply = b"INSERTED "  # with a binlog, after the job's write (and its fsync under -f 0)
    CREDIT = 1000

    def producer_setup(self, sock: socket.socket) -> None:
        sock.sendall(b"use bench\r\n")
        read_until(sock, b"USING bench\r\n")

    def publish(self, start: int, count: int, ts_ns: int = 0) -> bytes:
        return (b"put 0 0 60 100\r\n" + payload(ts_ns) + b"\r\n") * count

    def consumer_setup(self, sock: socket.socket, index: int) -> tuple[ConsumerState, bytes]:
        sock.sendall(b"watch bench\r\nignore default\r\n")
        read_until(sock, b"WATCHING", count=2)
        credit = min(self.CREDIT, self.limit) if self.limit else self.CREDIT
        return BeanstalkState(self.limit, credit), b"reserve\r\n" * credit

    def settled(self, sock: socket.socket, n: int) -> bool:
        stats = tube_stats(sock)
        return stats.get(b"current-jobs-ready") == b"0" and stats.get(b"current-jobs-reserved") == b"0"


def tube_stats(sock: socket.socket, tube: bytes = b"bench") -> dict[bytes, bytes]:
    """beanstalkd's `stats-tube` as a dict of bytes."""
    head = ask(sock, b"stats-tube " + tube + b"\r\n", b"\r\n")
    if not head.startswith(b"OK "):
        raise RuntimeError(f"stats-tube: {head[:200]!r}")
    size = int(head[3:head.index(b"\r\n")])
    body_start = head.index(b"\r\n") + 2
    while len(head) < body_start + size + 2:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed in stats-tube")
        head += chunk
    body = head[body_start:body_start + size]
    out = {}
    for line in body.split(b"\n"):
        key, sep, value = line.partition(b": ")
        if sep:
            out[key.strip()] = value.strip()
    return out


# Processes


@dataclass
class Flow:
    """What one run sends and expects."""

    proto: Proto
    host: str
    port: int
    n: int                      # messages the producer publishes
    fanout: int = 1             # consumer connections; each gets every message
    window: int = 50_000        # max messages the producer may be ahead of the consumers (per connection)
    core: int | None = None     # generator core, None = unpinned
    timeout_s: float = 60.0
    rate: int = 0               # > 0: paced at this many msg/s, timestamped (w3)
    chunk: int = CHUNK_MESSAGES
    counter_binary: str | None = None  # count push deliveries in C (bench/count.c) when set
    confirm: bool = False       # w5: at most `window` publishes unconfirmed; done once all are confirmed
                                # and the server shows every message acked (Proto.settled)
    tls_ca: str | None = None   # set: every connection speaks TLS to `port`, trusting this CA


def _drain(sock: socket.socket, proto: Proto, stats: dict, barrier: threading.Event, confirm: bool = False) -> None:
    """Reads the producer's replies and only counts them (and, if `confirm`, counts the confirms
    into stats["confirmed"], with the time of the last one in stats["t_confirmed"])."""
    tail = b""
    errors = 0
    needle = proto.barrier_reply
    mark = proto.confirm_reply
    edge = len(mark) - 1
    ctail = b""  # the last len(mark) - 1 bytes: a confirm cut across two chunks counts once
    while True:
        try:
            chunk = sock.recv(RECV_BYTES)
        except OSError:
            break
        if not chunk:
            break
        errors += chunk.count(proto.producer_error)
        if confirm:
            got = chunk.count(mark) + ((ctail + chunk[:edge]).count(mark) if edge else 0)
            if edge:
                ctail = (ctail + chunk)[-edge:]
            if got:
                stats["confirmed"] += got
                stats["t_confirmed"] = now_ns()
        if needle and not barrier.is_set():
            if needle in tail + chunk[: len(needle)] or needle in chunk:
                barrier.set()
            tail = chunk[-len(needle):]
        stats["reply_bytes"] += len(chunk)
    stats["errors"] = errors


def producer_main(flow: Flow, counter, ready, go, stop, results) -> None:
    try:
        pin(flow.core)
        sock = connect(flow.host, flow.port, flow.tls_ca)
        flow.proto.producer_setup(sock)
        sock.settimeout(None)
        stats = {"reply_bytes": 0, "errors": 0, "confirmed": 0, "t_confirmed": 0}
        barrier = threading.Event()
        drain = threading.Thread(target=_drain, args=(sock, flow.proto, stats, barrier, flow.confirm), daemon=True)
        chunks = []
        if not flow.rate:
            for start in range(0, flow.n, flow.chunk):
                chunks.append(flow.proto.publish(start, min(flow.chunk, flow.n - start)))
        if flow.tls_ca is None:
            # over TLS no second thread may read while this one writes (one OpenSSL object per socket);
            # a producer that does not confirm gets no replies to drain anyway
            drain.start()
        ready.send("ready")
        go.wait()
        t0 = now_ns()
        sent = 0
        per_event = flow.fanout
        if flow.rate:
            deadline = t0 + int(flow.timeout_s * 1e9)
            while sent < flow.n:
                now = now_ns()
                if now > deadline:
                    break
                due = min(flow.n, (now - t0) * flow.rate // 1_000_000_000 + 1)
                if due > sent:
                    sock.sendall(flow.proto.publish(sent, due - sent, now))
                    sent = due
                time.sleep(0.0002)
        elif flow.confirm:
            window = flow.window
            deadline = t0 + int(flow.timeout_s * 1e9)
            for data in chunks:
                # ahead of neither the consumer nor the confirms by more than the window
                while sent - min(counter.value, stats["confirmed"]) > window:
                    time.sleep(0.0002)
                    if now_ns() > deadline:
                        break
                sock.sendall(data)
                sent += flow.chunk
        else:
            window = flow.window
            deadline = t0 + int(flow.timeout_s * 1e9)
            for data in chunks:
                while sent - counter.value // per_event > window:
                    time.sleep(0.0002)
                    if now_ns() > deadline:
                        break
                sock.sendall(data)
                sent += flow.chunk
        t_sent = now_ns()
        if flow.confirm:
            deadline = t0 + int(flow.timeout_s * 1e9)
            while stats["confirmed"] < flow.n and now_ns() < deadline:
                time.sleep(0.0002)
            results.send({"t0": t0, "t_sent": t_sent, "confirmed": stats["confirmed"],
                          "t_confirmed": stats["t_confirmed"]})
        else:
            results.send({"t0": t0, "t_sent": t_sent})
        stop.wait(flow.timeout_s + 30)
        results.send({"producer_errors": stats["errors"], "reply_bytes": stats["reply_bytes"]})
        sock.close()
    except Exception as e:  # the parent reports it
        results.send({"error": f"producer: {type(e).__name__}: {e}"})


def consumer_main(flow: Flow, counter, deadline_ns, ready, stop, results, latency: bool) -> None:
    try:
        pin(flow.core)
        sel = selectors.DefaultSelector()
        states = []
        if flow.confirm:
            flow.proto.limit = flow.n  # this process's copy: ask for no more than will come
        for index in range(flow.fanout):
            sock = connect(flow.host, flow.port, flow.tls_ca)
            index_for = index if flow.fanout > 1 else 0
            state, first = flow.proto.consumer_setup(sock, index_for)
            sock.settimeout(flow.timeout_s)
            if first:
                sock.sendall(first)
            states.append(state)
            sel.register(sock, selectors.EVENT_READ, state)
        ready.send("ready")
        target = flow.n * flow.fanout
        # the C counter reads raw sockets: TLS deliveries are counted here, in Python
        if flow.counter_binary and flow.tls_ca is None and not latency:
            if all(s.push_only for s in states):
                _count_in_c(flow, [flow.counter_binary, MARKER, states[0].error_needle or b""], sel, counter,
                            deadline_ns, stop, results, target)
                return
            if all(s.acks_in_c for s in states):
                _count_in_c(flow, [ACKER_BINARY], sel, counter, deadline_ns, stop, results, target)
                return
        got = 0
        lat: list[int] = []
        ts_findall = TS_RE.findall  # pattern.findall(data, pos, endpos)
        t_end = 0
        setup_deadline = now_ns() + int(SETUP_TIMEOUT_SECONDS * 3e9)
        while got < target:
            # the parent sets `deadline_ns` to go + timeout when it starts the producer
            left = ((deadline_ns.value or setup_deadline) - now_ns()) / 1e9
            if left <= 0:
                break
            for key, _ in sel.select(min(left, 0.5)):
                state = key.data
                sock = key.fileobj
                try:
                    chunk = recv_tls(sock, RECV_BYTES) if flow.tls_ca is not None else sock.recv(RECV_BYTES)
                except (BlockingIOError, TimeoutError):
                    continue
                if not chunk:
                    raise ConnectionError(f"server closed a consumer connection after {got} deliveries")
                # whole lines only; the partial last line waits in `tail`. Offsets, not slices:
                # a 1 MiB chunk is never copied in Python.
                n = 0
                reply = b""
                start = 0
                if state.tail:
                    first = chunk.find(b"\n")
                    if first < 0:
                        state.tail += chunk
                        continue
                    head = state.tail + chunk[: first + 1]
                    n, reply = state.feed(head, 0, len(head))
                    if latency:
                        stamp = now_ns()
                        lat.extend([stamp - int(ts) for ts in ts_findall(head)])
                    start = first + 1
                end = chunk.rfind(b"\n") + 1
                if end > start:
                    n2, reply2 = state.feed(chunk, start, end)
                    n += n2
                    reply += reply2
                    if latency:
                        stamp = now_ns()
                        lat.extend([stamp - int(ts) for ts in ts_findall(chunk, start, end)])
                state.tail = chunk[end:] if end < len(chunk) else b""
                if reply:
                    sock.sendall(reply)
                if n:
                    got += n
                    state.got += n
                    t_end = now_ns()
                    counter.value = got
        if flow.confirm and got >= target:
            t_end = _wait_settled(flow, target, deadline_ns.value or setup_deadline)
        results.send({"t_end": t_end, "got": got, "target": target,
                      "consumer_errors": sum(s.errors for s in states), "latencies_ns": lat,
                      "per_connection": [s.got for s in states]})
        stop.wait(flow.timeout_s + 30)
        for key in list(sel.get_map().values()):
            key.fileobj.close()
    except Exception as e:
        results.send({"error": f"consumer: {type(e).__name__}: {e}"})


def _wait_settled(flow: Flow, n: int, deadline: int) -> int:
    """Poll the server on a side connection until it shows every ack taken; the time it did (0: never)."""
    with connect(flow.host, flow.port, flow.tls_ca) as side:
        flow.proto.producer_setup(side)
        while now_ns() < deadline:
            if flow.proto.settled(side, n):
                return now_ns()
            time.sleep(0.0005)
    return 0


def _count_in_c(flow: Flow, command: list, sel, counter, deadline_ns, stop, results, target: int) -> None:
    """Hand the subscribed sockets to bench/bin/count (or ack); relay its progress into the shared counter."""
    socks = [key.fileobj for key in sel.get_map().values()]
    fds = [s.fileno() for s in socks]
    step = max(1, min(flow.window * flow.fanout // 4, 10_000))
    proc = subprocess.Popen([*command, str(target), str(step), *map(str, fds)], pass_fds=fds,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    done = None
    setup_deadline = now_ns() + int(SETUP_TIMEOUT_SECONDS * 3e9)
    got = 0
    try:
        out = proc.stdout
        waiter = selectors.DefaultSelector()
        waiter.register(out, selectors.EVENT_READ)
        buf = b""
        while done is None:
            left = ((deadline_ns.value or setup_deadline) - now_ns()) / 1e9
            if left <= 0:
                proc.stdin.close()  # tells it to stop and report what it has
                left = 5
            if not waiter.select(min(left, 0.5)):
                continue
            data = os.read(out.fileno(), 65536)
            if not data:
                break
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.startswith(b"p "):
                    got = int(line[2:])
                    counter.value = got
                elif line.startswith(b"done "):
                    done = [int(x) for x in line.split()[1:]]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    if done is None:
        results.send({"error": f"consumer: {command[0]} ended without a result after {got}"})
        return
    got, errors, t_end, *per_connection = done
    counter.value = got
    results.send({"t_end": t_end, "got": got, "target": target, "consumer_errors": errors, "latencies_ns": [],
                  "per_connection": per_connection})
    stop.wait(flow.timeout_s + 30)
    for sock in socks:
        sock.close()


@dataclass
class RunResult:
    ok: bool
    rate: float = 0.0                 # deliveries/s, end to end
    got: int = 0
    target: int = 0
    seconds: float = 0.0
    send_rate: float = 0.0            # messages/s the producer managed to write
    errors: int = 0
    note: str = ""
    latencies_ns: list[int] = field(default_factory=list)


def _recv(conn, timeout: float) -> dict:
    if not conn.poll(timeout):
        return {"error": f"no answer within {timeout:.0f}s"}
    return conn.recv()


def run_flow(flow: Flow, latency: bool = False, check=None) -> RunResult:
    """Fork consumer + producer, start the clock, return end-to-end figures.

    `check()`, if given, runs after the consumer is done and before any connection closes
    (so un-acked counts are still meaningful); its string goes into `note`.
    """
    ctx = mp.get_context("fork")
    counter = ctx.RawValue("q", 0)
    deadline_ns = ctx.RawValue("q", 0)
    go, stop = ctx.Event(), ctx.Event()
    c_ready_r, c_ready_w = ctx.Pipe(False)
    c_res_r, c_res_w = ctx.Pipe(False)
    p_ready_r, p_ready_w = ctx.Pipe(False)
    p_res_r, p_res_w = ctx.Pipe(False)
    consumer = ctx.Process(target=consumer_main, args=(flow, counter, deadline_ns, c_ready_w, stop, c_res_w, latency),
                           daemon=True)
    producer = ctx.Process(target=producer_main, args=(flow, counter, p_ready_w, go, stop, p_res_w), daemon=True)
    result = RunResult(ok=False, target=flow.n * flow.fanout)
    try:
        for proc, ready_r, res_r, what in ((consumer, c_ready_r, c_res_r, "consumer"),
                                           (producer, p_ready_r, p_res_r, "producer")):
            result.note = _start_and_wait_ready(proc, ready_r, res_r, what)
            if result.note:
                return result
        deadline_ns.value = now_ns() + int(flow.timeout_s * 1e9)
        go.set()
        c = _recv(c_res_r, flow.timeout_s + 10)
        p = _recv(p_res_r, flow.timeout_s + 10 if flow.confirm else 10)
        if "error" in c or "error" in p:
            result.note = "; ".join(x["error"] for x in (c, p) if "error" in x)
            return result
        result.got = c["got"]
        t_end = c["t_end"]
        if flow.confirm and t_end:  # end to end: the last confirm and the last ack both count
            t_end = max(t_end, p["t_confirmed"])
        result.seconds = max(1e-9, (t_end - p["t0"]) / 1e9) if t_end else 0.0
        result.rate = result.got / result.seconds if result.seconds else 0.0
        result.send_rate = flow.n / max(1e-9, (p["t_sent"] - p["t0"]) / 1e9)
        result.latencies_ns = c["latencies_ns"]
        result.errors = c["consumer_errors"]
        result.ok = result.got >= result.target
        if not result.ok:
            result.note = f"timeout: {result.got}/{result.target} delivered"
        elif flow.confirm and not c["t_end"]:
            result.ok = False
            result.note = "timeout: the server never showed every message acked"
        if flow.confirm and p["confirmed"] < flow.n:
            result.ok = False
            result.note = (result.note + "; " if result.note else "") + f"{p['confirmed']}/{flow.n} confirmed"
        per = c["per_connection"]
        if result.ok and flow.fanout > 1 and (min(per) != flow.n or max(per) != flow.n):
            result.note = f"uneven deliveries per connection: {min(per)}..{max(per)} (each should get {flow.n})"
            result.ok = False
        if check is not None:
            note = check()
            if note:
                result.note = (result.note + "; " if result.note else "") + note
        stop.set()
        p2 = _recv(p_res_r, 10)
        result.errors += p2.get("producer_errors", 0)
        if result.errors:
            result.note = (result.note + "; " if result.note else "") + f"{result.errors} error replies"
        return result
    finally:
        stop.set()
        go.set()
        for proc in (producer, consumer):
            if proc.pid is not None:
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
                    proc.join(2)


def _start_and_wait_ready(proc, ready_r, res_r, what: str) -> str:
    """Start a generator process and wait for its set-up; returns "" or why it failed."""
    proc.start()
    if not ready_r.poll(SETUP_TIMEOUT_SECONDS * 2):
        return f"{what} setup timed out"
    if res_r.poll(0):
        return res_r.recv().get("error", f"{what} failed")
    ready_r.recv()
    return ""


def memory_main(proto: Proto, host: str, port: int, n: int, core: int | None, server_pid: int,
                timeout_s: float, results) -> None:
    """Queue `n` messages with no consumer; report the server's VmRSS before and after."""
    try:
        pin(core)
        sock = connect(host, port)
        proto.memory_setup(sock)
        sock.settimeout(None)
        stats = {"reply_bytes": 0, "errors": 0}
        barrier = threading.Event()
        drain = threading.Thread(target=_drain, args=(sock, proto, stats, barrier), daemon=True)
        time.sleep(0.2)  # let the server settle after setup before the baseline
        rss0 = vm_rss(server_pid)
        drain.start()
        t0 = now_ns()
        step = 10_000
        for start in range(0, n, step):
            sock.sendall(proto.publish(start, min(step, n - start)))
        sock.sendall(proto.barrier_request)
        if not barrier.wait(timeout_s):
            raise TimeoutError(f"no barrier reply within {timeout_s}s")
        t1 = now_ns()
        time.sleep(0.2)
        rss1 = vm_rss(server_pid)
        results.send({"rss0": rss0, "rss1": rss1, "seconds": (t1 - t0) / 1e9})
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        drain.join(5)
        results.send({"errors": stats["errors"]})
    except Exception as e:
        results.send({"error": f"memory: {type(e).__name__}: {e}"})


def vm_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def run_memory(proto: Proto, host: str, port: int, n: int, core: int | None, server_pid: int,
               timeout_s: float) -> dict:
    ctx = mp.get_context("fork")
    r, w = ctx.Pipe(False)
    proc = ctx.Process(target=memory_main, args=(proto, host, port, n, core, server_pid, timeout_s, w), daemon=True)
    proc.start()
    try:
        first = _recv(r, timeout_s + 30)
        if "error" in first:
            return first
        second = _recv(r, 10)
        first["errors"] = second.get("errors", 0)
        return first
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(2)

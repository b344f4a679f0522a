"""A small blocking-call MQKS line client for Spark processes (plain sockets, no gevent).

Spark's driver and executor Python workers must not import gevent or monkey-patch anything,
so the data source speaks the wire protocol (`{rid} {action} {data}\\n`) over a plain socket.
The client sends pipelined lines and reads whole lines back; it never interprets them.
While a long send waits for room, it keeps reading: the server may be writing deliveries to us
at the same time, and a client that only writes could deadlock with a server that only writes.
"""

from __future__ import annotations

import select
import socket
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# the gevent client's own classes, so one `except MqksError` serves both clients; importable from
# here as before, with split_answer, which user code (pipelines/) imports from here too
from mqks.client.errors import MqksConnectionError, MqksError
from mqks.client.placement import Placement
from mqks.client.tls import AUTH_TOKEN_ENV, client_context
from mqks.client.wire import answer_error, auth_refusal, hello_info, split_answer

__all__ = ["LineClient", "MqksConnectionError", "MqksError", "Security", "split_answer"]

RECV_BYTES = 65536
BLOCK_RECV_BYTES = 1 << 20  # read_through: a fetch answer is megabytes, read in as few calls as the kernel allows
QUIET_SECONDS = 0.05  # read_through looks through every byte for its line only after this long without one
IO_TIMEOUT_SECONDS = 60.0  # no progress for this long on a send: the connection is dead
MAX_LINES_PER_READ = 100_000  # bounds one read_lines() call; the rest waits in the kernel
AUTH_RID = b"spark.auth"
HELLO_RID = b"spark.hello"
# a non-blocking TLS socket that needs the other direction first: try again later, as for EAGAIN
WOULD_BLOCK = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


@dataclass(frozen=True, slots=True)
class Security:
    """The data source's options `tls`, `tlsCa` and `token`: plain strings, so they pickle to the executors."""

    tls: bool = False
    tls_ca: str | None = None
    token: str | None = field(default=None, repr=False)  # never in a log line or a plan

    @classmethod
    def parse(cls, options: Mapping[str, str], environ: Mapping[str, str]) -> Security:
        """From the options; `token` defaults to the driver's MQKS_AUTH_TOKEN (executors may not have it)."""
        tls = str(options.get("tls") or "false").lower()
        if tls not in ("true", "false"):
            raise ValueError(f"mqks option tls={tls!r} must be true or false")
        tls_ca = options.get("tlsCa") or None
        token = options.get("token") or environ.get(AUTH_TOKEN_ENV) or None
        if token is not None and (not token.strip() or any(char.isspace() for char in token)):
            raise ValueError("mqks option token must be one word without whitespace")
        return cls(tls=tls == "true" or tls_ca is not None, tls_ca=tls_ca, token=token)


class LineClient:
    """One TCP (or TLS) connection: `send()` whole lines, `read_lines()` whole lines back (bytes, no newline)."""

    __slots__ = ("host", "port", "sock", "tail", "ready", "closed", "placement")

    def __init__(self, host: str, port: int, timeout_seconds: float = 10.0, security: Security | None = None, *,
                 hello: bool = False, tls_hostname: str | None = None) -> None:
        """Connect, then `auth` (with a token) and, with `hello`, read the broker's slot map into `placement`.

        `tls_hostname` is the name the certificate is checked against when `host` is a worker's direct address.
        """
        self.host = host
        self.port = port
        self.placement: Placement | None = None  # None: one worker, an older broker, or no hello asked
        self.sock = socket.create_connection((host, port), timeout=timeout_seconds)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if security is not None and security.tls:
            try:  # the handshake runs blocking, under the connect timeout
                self.sock = client_context(security.tls_ca).wrap_socket(self.sock,
                                                                        server_hostname=tls_hostname or host)
            except BaseException:
                self.sock.close()
                raise
        self.sock.setblocking(False)
        self.tail = b""
        self.ready: list[bytes] = []  # lines read but not yet returned
        self.closed = False
        token = security.token.encode() if security is not None and security.token else None
        if token is not None or hello:
            self._introduce(token, hello, timeout_seconds)

    def _introduce(self, token: bytes | None, hello: bool, timeout_seconds: float) -> None:
        """Send `auth` and/or `hello` and wait for their answers; MqksError when the broker refuses the token.

        A broker without `hello` answers it with an error: that only means no slot map.
        """
        waiting = ([AUTH_RID] if token is not None else []) + ([HELLO_RID] if hello else [])
        self.send(([AUTH_RID + b" auth " + token] if token is not None else []) + ([HELLO_RID + b" hello"] if hello
                                                                                   else []))
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            lines = self.read_lines(0.2)
            for index, line in enumerate(lines):
                rid, status, rest = split_answer(line)
                if rid not in waiting:
                    continue
                waiting.remove(rid)
                if rid == HELLO_RID:
                    self.placement = Placement.from_hello(hello_info(rest)) if status == b"ok" else None
                elif status != b"ok" and (refusal := auth_refusal(answer_error(rid, rest))) is not None:
                    self.close()
                    raise MqksError(f"mqks {self.host}:{self.port}: {refusal}")
                if not waiting:
                    self.ready[:0] = lines[index + 1:]  # nothing else was sent yet, but keep whatever came
                    return
        self.close()
        raise MqksConnectionError(f"mqks {self.host}:{self.port}: no answer to auth or hello in {timeout_seconds}s")

    def _fail(self, what: str) -> MqksConnectionError:
        return MqksConnectionError(f"mqks {self.host}:{self.port}: {what}")

    def send(self, lines: list[bytes]) -> None:
        """Write every line, newline-terminated; reads incoming lines while the socket is full."""
        if lines:
            self.send_block(b"\n".join(lines) + b"\n")

    def send_block(self, block: bytes | memoryview) -> None:
        """Write lines already joined, each newline-terminated; reads incoming lines while the socket is full."""
        data = memoryview(block)
        deadline = time.monotonic() + IO_TIMEOUT_SECONDS
        while data:
            readable, writable, _ = select.select([] if self.closed else [self.sock], [self.sock], [], 1.0)
            if readable:
                self._receive()
            if writable:
                try:
                    sent = self.sock.send(data)
                except WOULD_BLOCK:
                    continue
                except OSError as e:
                    raise self._fail(f"send failed: {e}") from e
                data = data[sent:]
                deadline = time.monotonic() + IO_TIMEOUT_SECONDS
            elif time.monotonic() > deadline:
                raise self._fail(f"send made no progress for {IO_TIMEOUT_SECONDS}s")

    def read_lines(self, timeout_seconds: float) -> list[bytes]:
        """Every complete line that has arrived, waiting at most `timeout_seconds` for the first.

        Returns [] on timeout; raises MqksConnectionError once the server closed the connection
        and every line it sent before closing was returned.
        """
        if (not self.ready and not self.closed
                and (self._pending() or select.select([self.sock], [], [], timeout_seconds)[0])):
            self._receive()
        while not self.closed and len(self.ready) < MAX_LINES_PER_READ and self._receive():
            pass
        if not self.ready and self.closed:
            raise self._fail("server closed the connection")
        lines, self.ready = self.ready, []
        return lines

    def count_lines(self, timeout_seconds: float, flag: bytes) -> tuple[int, bytes | None]:
        """How many whole lines came, waiting at most `timeout_seconds` for the first, and the first of them
        that holds `flag` (or None): the lines are counted in bulk, never split (a sink's confirms).

        Raises MqksConnectionError once the server closed and every line it sent was counted.
        """
        count = len(self.ready)
        flagged = next((line for line in self.ready if flag in line), None)
        self.ready = []
        if not count and not self.closed and not (self._pending()
                                                  or select.select([self.sock], [], [], timeout_seconds)[0]):
            return 0, None
        while not self.closed:
            try:
                chunk = self.sock.recv(BLOCK_RECV_BYTES)
            except WOULD_BLOCK:
                break
            except OSError as e:
                raise self._fail(f"recv failed: {e}") from e
            if not chunk:
                self.closed = True
                break
            end = chunk.rfind(b"\n")
            if end < 0:
                self.tail += chunk
                continue
            whole = self.tail + chunk[: end + 1] if self.tail else chunk[: end + 1]
            self.tail = chunk[end + 1 :]
            count += whole.count(b"\n")
            if flagged is None and flag in whole:
                at = whole.index(flag)
                flagged = whole[whole.rfind(b"\n", 0, at) + 1 : whole.index(b"\n", at)]
        if not count and self.closed:
            raise self._fail("server closed the connection")
        return count, flagged

    def read_through(self, markers: tuple[bytes, ...], timeout_seconds: float,
                     accept: Callable[[bytes], bool] | None = None) -> bytearray | None:
        """Every byte up to and with the first whole line that starts with one of `markers` (and that `accept`
        takes, when given), as one buffer of its own.

        The bytes are not split into lines: a fetch answer of 20,000 lines is read as one block (lines an
        earlier call split come first). None when no such line came within `timeout_seconds` of silence; what
        arrived stays buffered. Raises MqksConnectionError once the server closed without sending one.
        """
        buf = bytearray()
        if self.ready:
            buf += b"\n".join(self.ready) + b"\n"
            self.ready = []
        buf += self.tail
        self.tail = b""
        patterns = [b"\n" + marker for marker in markers]
        scanned = 0  # a marker line starting before here was looked for already
        found = -1  # where the marker line starts, once seen
        silent = False
        while True:
            if found < 0 and buf.endswith(b"\n"):
                # an answer's last line is the last one that came (nothing else was asked on the connection
                # meanwhile): looking there alone saves a pass over every byte
                last = buf.rfind(b"\n", 0, len(buf) - 1) + 1
                if buf.startswith(markers, last) and (accept is None or accept(bytes(buf[last:-1]))):
                    found = last
            if found < 0 and silent:  # quiet, and no marker last: maybe it came with something after it
                if buf.startswith(markers):
                    found = 0
                else:
                    hits = [i + 1 for pattern in patterns if (i := buf.find(pattern, max(0, scanned - 1))) >= 0]
                    found = min(hits) if hits else -1
                    scanned = len(buf) if found < 0 else found
            if found >= 0 and (end := buf.find(b"\n", found)) >= 0:
                if accept is not None and not accept(bytes(memoryview(buf)[found:end])):
                    scanned, found = end + 1, -1  # a line that only looks like one (a msg id such as --end)
                    continue
                lines = bytes(memoryview(buf)[end + 1 :]).split(b"\n")  # usually nothing: the block is the answer
                self.tail = lines.pop()
                self.ready = lines
                del buf[end + 1 :]
                return buf  # not copied: callers read it in place
            if self.closed:
                self.tail = bytes(buf)
                raise self._fail("server closed the connection")
            try:
                chunk = self.sock.recv(BLOCK_RECV_BYTES)
            except WOULD_BLOCK:
                chunk = None
            except OSError as e:
                self.tail = bytes(buf)
                raise self._fail(f"recv failed: {e}") from e
            if chunk is None:
                if self._pending() or select.select([self.sock], [], [], QUIET_SECONDS)[0]:
                    continue
                if not silent:
                    silent = True
                    continue
                if not select.select([self.sock], [], [], timeout_seconds)[0]:
                    self.tail = bytes(buf)
                    return None
            elif chunk:
                buf += chunk
                silent = False
            else:
                self.closed = True

    def _receive(self) -> bool:
        """Read one chunk without blocking; False if nothing was there or the peer closed."""
        try:
            chunk = self.sock.recv(RECV_BYTES)
        except WOULD_BLOCK:
            return False
        except OSError as e:
            raise self._fail(f"recv failed: {e}") from e
        if not chunk:
            self.closed = True
            return False
        lines = (self.tail + chunk).split(b"\n")
        self.tail = lines.pop()
        self.ready.extend(lines)
        return True

    def _pending(self) -> int:
        """Bytes TLS has decrypted but not handed over: select cannot see them."""
        return self.sock.pending() if isinstance(self.sock, ssl.SSLSocket) else 0

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def connect_any(addresses: list[tuple[str, int]], security: Security | None = None, **options: Any) -> LineClient:
    """A connection to the first of `addresses` that takes one (a cluster's nodes, in turn); else the last error."""
    error: OSError | None = None
    for host, port in addresses:
        try:
            return LineClient(host, port, security=security, **options)
        except OSError as e:  # MqksConnectionError is one too
            error = e
    assert error is not None, "no address to connect to"
    raise error


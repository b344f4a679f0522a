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
import time

# the gevent client's own classes, so one `except MqksError` serves both clients; importable from
# here as before, with split_answer, which user code (pipelines/) imports from here too
from mqks.client.errors import MqksConnectionError, MqksError
from mqks.client.wire import split_answer

__all__ = ["LineClient", "MqksConnectionError", "MqksError", "split_answer"]

RECV_BYTES = 65536
IO_TIMEOUT_SECONDS = 60.0  # no progress for this long on a send: the connection is dead
MAX_LINES_PER_READ = 100_000  # bounds one read_lines() call; the rest waits in the kernel


class LineClient:
    """One TCP connection: `send()` whole lines, `read_lines()` whole lines back (bytes, no newline)."""

    __slots__ = ("host", "port", "sock", "tail", "ready", "closed")

    def __init__(self, host: str, port: int, timeout_seconds: float = 10.0) -> None:
        self.host = host
        self.port = port
        self.sock = socket.create_connection((host, port), timeout=timeout_seconds)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self.tail = b""
        self.ready: list[bytes] = []  # lines read but not yet returned
        self.closed = False

    def _fail(self, what: str) -> MqksConnectionError:
        return MqksConnectionError(f"mqks {self.host}:{self.port}: {what}")

    def send(self, lines: list[bytes]) -> None:
        """Write every line, newline-terminated; reads incoming lines while the socket is full."""
        if not lines:
            return
        data = memoryview(b"\n".join(lines) + b"\n")
        deadline = time.monotonic() + IO_TIMEOUT_SECONDS
        while data:
            readable, writable, _ = select.select([] if self.closed else [self.sock], [self.sock], [], 1.0)
            if readable:
                self._receive()
            if writable:
                try:
                    sent = self.sock.send(data)
                except BlockingIOError:
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
        if not self.ready and not self.closed and select.select([self.sock], [], [], timeout_seconds)[0]:
            self._receive()
        while not self.closed and len(self.ready) < MAX_LINES_PER_READ and self._receive():
            pass
        if not self.ready and self.closed:
            raise self._fail("server closed the connection")
        lines, self.ready = self.ready, []
        return lines

    def _receive(self) -> bool:
        """Read one chunk without blocking; False if nothing was there or the peer closed."""
        try:
            chunk = self.sock.recv(RECV_BYTES)
        except BlockingIOError:
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

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

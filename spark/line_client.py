"""A small blocking-socket MQKS line client for Spark processes.

Spark's driver and executor Python workers must not import gevent or monkey-patch anything,
so the data source speaks the wire protocol (`{rid} {action} {data}\\n`) over a plain socket.
It sends pipelined lines and reads whole lines back; it never interprets them: the reader and
the writer decide what each answer means.
"""

from __future__ import annotations

import select
import socket
import time

RECV_BYTES = 65536
CONNECT_TIMEOUT_SECONDS = 10.0


class MqksError(Exception):
    """The broker answered `{rid} error {error_id} {reason}`."""


class MqksConnectionError(MqksError):
    """The connection broke or timed out; the broker requeues the consumer's un-acked messages."""


class LineClient:
    """One TCP connection: `send()` whole lines, `read_lines()` whole lines back (bytes, no newline)."""

    __slots__ = ("host", "port", "sock", "tail")

    def __init__(self, host: str, port: int, timeout_seconds: float = CONNECT_TIMEOUT_SECONDS) -> None:
        self.host = host
        self.port = port
        self.sock = socket.create_connection((host, port), timeout=timeout_seconds)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)
        self.tail = b""

    def send(self, lines: list[bytes]) -> None:
        """Write every line, newline-terminated, with one `sendall`."""
        if lines:
            try:
                self.sock.sendall(b"\n".join(lines) + b"\n")
            except OSError as e:
                raise MqksConnectionError(f"mqks {self.host}:{self.port}: send failed: {e}") from e

    def read_lines(self, timeout_seconds: float) -> list[bytes]:
        """Every complete line that has arrived, waiting at most `timeout_seconds` for the first.

        Returns [] on timeout; raises MqksError if the server closed the connection.
        """
        deadline = time.monotonic() + timeout_seconds
        while True:
            wait = max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([self.sock], [], [], wait)
            if not readable:
                return []
            try:
                chunk = self.sock.recv(RECV_BYTES)
            except OSError as e:
                raise MqksConnectionError(f"mqks {self.host}:{self.port}: recv failed: {e}") from e
            if not chunk:
                raise MqksConnectionError(f"mqks {self.host}:{self.port}: server closed the connection")
            lines = (self.tail + chunk).split(b"\n")
            self.tail = lines.pop()
            if lines:
                # drain whatever else is already in the kernel buffer, without waiting
                while select.select([self.sock], [], [], 0)[0]:
                    try:
                        chunk = self.sock.recv(RECV_BYTES)
                    except OSError as e:
                        raise MqksConnectionError(f"mqks {self.host}:{self.port}: recv failed: {e}") from e
                    if not chunk:
                        break  # the next call reports the close
                    more = (self.tail + chunk).split(b"\n")
                    self.tail = more.pop()
                    lines.extend(more)
                    if len(lines) >= 100_000:
                        break  # bound one call's memory; the rest waits in the kernel
                return lines

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def split_answer(line: bytes) -> tuple[bytes, bytes, bytes]:
    """`{rid} ok|error {data}` -> (rid, status, data); tolerates `{rid} ok` without the space."""
    rid, _, rest = line.partition(b" ")
    status, _, data = rest.partition(b" ")
    return rid, status, data


def error_reason(data: bytes) -> str:
    """The text of an error answer's data (`{error_id} {reason}`), for exceptions."""
    return data.decode("utf-8", "replace")

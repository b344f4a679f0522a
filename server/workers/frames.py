"""The frames on a link, read and written in batches.

A link is one Unix socket per ordered pair of workers, opened by the worker that asks (see
links.py). A frame is a header line `{kind}{key} {size}\\n` and `size` bytes of payload; its
kind is one byte, named by `Frame`.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
from enum import IntEnum
from typing import Any

from gevent import ssl as gevent_ssl
from gevent.event import Event

log = logging.getLogger("mqks.peers")

NEWLINE = b"\n"
# what a link's reader or writer meets when the link ends under it: a TLS link that shut() shut in another greenlet
# reads as "Read on closed or unwrapped SSL socket." (ValueError), not as an end of file
LINK_ENDED = (OSError, ValueError)


class Frame(IntEnum):
    """The kind of a frame: its first byte.

    asker -> owner                                  owner -> asker
    P  `{event}{tail}` lines: publish them          >  bytes for session `key`'s client (or a gather)
    C  `{fanin} {event}{tail}` lines: as P, and     .  session `key` has run everything sent before
       answer each once durable                     c  `{fanin} ok` / `{fanin} error ...` lines
    E  `{retry} {queue}{tail}`: dead letters        B  `{queue} {event}...` lines: the queue's events
    S  client lines of session `key`                   now; a key other than `-` wants a K back; `-`, the
    M  answer `.{key}` when you get here               link's second frame: all of them (the link is ready)
                                                    Z  forget every binding of the owner (it restarted)
    X  session `key`'s client left
    W  `{bytes}`: session `key`'s client has taken that many bytes of `>` frames
    K  the owner's binding changes up to epoch `key` are applied here
    """

    PUBLISH = ord("P")
    PUBLISH_CONFIRMED = ord("C")
    DEAD_LETTERS = ord("E")
    SESSION_LINES = ord("S")
    MARK = ord("M")
    SESSION_LEFT = ord("X")
    CREDIT = ord("W")
    BINDINGS_APPLIED = ord("K")
    OUTPUT = ord(">")
    MARKED = ord(".")
    CONFIRMS = ord("c")
    BINDINGS = ord("B")
    FORGET_BINDINGS = ord("Z")


class FrameReader:
    """Frames out of a byte stream: (kind, key, payload).

    A frame larger than one read (a batch of deliveries can be megabytes) is gathered as a
    list of chunks and joined once, when its last byte is in: re-joining the partial buffer
    at every read would copy it over and over.
    """

    __slots__ = ("buffer", "parts", "have", "need")

    def __init__(self) -> None:
        self.buffer = b""
        self.parts: list[bytes] = []
        self.have = 0  # bytes in `parts`
        self.need = 0  # bytes the unfinished frame in `parts` takes, header included; 0: none

    def feed(self, chunk: bytes) -> list[tuple[int, bytes, bytes]]:
        if self.need:
            self.parts.append(chunk)
            self.have += len(chunk)
            if self.have < self.need:
                return []
            data = b"".join(self.parts)
            self.parts, self.have, self.need = [], 0, 0
        else:
            data = self.buffer + chunk if self.buffer else chunk
        frames: list[tuple[int, bytes, bytes]] = []
        pos, end = 0, len(data)
        while pos < end:
            newline = data.find(NEWLINE, pos)
            if newline < 0:
                break
            key, _, size = data[pos + 1 : newline].partition(b" ")
            stop = newline + 1 + int(size)
            if stop > end:
                self.parts, self.have, self.need = [data[pos:]], end - pos, stop - pos
                self.buffer = b""
                return frames
            frames.append((data[pos], key, data[newline + 1 : stop]))
            pos = stop
        self.buffer = data[pos:]
        return frames


class FrameSocket:
    """A link's socket and the frames owed on it; the open run of lines is closed into a frame at flush."""

    __slots__ = ("sock", "fd", "out", "run_kind", "run_key", "run", "flush_pending", "pending", "writing", "wake",
                 "closed", "name", "backlog", "max_backlog", "encrypted")

    is_link = True  # Process.flush_pending sends links' frames even while client output is held

    def __init__(self, sock: socket.socket, pending: list, name: str, max_backlog: int) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        # a TLS link (between nodes) is written by its writer greenlet only: the kernel fd would bypass the encryption
        self.encrypted = isinstance(sock, (ssl.SSLSocket, gevent_ssl.SSLSocket))
        self.out: list[Any] = []
        self.run_kind = 0
        self.run_key = b""
        self.run: list[bytes] = []
        self.flush_pending = False
        self.pending = pending
        self.writing = False
        self.wake = Event()
        self.closed = False
        self.name = name
        self.backlog = 0  # payload bytes in `out`, not yet taken by a write
        self.max_backlog = max_backlog

    def owe(self) -> None:
        if not self.flush_pending:
            self.flush_pending = True
            self.pending.append(self)

    def add(self, kind: int, key: bytes, line: bytes) -> None:
        """One line into the run of `kind` for `key` (a new run closes the open one: order is kept)."""
        if kind != self.run_kind or key != self.run_key:
            self.close_run()
            self.run_kind, self.run_key = kind, key
            self.owe()
        self.run.append(line)

    def close_run(self) -> None:
        run = self.run
        if run:
            run.append(b"")
            payload = NEWLINE.join(run)
            self.out.append(b"%c%b %d\n" % (self.run_kind, self.run_key, len(payload)))
            self.out.append(payload)
            self.backlog += len(payload)
            run.clear()
        self.run_kind = 0

    def frame(self, kind: int, key: bytes, payload: bytes = b"") -> None:
        self.close_run()
        self.out.append(b"%c%b %d\n" % (kind, key or b"-", len(payload)))
        if payload:
            self.out.append(payload)
            self.backlog += len(payload)
        self.owe()

    def flush(self) -> None:
        """Write what is owed now, as far as the socket takes it; the writer greenlet sends the rest."""
        self.close_run()
        out = self.out
        if not out or self.closed:
            return
        if self.writing:  # the peer is not keeping up: its unread bytes pile up here
            if self.backlog > self.max_backlog:
                log.error("%s: %d bytes the peer has not read, past --max-link-backlog: closing the link",
                          self.name, self.backlog)
                self.lost("its peer stopped reading")
                return
            self.wake.set()
            return
        if self.encrypted:
            self.wake.set()
            return
        data = b"".join(out)
        out.clear()
        self.backlog = 0
        try:
            sent = os.write(self.fd, data)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            self.lost(f"write failed: {e}")
            return
        if sent < len(data):
            out.append(memoryview(data)[sent:])
            self.wake.set()

    def write_loop(self) -> None:
        try:
            while not self.closed:
                self.wake.wait()
                self.wake.clear()
                while self.out and not self.closed:
                    data = b"".join(self.out)
                    self.out.clear()
                    self.backlog = 0
                    self.writing = True
                    self.sock.sendall(data)
                    self.writing = False
        except LINK_ENDED as e:
            self.lost(f"write failed: {e}")

    def lost(self, reason: str) -> None:
        raise NotImplementedError

    def shut(self) -> bool:
        """Close the socket under both greenlets (they see EOF and EPIPE); False if it was closed already."""
        if self.closed:
            return False
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.wake.set()
        return True

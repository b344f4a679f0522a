"""The links between worker processes, and what runs on them.

A link is one socket per ordered pair of workers, opened by the worker that asks (Unix sockets in the run dir; a
cluster's groups dial each other over TCP). On its PeerLink the asker sends requests; the owner's IncomingLink runs
them and answers on the same socket, and also sends its binding changes there, so an answer never overtakes the
bindings it caused. Each side handles a frame by its kind (frames.py names them), one method per kind.

A client's lines that run here from another worker run in a RemoteSession. Its output is windowed: the owner sends
at most RELAY_WINDOW_BYTES of `>` frames that the client's worker has not credited back with W, and the client's
worker credits only while its client reads (its outbox below half its high-water mark). A client that stops reading
stops its relayed consumers within one window, and no message leaves a queue for a client that cannot take it.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import gevent

from ..dispatch.actions import ONE_PROCESS, actions_for, run_lines
from ..wire.outbox import Outbox
from ..wire.protocol import format_ok, msg_id_of
from .frames import LINK_ENDED, NEWLINE, Frame, FrameReader, FrameSocket

if TYPE_CHECKING:
    from ..dispatch.actions import Publisher
    from ..dispatch.process import Process
    from .peers import Peers
    from .relay import RelaySession

log = logging.getLogger("mqks.peers")

RECV_BYTES = 1 << 18
NO_LIMIT = 1 << 62  # an outbox that never pauses (a link's confirms)
# `>` bytes in flight to one client's worker before its credit (less with a small --max-output-bytes).
# The client's worker holds a few copies of it at once (frame reader, outbox, the write's join):
# measured, 200 x 512 KiB relayed took +197 MiB with 16 MiB, +149 with 8, +129 with 4; a relayed
# manual-ack consumer ran about 20% slower with 4 than with 8 or 16 (credits wait on the client)
RELAY_WINDOW_BYTES = 8 << 20

FrameHandler = Callable[[bytes, bytes], None]  # (key, payload) of one frame of its kind
# a cluster's link to a host cut off by a partition drops no socket: TCP keeps retransmitting for 15 minutes and
# keepalive first looks after 2 hours, while forwarded confirmed publishes wait on it (issue 56: unanswered for
# over 15 s, until clients gave up). The kernel answers these probes, not the peer's process: a busy peer is alive
DEAD_PEER_SECONDS = 5  # unacknowledged data this long, or an idle link's probes unanswered about this long


def notice_dead_peer(sock: socket.socket) -> None:
    """Make a TCP link socket fail within about DEAD_PEER_SECONDS once its peer's host stops answering."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return  # a Unix socket's peer is on this host
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", DEAD_PEER_SECONDS - 2),
                          ("TCP_USER_TIMEOUT", DEAD_PEER_SECONDS * 1000)):
        if hasattr(socket, option):  # Linux's; elsewhere the system's keepalive defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class PeerLink(FrameSocket):
    """This worker's link to peer `worker`: requests out, answers and the peer's bindings in."""

    __slots__ = ("worker", "peers", "reader", "ready", "owner_epoch", "answered_at")

    def __init__(self, sock: socket.socket, peers: Peers, worker: int) -> None:
        super().__init__(sock, peers.process.pending, f"link to worker {worker}", peers.max_backlog)
        self.worker = worker
        self.peers = peers
        self.reader = FrameReader()
        self.ready = False  # the peer's bindings are in: lines and publishes may go (Peers.linked)
        self.owner_epoch: Any = None  # a cluster's group: the epoch of the owner dialled (Peers.unknown_bindings)
        # when this side sent the latest mark the owner has answered (monotonic): what its trust counts from
        self.answered_at = 0.0

    def lost(self, reason: str) -> None:
        if self.shut():
            self.peers.link_lost(self, reason)

    def frame_handlers(self) -> dict[int, FrameHandler]:
        """What this side does with each kind of frame the owner sends (frames.Frame, the right column)."""
        return {Frame.OUTPUT: self.on_output, Frame.MARKED: self.on_marked, Frame.CONFIRMS: self.on_confirms,
                Frame.BINDINGS: self.on_bindings, Frame.FORGET_BINDINGS: self.on_forget_bindings}

    def read_loop(self) -> None:
        on_frame = self.frame_handlers()
        flush_pending = self.peers.process.flush_pending
        recv = self.sock.recv
        feed = self.reader.feed
        try:
            while not self.closed:
                chunk = recv(RECV_BYTES)
                if not chunk:
                    break
                for kind, key, payload in feed(chunk):
                    handle = on_frame.get(kind)
                    if handle is not None:
                        handle(key, payload)
                flush_pending()
        except LINK_ENDED as e:
            self.lost(f"read failed: {e}")
            return
        self.lost("closed by the peer")

    def on_output(self, key: bytes, payload: bytes) -> None:
        target = self.peers.targets.get(key)
        if target is not None:
            target.take(payload, self.worker)

    def on_marked(self, key: bytes, payload: bytes) -> None:
        target = self.peers.targets.get(key)
        if target is not None:
            target.done()

    def on_confirms(self, key: bytes, payload: bytes) -> None:
        fanins = self.peers.fanins
        for line in payload.split(NEWLINE)[:-1]:
            fanin_id = line[: line.index(b" ")]
            fanin = fanins.get(fanin_id)
            if fanin is not None:
                fanin.write(line)
                if fanin.parts == 0:
                    del fanins[fanin_id]

    def on_bindings(self, key: bytes, payload: bytes) -> None:
        self.peers.replica.update(self.worker, payload)
        if key != b"-":
            self.frame(Frame.BINDINGS_APPLIED, key)  # the owner may let its clients see the change
        elif not self.ready:  # the whole dump, which follows Z: the link may carry lines now
            self.peers.linked(self)

    def on_forget_bindings(self, key: bytes, payload: bytes) -> None:
        self.peers.forget_bindings(self.worker)


class MarkAfterConfirms:
    """Stands in for an outbox among the journal's confirms: once the confirms before it are answered (ok or
    error), it answers a session's mark."""

    __slots__ = ("link", "key", "session")

    def __init__(self, link: IncomingLink, key: bytes, session: RemoteSession) -> None:
        self.link = link
        self.key = key
        self.session = session

    def write(self, data: bytes) -> None:
        self.link.answer_mark(self.key, self.session)


class RemoteSession:
    """A client of another worker, as its lines run here: its consumers, and the frames its output goes back in."""

    __slots__ = ("link", "key", "peer", "process", "publisher", "outbox", "consumers_by_id", "actions", "handlers",
                 "closed", "unauthenticated_lines", "in_flight")

    peer_is_loopback = True  # the client's own worker has checked what it may run
    eval_enabled = True
    eval_refusal: str | None = None
    authenticated = True
    said_hello = False
    tls = False
    ttl_seconds: float | None = None
    relay: RelaySession | None = None  # its lines run here and go no further

    def __init__(self, link: IncomingLink, key: bytes) -> None:
        process = link.peers.process
        self.link = link
        self.key = key
        self.peer = f"{link.name} client {key.decode(errors='replace')}"
        self.process = process
        self.publisher: Publisher = process.broker  # only this worker's queues: the sender forwarded elsewhere
        # its high-water mark is the window: the bytes sent and not yet credited count as owed
        self.outbox = Outbox(process.pending, link.peers.relay_window, self.flush)
        self.in_flight = 0  # `>` bytes sent that the client's worker has not credited
        self.consumers_by_id = self.outbox.consumers_by_id
        self.actions = actions_for(True, True)
        self.handlers = ONE_PROCESS.for_forwarded(process.memory_full)
        self.closed = False
        self.unauthenticated_lines = 0

    def write(self, data: bytes) -> None:
        self.outbox.write(data)

    def ok(self, rid: bytes, data: bytes = b"") -> None:
        self.outbox.write(format_ok(rid, data))

    def error(self, rid: bytes, reason: str, line: bytes) -> None:
        self.outbox.write(self.process.error_line(rid, reason))

    def close(self, flush_first: bool = False) -> None:
        """A remote session is closed by its client's worker (frame X), never from here."""

    def authenticate(self, token: bytes) -> bool | None:
        return None

    def set_ttl(self, seconds: float | None) -> None:
        """The client's worker watches its silence."""

    def flush(self) -> None:
        """Move the client's bytes into the link, as one `>` frame; they stay owed until credited."""
        outbox = self.outbox
        out = outbox.pieces()
        if out:
            payload = b"".join(out)
            self.link.frame(Frame.OUTPUT, self.key, payload)
            out.clear()
            self.in_flight += len(payload)
        outbox.out_bytes = self.in_flight

    def credit(self, taken: int) -> None:
        """The client's worker passed `taken` bytes on to its client: deliver again below half the window."""
        before = self.in_flight
        self.in_flight = max(0, before - taken)
        outbox = self.outbox
        outbox.out_bytes = max(0, outbox.out_bytes - (before - self.in_flight))
        if outbox.paused and outbox.out_bytes < outbox.high_water_bytes // 2 and not self.process.draining:
            outbox.paused = False
            self.process.resume(outbox)


class IncomingLink(FrameSocket):
    """A peer's link to this worker: its requests in; answers, and this worker's binding changes, out."""

    __slots__ = ("peers", "process", "worker", "sessions", "confirms", "reader", "acked", "no_rejects", "marked_at")

    def __init__(self, sock: socket.socket, peers: Peers, worker: int) -> None:
        super().__init__(sock, peers.process.pending, f"worker {worker}", peers.max_backlog)
        self.peers = peers
        self.process = peers.process
        # it gets every binding at once (the dump), then a change of none it acks once the dump is applied
        self.acked = peers.epoch - 1
        self.worker = worker
        self.sessions: dict[bytes, RemoteSession] = {}
        self.confirms = Outbox(peers.process.pending, NO_LIMIT, self.flush_confirms)
        self.reader = FrameReader()
        self.no_rejects: deque[tuple[bytes, str]] = deque()  # run_lines' rejects: a forwarded line has none
        self.marked_at = time.monotonic()  # when this side last answered a mark (the bindings dump: the hello)

    def flush_confirms(self) -> None:
        out = self.confirms.pieces()
        if out:
            self.frame(Frame.CONFIRMS, b"-", b"".join(out))
            out.clear()
        self.confirms.out_bytes = 0

    def lost(self, reason: str) -> None:
        self.shut()

    def serve(self, first_bytes: bytes = b"") -> None:
        """Run the peer's requests until it goes; then its clients' consumers here are detached.

        `first_bytes` came in the read with the link's first line: they may hold whole frames
        (a peer that links again sends dead letters that waited for it at once)."""
        peers = self.peers
        process = peers.process
        writer = gevent.spawn(self.write_loop)
        try:
            self.read_loop(process, first_bytes)
        except LINK_ENDED as e:
            log.info("link from worker %d failed: %s", self.worker, e)
        finally:
            self.lost("closed")
            peers.incoming_lost(self)
            for session in list(self.sessions.values()):
                self.end_session(session)
            self.sessions.clear()
            process.flush_pending()
            writer.kill(block=True, timeout=1)
            self.sock.close()
            log.info("link from worker %d closed", self.worker)

    def end_session(self, session: RemoteSession) -> None:
        session.closed = True
        self.peers.process.detach(session.outbox, lambda consumer, error: log.error(
            "clean-up of consumer %r of %s failed", getattr(consumer, "consumer_id", None), session.peer,
            exc_info=error))

    def frame_handlers(self) -> dict[int, FrameHandler]:
        """What the owner does with each kind of frame the asker sends (frames.Frame, the left column)."""
        return {Frame.PUBLISH: self.on_publish, Frame.SESSION_LINES: self.on_session_lines, Frame.MARK: self.on_mark,
                Frame.BINDINGS_APPLIED: self.on_bindings_applied, Frame.PUBLISH_CONFIRMED: self.on_confirmed,
                Frame.DEAD_LETTERS: self.on_dead_letters, Frame.SESSION_LEFT: self.on_session_left,
                Frame.CREDIT: self.on_credit}

    def read_loop(self, process: Process, first_bytes: bytes) -> None:
        on_frame = self.frame_handlers()
        recv = self.sock.recv
        feed = self.reader.feed
        flush_pending = process.flush_pending
        chunk = first_bytes
        while not self.closed:
            if not chunk:
                chunk = recv(RECV_BYTES)
                if not chunk:
                    return
            for kind, key, payload in feed(chunk):
                handle = on_frame.get(kind)
                if handle is not None:
                    handle(key, payload)
            flush_pending()
            chunk = b""

    def on_publish(self, key: bytes, payload: bytes) -> None:
        process = self.process
        lines = payload.split(NEWLINE)[:-1]
        if process.memory_full:  # past this worker's share of --max-memory: as a publish here
            process.dropped_by_memory += len(lines)
            return
        broker = process.broker
        publish = broker.publish
        broker.published -= len(lines)  # counted by the worker the client published to
        for line in lines:
            # `{event}{tail}`: the event is sent apart, since in the tail a request's
            # `,reply=` follows it with no space between
            space = line.index(b" ")
            tail = line[space:]
            publish(msg_id_of(tail), line[:space], tail)

    def on_session_lines(self, key: bytes, payload: bytes) -> None:
        session = self.sessions.get(key)
        if session is None:
            session = self.sessions[key] = RemoteSession(self, key)
            if self.process.draining:
                session.outbox.paused = True
        run_lines(session, cast("list[bytes | None]", payload.split(NEWLINE)[:-1]), self.no_rejects)

    def on_mark(self, key: bytes, payload: bytes) -> None:
        peers = self.peers
        if peers.holds_output():
            peers.deferred_marks.append((self, key))  # answered once every worker has the bindings
        else:
            self.mark(key)

    def on_bindings_applied(self, key: bytes, payload: bytes) -> None:
        self.acked = int(key)
        self.peers.check_barrier()

    def on_confirmed(self, key: bytes, payload: bytes) -> None:
        """`{fanin} {event}{tail}` lines: each published here, and answered under its fan-in's id on `c`."""
        process = self.process
        broker, journal = process.broker, process.journal
        confirms = self.confirms
        for line in payload.split(NEWLINE)[:-1]:
            fanin_id, _, rest = line.partition(b" ")
            event, _, tail = rest.partition(b" ")
            tail = b" " + tail
            if process.memory_full:
                confirms.write(process.error_line(fanin_id, process.memory_reason()))
                continue
            if journal is not None and journal.blocked:
                confirms.write(process.error_line(fanin_id, journal.refusal()))
                continue
            broker.published -= 1  # counted by the worker the client published to
            refusal = process.publish_confirmed_here(broker, confirms, fanin_id, msg_id_of(tail), event, tail)
            if refusal is not None:
                confirms.write(process.error_line(fanin_id, refusal))

    def on_dead_letters(self, key: bytes, payload: bytes) -> None:
        process = self.process
        broker = process.broker
        for line in payload.split(NEWLINE)[:-1]:
            retry, _, rest = line.partition(b" ")
            name = rest[: rest.index(b" ok ")]
            queue = broker.queue(name)
            queue.put_record(rest[len(name) :], int(retry))
            broker.pump(queue)
        # the sender writes its ack once they are in this worker's log
        if process.journal is None:
            self.confirms.write(format_ok(key))
        else:
            process.journal.confirm_later(self.confirms, key)

    def on_session_left(self, key: bytes, payload: bytes) -> None:
        session = self.sessions.pop(key, None)
        if session is not None:
            self.end_session(session)

    def on_credit(self, key: bytes, payload: bytes) -> None:
        session = self.sessions.get(key)
        if session is not None:
            session.credit(int(payload))

    def mark(self, key: bytes) -> None:
        """Answer an M: the session's output so far, then `.{key}`. A confirm the session is owed comes first:
        with a log, the mark waits behind it for the log (the client's worker closes a half-closed client once
        its marks are answered, and an answer after the mark was lost)."""
        session = self.sessions.get(key)
        journal = self.peers.process.journal
        if session is not None and journal is not None and journal.owes(session.outbox):
            journal.confirm_later(MarkAfterConfirms(self, key, session), b"")
            return
        self.answer_mark(key, session)

    def answer_mark(self, key: bytes, session: RemoteSession | None) -> None:
        if session is not None:
            session.flush()
            if key[:1] == b"g":  # a gather's session lives for one answer
                self.sessions.pop(key, None)
        self.marked_at = time.monotonic()
        self.frame(Frame.MARKED, key)

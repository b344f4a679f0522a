"""Worker processes (`mqksd --workers N`, N >= 2): the links between them and what crosses them.

Each worker owns the queues of its slots (server/dispatch/slots.py) and accepts clients like any
other. A line about a queue another worker owns is forwarded to that owner; every worker
keeps a replica of every other worker's bindings, so a publish goes only to the owners of
bound queues. Nothing crosses one message at a time: what a batch of lines owes a peer
is gathered in runs and written as frames once, when the batch is flushed.

A link is one Unix socket per ordered pair of workers, opened by the worker that asks.
On it the asker sends requests; the owner answers on the same socket, and also sends its
binding changes there, so an answer never overtakes the bindings it caused. The frames and
their kinds are in frames.py.

A session's output is windowed: the owner sends at most RELAY_WINDOW_BYTES of `>` frames that the
client's worker has not credited back with W, and the client's worker credits only while its
client reads (its outbox below half its high-water mark). A client that stops reading stops its
relayed consumers within one window, and no message leaves a queue for a client that cannot take it.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import gevent
import gevent.socket
from gevent.event import Event

from ...common.figures import merge_stats
from ..core import dead_letters
from ..core.routing import Routing, cache_put
from ..core.state import Broker, Queue
from ..dispatch.slots import owner_of
from ..wire.outbox import Outbox
from ..wire.protocol import format_ok, msg_id_of
from .frames import NEWLINE, Frame, FrameReader, FrameSocket

if TYPE_CHECKING:
    from ..dispatch.actions import Publisher
    from ..dispatch.process import Process
    from .relay import RelaySession

log = logging.getLogger("mqks.peers")

RECV_BYTES = 1 << 18
NO_LIMIT = 1 << 62  # an outbox that never pauses (a link's confirms)
# `>` bytes in flight to one client's worker before its credit (less with a small --max-output-bytes).
# The client's worker holds a few copies of it at once (frame reader, outbox, the write's join):
# measured, 200 x 512 KiB relayed took +197 MiB with 16 MiB, +149 with 8, +129 with 4; a relayed
# manual-ack consumer ran about 20% slower with 4 than with 8 or 16 (credits wait on the client)
RELAY_WINDOW_BYTES = 8 << 20
CONNECT_RETRY_SECONDS = 0.05
ASK_SECONDS = 2.0  # a /metrics scrape waits this long at most for the other workers' figures
# per message: a plain int, since an IntEnum member's lookup costs ~190 ns on Python 3.11
PUBLISH_KIND = Frame.PUBLISH.value


class RemoteQueue:
    """Another worker's queue as the replica knows it: a name, its owner, its events."""

    __slots__ = ("name", "owner", "events")

    def __init__(self, name: bytes, owner: int) -> None:
        self.name = name
        self.owner = owner
        self.events: tuple[bytes, ...] = ()


class FanIn:
    """One confirmed publish whose copies went to several workers: one answer once every part has answered.

    Stands in for the client's outbox in the journal's confirms (it has `write`).
    """

    __slots__ = ("outbox", "rid", "parts", "error", "owners")

    def __init__(self, outbox: Outbox, rid: bytes, parts: int, owners: Iterable[int]) -> None:
        self.outbox = outbox
        self.rid = rid
        self.parts = parts
        self.error: bytes | None = None
        self.owners = tuple(owners)

    def write(self, line: bytes) -> None:
        """A part's answer: `{anything} ok ...` or `{anything} error {error_id} {reason}`."""
        if self.error is None:
            rest = line.partition(b" ")[2]
            if rest.startswith(b"error "):
                self.error = rest.rstrip(NEWLINE)  # a local part's line ends in one, a peer's was split off
        self.parts -= 1
        if self.parts == 0:
            self.outbox.write(b"%b %b\n" % (self.rid, self.error) if self.error is not None else format_ok(self.rid))


class Waiter:
    """The target of `Peers.ask_all`: answers gathered until every worker has marked its end."""

    __slots__ = ("waiting", "answers", "event")

    def __init__(self, waiting: int) -> None:
        self.waiting = waiting
        self.answers: list[bytes] = []
        self.event = Event()
        if not waiting:
            self.event.set()

    def take(self, payload: bytes, worker: int) -> None:
        self.answers.append(payload)

    def done(self) -> None:
        self.waiting -= 1
        if self.waiting <= 0:
            self.event.set()


class HoldRelease:
    """The mark that ends one hold on client output (see Peers.hold_until_marked)."""

    __slots__ = ("peers", "key", "link")

    def __init__(self, peers: Peers, key: bytes, link: PeerLink) -> None:
        self.peers = peers
        self.key = key
        self.link = link

    def take(self, payload: bytes, worker: int) -> None:
        """A mark's session has no output."""

    def done(self) -> None:
        peers = self.peers
        peers.targets.pop(self.key, None)
        peers.holds -= 1
        if not peers.holds:
            peers.check_barrier()
            peers.process.flush_pending()


class PeerLink(FrameSocket):
    """This worker's link to peer `worker`: requests out, answers and the peer's bindings in."""

    __slots__ = ("worker", "peers", "reader", "ready")

    def __init__(self, sock: socket.socket, peers: Peers, worker: int) -> None:
        super().__init__(sock, peers.process.pending, f"link to worker {worker}", peers.max_backlog)
        self.worker = worker
        self.peers = peers
        self.reader = FrameReader()
        self.ready = False  # the peer's bindings are in: lines and publishes may go (Peers.linked)

    def lost(self, reason: str) -> None:
        if self.shut():
            self.peers.link_lost(self, reason)

    def read_loop(self) -> None:
        peers = self.peers
        targets = peers.targets
        fanins = peers.fanins
        replica = peers.replica
        flush_pending = peers.process.flush_pending
        recv = self.sock.recv
        feed = self.reader.feed
        try:
            while not self.closed:
                chunk = recv(RECV_BYTES)
                if not chunk:
                    break
                for kind, key, payload in feed(chunk):
                    if kind == Frame.OUTPUT:
                        target = targets.get(key)
                        if target is not None:
                            target.take(payload, self.worker)
                    elif kind == Frame.MARKED:
                        target = targets.get(key)
                        if target is not None:
                            target.done()
                    elif kind == Frame.CONFIRMS:
                        for line in payload.split(NEWLINE)[:-1]:
                            fanin = fanins.get(line[: line.index(b" ")])
                            if fanin is not None:
                                fanin.write(line)
                                if fanin.parts == 0:
                                    del fanins[line[: line.index(b" ")]]
                    elif kind == Frame.BINDINGS:
                        replica.update(self.worker, payload)
                        if key != b"-":
                            self.frame(Frame.BINDINGS_APPLIED, key)  # the owner may let its clients see the change
                        elif not self.ready:  # the whole dump, which follows Z: the link may carry lines now
                            peers.linked(self)
                    elif kind == Frame.FORGET_BINDINGS:
                        replica.forget(self.worker)
                flush_pending()
        except OSError as e:
            self.lost(f"read failed: {e}")
            return
        self.lost("closed by the peer")


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
        from ..dispatch.actions import ONE_PROCESS, actions_for

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
        out = outbox.out
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

    __slots__ = ("peers", "worker", "sessions", "confirms", "reader", "acked")

    def __init__(self, sock: socket.socket, peers: Peers, worker: int) -> None:
        super().__init__(sock, peers.process.pending, f"worker {worker}", peers.max_backlog)
        self.peers = peers
        self.acked = peers.epoch  # it gets every binding at once (the dump), then acks each change
        self.worker = worker
        self.sessions: dict[bytes, RemoteSession] = {}
        self.confirms = Outbox(peers.process.pending, NO_LIMIT, self.flush_confirms)
        self.reader = FrameReader()

    def flush_confirms(self) -> None:
        out = self.confirms.out
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
        except OSError as e:
            log.info("link from worker %d failed: %s", self.worker, e)
        finally:
            self.lost("closed")
            peers.incoming.discard(self)
            peers.check_barrier()  # a worker that left acks nothing: the others decide
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

    def read_loop(self, process: Process, first_bytes: bytes) -> None:
        from ..dispatch.actions import run_lines

        broker = process.broker
        publish = broker.publish
        sessions = self.sessions
        peers = self.peers
        recv = self.sock.recv
        feed = self.reader.feed
        no_rejects: deque[tuple[bytes, str]] = deque()
        flush_pending = process.flush_pending
        chunk = first_bytes
        while not self.closed:
            if not chunk:
                chunk = recv(RECV_BYTES)
                if not chunk:
                    return
            for kind, key, payload in feed(chunk):
                if kind == Frame.PUBLISH:
                    lines = payload.split(NEWLINE)[:-1]
                    if process.memory_full:  # past this worker's share of --max-memory: as a publish here
                        process.dropped_by_memory += len(lines)
                        continue
                    broker.published -= len(lines)  # counted by the worker the client published to
                    for line in lines:
                        # `{event}{tail}`: the event is sent apart, since in the tail a request's
                        # `,reply=` follows it with no space between
                        space = line.index(b" ")
                        tail = line[space:]
                        publish(msg_id_of(tail), line[:space], tail)
                elif kind == Frame.SESSION_LINES:
                    session = sessions.get(key)
                    if session is None:
                        session = sessions[key] = RemoteSession(self, key)
                        if process.draining:
                            session.outbox.paused = True
                    run_lines(session, payload.split(NEWLINE)[:-1], no_rejects)
                elif kind == Frame.MARK:
                    if peers.acked_epoch != peers.epoch or peers.holds:
                        peers.deferred_marks.append((self, key))  # answered once every worker has the bindings
                    else:
                        self.mark(key)
                elif kind == Frame.BINDINGS_APPLIED:
                    self.acked = int(key)
                    peers.check_barrier()
                elif kind == Frame.PUBLISH_CONFIRMED:
                    self.publish_confirmed(broker, payload)
                elif kind == Frame.DEAD_LETTERS:
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
                elif kind == Frame.SESSION_LEFT:
                    session = sessions.pop(key, None)
                    if session is not None:
                        self.end_session(session)
                elif kind == Frame.CREDIT:
                    session = sessions.get(key)
                    if session is not None:
                        session.credit(int(payload))
            flush_pending()
            chunk = b""

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
        self.frame(Frame.MARKED, key)

    def publish_confirmed(self, broker: Broker, payload: bytes) -> None:
        process = self.peers.process
        journal = process.journal
        confirms = self.confirms
        for line in payload.split(NEWLINE)[:-1]:
            fanin_id, _, rest = line.partition(b" ")
            event, _, tail = rest.partition(b" ")
            tail = b" " + tail
            msg_id = msg_id_of(tail)
            if process.memory_full:
                confirms.write(process.error_line(fanin_id, process.memory_reason()))
                continue
            if journal is not None and journal.blocked:
                confirms.write(process.error_line(fanin_id, journal.refusal()))
                continue
            full = broker.full_queues(event)
            broker.publish(msg_id, event, tail)
            broker.published -= 1  # counted by the worker the client published to
            if full:
                names = ", ".join(f"queue {queue.name.decode(errors='replace')} is full "
                                  f"(--max-length={queue.max_length})" for queue in full)
                confirms.write(process.error_line(fanin_id, f"{names}: the message was not put there "
                                                            "(every other bound queue has it)"))
            elif journal is None:
                confirms.write(b"%b ok \n" % fanin_id)
            else:
                journal.confirm_later(confirms, fanin_id)


class Replica:
    """Every other worker's bindings: event or mask -> their queues, and the links a publish must reach."""

    __slots__ = ("routing", "queues", "cache", "peers")

    def __init__(self, peers: Peers) -> None:
        self.routing = Routing()
        self.queues: dict[bytes, RemoteQueue] = {}
        # event -> owners; cleared on any change, and bounded as the route cache (ids in event names)
        self.cache: dict[bytes, tuple[int, ...]] = {}
        self.peers = peers

    def owners(self, event: bytes) -> tuple[int, ...]:
        owners = self.cache.get(event)
        if owners is None:
            owners = tuple(sorted({queue.owner for queue in self.routing.route(event)}))
            cache_put(self.cache, event, owners)
        return owners

    def update(self, owner: int, payload: bytes) -> None:
        """`{queue} {event}...` lines from `owner`: each queue's whole set of events now (none: unbound)."""
        routing = self.routing
        for line in payload.split(NEWLINE)[:-1]:
            name, *events = line.split(b" ")
            queue = self.queues.get(name)
            if queue is None:
                if not events:
                    continue
                queue = self.queues[name] = RemoteQueue(name, owner)
            for event in queue.events:
                routing.unbind(queue, event)
            queue.events = tuple(events)
            for event in events:
                routing.bind(queue, event)
            if not events:
                del self.queues[name]
        self.cache.clear()

    def forget(self, owner: int) -> None:
        for name, queue in list(self.queues.items()):
            if queue.owner == owner:
                for event in queue.events:
                    self.routing.unbind(queue, event)
                del self.queues[name]
        self.cache.clear()

    def count(self) -> int:
        return len(self.queues)


class Forwarder:
    """A client's publish in a worker of several: copies into this worker's queues, then one line to each
    other worker that owns a bound queue.

    It stands in place of the local broker as `Process.publisher` rather than beside it: a loop
    that called both a Broker's and a Forwarder's `publish` at one call site was polymorphic, which
    the interpreter's specialization punishes (bench.hot_path with a linked worker: +160 ns a message
    over one alone, +115 ns since).
    """

    __slots__ = ("peers", "replica", "cache", "links", "local", "local_publish", "fanins", "next_fanin")

    def __init__(self, peers: Peers) -> None:
        self.peers = peers
        self.replica = peers.replica
        self.cache = peers.replica.cache  # cleared, never replaced: one attribute load per publish
        self.links = peers.links
        self.local: Broker = peers.process.broker
        self.local_publish = self.local.publish
        self.fanins = peers.fanins
        self.next_fanin = itertools.count(1)

    def publish(self, msg_id: bytes, event: bytes, tail: bytes) -> None:
        self.local_publish(msg_id, event, tail)
        owners = self.cache.get(event)
        if owners is None:
            owners = self.replica.owners(event)
        if not owners:
            return  # most events of a worker's clients bind its own queues only
        if not self.local.routes(event):  # counted unrouted here, and routed to other workers
            self.local.unrouted -= 1
        for owner in owners:
            link = self.links[owner]
            if link is not None:
                if link.run_kind == PUBLISH_KIND:
                    link.run.append(event + tail)
                else:
                    link.add(PUBLISH_KIND, b"-", event + tail)
            else:
                self.peers.dropped_unlinked += 1

    def routes(self, event: bytes) -> bool:
        """True if a queue of any worker is bound to `event` (as `Broker.routes`, over every worker)."""
        return bool(self.local.routes(event) or self.replica.owners(event))

    def routes_elsewhere(self, event: bytes) -> bool:
        """True if a queue of another worker is bound to `event`."""
        return bool(self.replica.owners(event))

    def full_queues(self, event: bytes) -> list[Queue]:
        return self.local.full_queues(event)  # other owners answer for theirs (publish_confirmed)

    def permits(self, event: bytes) -> bool:
        return True  # a scoped session's publisher (dispatch/scopes.py) is the one that refuses

    def publish_confirmed(self, session: Any, rid: bytes, event: bytes, tail: bytes) -> None:
        """A confirmed publish some of whose queues are elsewhere: one answer once every owner has it."""
        owners = self.replica.owners(event)
        local = self.local
        local_part = bool(local.routes(event))
        only = self.links[owners[0]] if len(owners) == 1 and not local_part else None
        if only is not None:
            # one owner has every bound queue: it runs the line in this client's session and answers
            # there, after the deliveries the publish caused, exactly as one worker would
            session.relay.send(owners[0], b"%b publish --confirm %b" % (rid, tail[len(rid) + 11 :]),
                               answer_first=False)
            return
        process = self.peers.process
        msg_id = msg_id_of(tail)
        full = local.full_queues(event)
        fanin = FanIn(session.outbox, rid, len(owners) + 1, owners)
        fanin_id = b"%d" % next(self.next_fanin)
        self.fanins[fanin_id] = fanin
        for owner in owners:
            link = self.links[owner]
            if link is None:
                fanin.write(process.error_line(rid, f"{self.peers.unreachable(owner, 'a bound queue')}: the "
                                                    "message was not put there"))
            else:
                link.add(Frame.PUBLISH_CONFIRMED, b"-", b"%b %b%b" % (fanin_id, event, tail))
        local.publish(msg_id, event, tail)
        if not local_part:  # counted unrouted here, and routed to other workers
            local.unrouted -= 1
        if full:
            names = ", ".join(f"queue {queue.name.decode(errors='replace')} is full (--max-length="
                              f"{queue.max_length})" for queue in full)
            fanin.write(process.error_line(rid, f"{names}: the message was not put there (every other bound "
                                                "queue has it)"))
        elif local_part and process.journal is not None:
            process.journal.confirm_later(fanin, rid)  # the fan-in answers as an outbox would
        else:
            fanin.write(format_ok(rid))


class RemoteDeadLetters:
    """`Broker.broker_for` for a dead-letter queue another worker owns: the copies go there, as one transfer."""

    __slots__ = ("peers", "owner", "name", "records")

    def __init__(self, peers: Peers, owner: int, name: bytes) -> None:
        self.peers = peers
        self.owner = owner
        self.name = name
        self.records: list[bytes] = []

    def queue(self, name: bytes) -> RemoteDeadLetters:
        return self

    def put_record(self, tail: bytes, retry: int) -> None:
        self.records.append(b"%d %b%b" % (retry, self.name, tail))

    def pump(self, queue: Any) -> None:
        """The owner pumps when the copies arrive."""

    def send(self, source: Broker, queue: Queue, taken: list[tuple[int, Any]]) -> None:
        peers = self.peers
        peers.send_dead_letters(DeadLetterTransfer(peers, peers.new_key(b"d"), self.owner, self.records, source,
                                                   queue, taken))


class DeadLetterTransfer:
    """Dead letters on their way to the worker that owns their `.dead` queue.

    The source writes their ack to its own log only once the owner has them in its log (the
    owner's `ok`). A crash of either worker in between can repeat a dead letter, never lose
    one: the source's log still holds the message, which comes back and is moved again.
    While the owner is restarting, the transfer waits and goes when its link is back.
    Answers as a fan-in does (`owners`, `parts`, `write`), so the link routes the `ok` to it.
    """

    __slots__ = ("peers", "rid", "owner", "owners", "parts", "records", "source", "queue", "taken")

    def __init__(self, peers: Peers, key: bytes, owner: int, records: list[bytes], source: Broker, queue: Queue,
                 taken: list[tuple[int, Any]]) -> None:
        self.peers = peers
        self.rid = key
        self.owner = owner
        self.owners = (owner,)
        self.parts = 1
        self.records = records
        self.source = source
        self.queue = queue
        self.taken = taken

    def write(self, line: bytes) -> None:
        """The owner's answer: `ok` once its log has them (it has no other)."""
        self.parts = 0
        dead_letters.moved(self.source, self.queue, self.taken)

    def link_lost(self) -> None:
        """The owner went before it answered: again once it is back."""
        self.peers.dead_waiting.setdefault(self.owner, []).append(self)


class Peers:
    """This worker's view of the others: links, the bindings replica, sessions waiting on answers."""

    def __init__(self, process: Process, run_dir: str, max_backlog: int = 512 << 20,
                 relay_window: int = RELAY_WINDOW_BYTES) -> None:
        self.process = process
        self.max_backlog = max_backlog  # unread bytes on a link before it is closed (a frozen peer)
        self.relay_window = relay_window  # `>` bytes in flight to one client's worker before its credit
        # which worker this is, of how many: the process's, read once (it never changes while it runs)
        self.worker = process.worker
        self.count = count = process.worker_count
        self.run_dir = run_dir
        self.links: list[PeerLink | None] = [None] * count
        # other workers with no link from here: their binding changes may be unknown here, so a confirmed
        # publish cannot promise it reached every bound queue (actions.publish_confirmed refuses it)
        self.unlinked = count - 1
        # how a link is opened: a Unix socket in run_dir here; a cluster's node dials the group's owner over TCP
        self.dial: Callable[[int], socket.socket] = self.dial_unix
        self.unit = "worker"  # what errors call a peer: "group" in a cluster, where a group's owner is on any node
        self.link_hello = b"- _link %d\n" % self.worker
        # each peer's latest link (ready or still waiting for its bindings) and the address it was opened to: a
        # cluster's owner may move
        self.dialled: dict[int, tuple[Any, PeerLink]] = {}
        self.address_of: Callable[[int], Any] = self.socket_path
        self.connect_retry_seconds = CONNECT_RETRY_SECONDS
        self.incoming: set[IncomingLink] = set()
        self.targets: dict[bytes, Any] = {}  # session key -> the client connection or gather it answers
        self.fanins: dict[bytes, FanIn] = {}
        self.replica = Replica(self)
        self.forwarder = Forwarder(self)
        self.next_key = itertools.count(1)
        self.dropped_unlinked = 0
        self.on_link_lost: Callable[[int], None] = lambda worker: None
        # binding changes made here (epoch) and the latest every other worker has applied: while they
        # differ, client output is held (Process.flush_pending) and M marks wait in deferred_marks
        self.epoch = 0
        self.acked_epoch = 0
        self.deferred_marks: list[tuple[IncomingLink, bytes]] = []
        self.holds = 0  # marks awaited before client output may go (dead letters sent to another worker)
        self.dead_waiting: dict[int, list[DeadLetterTransfer]] = {}  # for a worker that is restarting
        local = process.broker
        local.bindings_changed = self.broadcast_bindings
        local.broker_for = self.broker_for

    def unreachable(self, owner: int, what: str = "") -> str:
        """Why lines for `owner`'s queues cannot run now, in the words of this kind of broker: a worker restarts,
        a cluster's group fails over."""
        owns = f", which owns {what}," if what else ""
        if self.unit == "group":
            return f"group {owner}{owns} has no owner reachable from here (failing over)"
        return f"worker {owner}{owns} is restarting"

    def unlinked_reason(self) -> str:
        missing = ", ".join(str(worker) for worker, link in enumerate(self.links)
                            if link is None and worker != self.worker)
        why = "its owner failing over" if self.unit == "group" else "restarting"
        return (f"{self.unit} {missing} is not linked here ({why}): the queues it binds are unknown, so the message "
                "was not published; try again")

    def socket_path(self, worker: int) -> str:
        return os.path.join(self.run_dir, f"link-{worker}.sock")

    def owner(self, queue: bytes) -> int:
        return owner_of(queue, self.count)

    def broker_for(self, name: bytes) -> Any:
        owner = owner_of(name, self.count)
        if owner == self.worker:
            return self.process.broker
        return RemoteDeadLetters(self, owner, name)

    def send_dead_letters(self, transfer: DeadLetterTransfer) -> None:
        """To their owner now, held client output until it has them; or, while it restarts, once it is back."""
        link = self.links[transfer.owner]
        if link is None:
            log.warning("%d dead letters for %r wait: worker %d is restarting", len(transfer.records),
                        transfer.records[0].split(b" ", 2)[1], transfer.owner)
            self.dead_waiting.setdefault(transfer.owner, []).append(transfer)
            return
        self.fanins[transfer.rid] = transfer  # type: ignore[assignment]  # answered as a fan-in
        for record in transfer.records:
            link.add(Frame.DEAD_LETTERS, transfer.rid, record)
        self.hold_until_marked(link)  # no client hears of it (the reject's `ok`) before the owner has it

    def new_key(self, prefix: bytes = b"") -> bytes:
        return b"%b%d" % (prefix, next(self.next_key))

    # -- bindings ---------------------------------------------------------------------------------

    def broadcast_bindings(self, queue: Queue) -> None:
        """The local queue's events changed (or it was deleted): every peer's replica learns it now.

        Until each has said it applied the change, no client sees anything from this worker.
        """
        line = b" ".join([queue.name, *queue.events]) if queue.events else queue.name
        if not self.incoming:
            return
        self.epoch += 1
        key = b"%d" % self.epoch
        for link in self.incoming:
            link.frame(Frame.BINDINGS, key, line + NEWLINE)

    def hold_until_marked(self, link: PeerLink) -> None:
        """Hold client output until `link`'s worker has run what was just sent to it."""
        key = self.new_key(b"h")
        self.targets[key] = HoldRelease(self, key, link)
        link.frame(Frame.MARK, key)
        self.holds += 1

    def set_over_memory(self, over: bool) -> None:
        """Past this worker's share of --max-memory: other workers' clients' publishes here are refused too."""
        from ..dispatch.actions import ONE_PROCESS

        for link in self.incoming:
            for session in link.sessions.values():
                session.handlers = ONE_PROCESS.for_forwarded(over)

    def check_barrier(self) -> None:
        """Every worker has applied our binding changes (and run what holds output): let the held output go."""
        if self.holds or (self.acked_epoch == self.epoch and not self.deferred_marks):
            return
        if any(link.acked < self.epoch for link in self.incoming if not link.closed):
            return
        self.acked_epoch = self.epoch
        marks, self.deferred_marks = self.deferred_marks, []
        for link, key in marks:
            if not link.closed:
                link.mark(key)
        self.process.flush_pending()

    def binding_dump(self) -> bytes:
        return b"".join(b" ".join([name, *queue.events]) + NEWLINE
                        for name, queue in self.process.broker.queues.items() if queue.events)

    # -- links ------------------------------------------------------------------------------------

    def accept_link(self, sock: socket.socket, worker: int, first_bytes: bytes = b"") -> None:
        """A peer opened its link to us (the first line named it): serve its requests on this greenlet."""
        link = IncomingLink(sock, self, worker)
        self.incoming.add(link)
        link.frame(Frame.FORGET_BINDINGS, b"-")  # forget what the replica knew of us: we may have restarted
        # then every binding of ours, even none: until the peer has them it sends us nothing, and confirms no
        # publish that might be for our queues
        link.frame(Frame.BINDINGS, b"-", self.binding_dump())
        link.flush()
        link.serve(first_bytes)

    def connect_all(self, timeout: float, give_up: Callable[[], bool]) -> bool:
        """Open a link to every peer and wait for every peer's link here, until `timeout` or `give_up()`; True if all
        are up."""
        greenlets = [gevent.spawn(self.keep_linked, worker) for worker in range(self.count) if worker != self.worker]
        deadline = gevent.get_hub().loop.now() + timeout
        # both ways: a worker that has not linked here yet would miss this one's binding changes (the barrier
        # waits only for the links that exist), and confirm publishes to queues it does not know are bound
        while (any(self.links[w] is None for w in range(self.count) if w != self.worker)
               or len({link.worker for link in self.incoming if not link.closed}) < self.count - 1):
            if gevent.get_hub().loop.now() > deadline or give_up():
                return False
            gevent.sleep(CONNECT_RETRY_SECONDS)
        del greenlets
        return True

    def dial_unix(self, worker: int) -> socket.socket:
        sock = gevent.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.socket_path(worker))
        except OSError:
            sock.close()
            raise
        return sock

    def readdress(self, worker: int) -> None:
        """`worker`'s address changed (a cluster group's new owner): a link to the old one goes, and is made anew."""
        address, link = self.dialled.get(worker, (None, None))
        if link is not None and not link.closed and address != self.address_of(worker):
            link.lost("its owner moved")
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def keep_linked(self, worker: int) -> None:
        """Connect to `worker`, and again whenever the link is lost (the peer restarts)."""
        while True:
            address = self.address_of(worker)
            try:
                sock = self.dial(worker)
            except OSError:
                gevent.sleep(self.connect_retry_seconds)
                continue
            try:
                sock.sendall(self.link_hello)
            except OSError:
                sock.close()
                gevent.sleep(self.connect_retry_seconds)
                continue
            link = PeerLink(sock, self, worker)
            self.dialled[worker] = (address, link)
            writer = gevent.spawn(link.write_loop)
            link.read_loop()
            writer.kill(block=False)
            sock.close()
            gevent.sleep(self.connect_retry_seconds)

    def linked(self, link: PeerLink) -> None:
        """`link`'s peer has sent its bindings: lines for its queues, and publishes that may reach them, go now."""
        link.ready = True
        worker = link.worker
        self.links[worker] = link
        self.unlinked -= 1
        log.info("linked to worker %d", worker)
        waiting = self.dead_waiting.pop(worker, [])
        for transfer in waiting:
            self.send_dead_letters(transfer)

    def link_lost(self, link: PeerLink, reason: str) -> None:
        if self.links[link.worker] is link:
            self.links[link.worker] = None
            self.unlinked += 1
        log.warning("link to worker %d lost (%s): its clients here are closed; reconnecting", link.worker, reason)
        for fanin_id, fanin in list(self.fanins.items()):
            if link.worker in fanin.owners:
                del self.fanins[fanin_id]
                if isinstance(fanin, DeadLetterTransfer):
                    fanin.link_lost()
                    continue
                fanin.parts = 1
                fanin.write(self.process.error_line(fanin.rid, f"worker {link.worker} stopped before it had the "
                                                               "message"))
        for target in list(self.targets.values()):
            if isinstance(target, HoldRelease) and target.link is link:
                target.done()  # that worker is gone: what it was sent is lost with it, and so is the wait
        self.on_link_lost(link.worker)
        self.process.flush_pending()

    def ask_all(self, line: bytes, timeout: float = ASK_SECONDS) -> list[bytes]:
        """Run `line` on every other worker and wait (this greenlet only) for their answers; a worker that is
        restarting, or silent past `timeout`, is left out."""
        key = self.new_key(b"g")
        links = [link for worker, link in enumerate(self.links) if link is not None and worker != self.worker]
        waiter = Waiter(len(links))
        self.targets[key] = waiter
        try:
            for link in links:
                link.add(Frame.SESSION_LINES, key, line)
                link.frame(Frame.MARK, key)
            self.process.flush_pending()
            waiter.event.wait(timeout)
        finally:
            self.targets.pop(key, None)
        return waiter.answers

    def cluster_stats(self) -> dict[str, Any]:
        """`stats` summed over every worker, for a reader that is not a client (/metrics)."""
        return merge_stats(self.ask_all(b"m stats"), self.process.stats(), self.distinct_events())

    def cluster_deepest_queues(self, limit: int) -> list[tuple[str, int, int, int]]:
        rows = list(self.process.deepest_queues(limit))
        for answer in self.ask_all(b"m queues"):
            for line in answer.split(NEWLINE):
                body = line.partition(b" ok ")[2]
                if body and body != b"--end":
                    row = json.loads(body)
                    rows.append((row["queue"], row["depth"], row["unacked"], row.get("leased", 0)))
        return sorted(rows, key=lambda row: (-row[1], row[0]))[:limit]

    def distinct_events(self) -> int:
        """Events and masks bound by any worker's queues, each once (the replica knows the others')."""
        events: set[bytes] = set()
        for queue in self.process.broker.queues.values():
            events.update(queue.events)
        for remote in self.replica.queues.values():
            events.update(remote.events)
        return len(events)

    def stats(self) -> dict[str, Any]:
        return {"worker_links": sum(link is not None for link in self.links), "replica_queues": self.replica.count(),
                "dropped_unlinked": self.dropped_unlinked}

"""Which worker runs a line, and the forward when it is not this one.

Each action declares its `Placement` (dispatch/actions.py); `place` wraps its handler once, when a
worker of several builds its tables. A line about a queue (consume, rebind, delete_queue,
fetch), a relayed consumer (ack, reject, touch, delete_consumer), a schedule or a reply
token runs where that lives; `stats`, `queues`, `schedules` and `settle` are asked of every
worker and merged; `_eval` and `stats --worker=N` reach one. `publish` runs here: the
Forwarder among the session's brokers sends the copies (forwarding.py).

A client's session on the other workers is its `RelaySession`. A forwarded line that
answers, or changes bindings, holds the session's next lines (the handler returns a `Held`)
until the owner has run it, so a client sees its answers in the order it sent the lines,
and never publishes past a binding it just made.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from gevent.event import Event

from ...common.figures import merge_stats
from ..core.state import Consumer
from ..dispatch.actions import (
    Action,
    Handler,
    Placement,
    Session,
    check_name,
    parse_consume,
    parse_stats_args,
    parse_worker,
    run_lines,
    to_json,
)
from ..wire.protocol import Held, ProtocolError, format_ok, format_rows, ok_body, parse_flag_value, text
from .frames import Frame

if TYPE_CHECKING:
    from ..edges.connection import Connection
    from .peers import Peers

log = logging.getLogger("mqks.relay")

CREDIT_SHARE = 4  # a client's worker credits an owner once it owes it a quarter of the relay window


class RelaySession:
    """A client's session on the other workers: what it sent where, the answers it waits for, the lines they hold,
    and the output credit it owes back. Its key names it there; `>` and `.` frames under that key come here."""

    __slots__ = ("connection", "peers", "key", "remote", "unsynced", "awaiting", "held", "unheld", "owed_credit",
                 "synced", "quiet_fanins", "awaits_quiet")

    def __init__(self, connection: Connection, peers: Peers) -> None:
        self.connection = connection
        self.peers = peers
        self.key = b""  # this session's name on the other workers, once it has one
        self.remote: set[int] = set()  # workers that run lines for this session
        self.unsynced: set[int] = set()  # ... and have not answered since: a ping waits for them
        self.awaiting = 0  # answers owed by other workers before `held` may run
        self.held: list | None = None
        self.unheld = Event()
        self.owed_credit: dict[int, int] = {}  # by owner: `>` bytes taken from it and not yet credited back
        self.synced = False  # a held ping waited for the other workers: it answers when it runs again
        self.quiet_fanins = 0  # quiet publishes to several workers not yet answered by all (forwarding.QuietFanIn)
        self.awaits_quiet = False  # a held ping or sync waits for them too (one of `awaiting`)

    def peer_key(self) -> bytes:
        """This session's name on the other workers: their answers and its deliveries come back under it."""
        if not self.key:
            self.key = self.peers.new_key()
            self.peers.targets[self.key] = self
        return self.key

    def send(self, owner: int, line: bytes, answer_first: bool) -> Held | None:
        """Run `line` in this session's place on worker `owner`; `answer_first`: the next lines wait until it has."""
        link = self.peers.links[owner]
        if link is None:
            raise ProtocolError(f"{self.peers.unreachable(owner, 'this')}: try again")
        key = self.peer_key()
        link.add(Frame.SESSION_LINES, key, line)
        self.remote.add(owner)
        if answer_first:
            link.frame(Frame.MARK, key)
            self.awaiting += 1
            return Held.NEXT
        self.unsynced.add(owner)
        return None

    def hold(self, line: bytes, remaining: Any, held: Held) -> None:
        """Keep the batch's lines after `line` (and `line` too, for Held.AGAIN) until the answers are in."""
        self.held = [line, *remaining] if held is Held.AGAIN else list(remaining)

    def note_flushed_links(self) -> None:
        """After a batch: a later ping waits for every worker the batch sent something to."""
        for worker, link in enumerate(self.peers.links):
            if link is not None and link.flush_pending:
                self.unsynced.add(worker)

    def take(self, data: bytes, worker: int) -> None:
        """Bytes `worker` owes this client (answers, deliveries of relayed consumers), in one piece.

        They are credited back to `worker` once the client has read its backlog (`give_credit`):
        the owner sends no more than its window meanwhile, so a client that stops reading stops
        its relayed consumers and nothing piles up here.
        """
        connection = self.connection
        if connection.closed:
            return
        self.owed_credit[worker] = self.owed_credit.get(worker, 0) + len(data)
        outbox = connection.outbox
        outbox.take(data)
        if outbox.out_bytes > connection.max_output_bytes:
            connection.close_unread()

    def tell(self, kind: Frame) -> None:
        """Send a frame of `kind` under this session's key to every worker that runs lines for it."""
        links = self.peers.links
        for worker in self.remote:
            link = links[worker]
            if link is not None:
                link.frame(kind, self.key)

    def mark_other_workers(self) -> bool:
        """Ask every worker this session sent lines to, or whose consumers it has, for a sync mark;
        True if some are owed (`awaiting`): their answers and deliveries arrive before the marks."""
        peers = self.peers
        unsynced = self.unsynced
        # the owners of this session's relayed consumers too: what they delivered before now arrives first
        unsynced.update(self.remote)
        for worker, link in enumerate(peers.links):
            if link is not None and link.flush_pending:
                unsynced.add(worker)
        if unsynced:
            key = self.peer_key()
            for worker in unsynced:
                link = peers.links[worker]
                if link is not None:
                    link.frame(Frame.MARK, key)
                    self.awaiting += 1
            unsynced.clear()
        if self.quiet_fanins and not self.awaits_quiet:  # a sync's ok comes after their refusals, if any
            self.awaits_quiet = True
            self.awaiting += 1
        return bool(self.awaiting)

    def quiet_answered(self) -> None:
        """A QuietFanIn has every part's answer (its refusal, if any, is written): a sync waiting for it may go."""
        self.quiet_fanins -= 1
        if self.quiet_fanins == 0 and self.awaits_quiet:
            self.awaits_quiet = False
            self.answered()

    def done(self) -> None:
        """A worker has run everything this session sent it before its last sync mark."""
        self.answered()

    def answered(self) -> None:
        self.awaiting -= 1
        if self.awaiting <= 0:
            self.awaiting = 0
            self.unheld.set()

    def run_held(self, rejected: deque) -> None:
        """Run the lines a forward held back, each time the answers they wait for are in."""
        connection = self.connection
        flush_pending = connection.process.flush_pending
        while self.held is not None and not connection.closed:
            flush_pending()  # the forwards go out
            while self.awaiting and not connection.closed:
                self.unheld.wait()
                self.unheld.clear()
            lines, self.held = self.held, None
            if not connection.closed:
                run_lines(connection, lines, rejected)
        self.held = None

    def give_credit(self) -> None:
        """The client keeps up (its backlog under half the high-water mark): tell each owner what it took, once that
        is a CREDIT_SHARE of the window (an owner pauses only with a whole window uncredited, so it never waits on
        this: a W per owner per batch was as many frames as the answers it credited)."""
        owed = self.owed_credit
        least = self.peers.relay_window // CREDIT_SHARE
        if all(taken < least for taken in owed.values()):
            return
        links = self.peers.links
        for worker, taken in list(owed.items()):
            if taken >= least:
                del owed[worker]
                link = links[worker]
                if link is not None:
                    link.frame(Frame.CREDIT, self.key, b"%d" % taken)

    def waits_on(self, worker: int) -> bool:
        """True if this session has consumers or answers on `worker`."""
        return worker in self.remote or self.awaiting > 0

    def leave(self) -> None:
        """The client is gone: the owners drop this session (its relayed consumers' messages go back)."""
        if self.key:
            self.tell(Frame.SESSION_LEFT)
            self.peers.targets.pop(self.key, None)
        self.unheld.set()


def relay_of(session: Session) -> RelaySession:
    relay = session.relay
    assert relay is not None, "only a worker of several wraps its handlers"
    return relay


class RelayStub:
    """A consumer whose queue another worker owns: its deliveries come back over the link."""

    __slots__ = ("consumer_id", "owner")

    relayed = True
    unacked: dict = {}

    def __init__(self, consumer_id: bytes, owner: int) -> None:
        self.consumer_id = consumer_id
        self.owner = owner


def line_of(rid: bytes, action: bytes, args: bytes, confirm: bool) -> bytes:
    return b"%b %b %b%b" % (rid, action, b"--confirm " if confirm else b"", args)


def first_token(args: bytes) -> bytes:
    return args.split(None, 1)[0] if args.strip() else b""


def queue_owner(peers: Peers, queue: bytes, suffix: bytes) -> int:
    """The worker that owns `queue + suffix`; this one for a line with no queue (the handler answers its error)."""
    return peers.owner(queue + suffix) if queue else peers.worker


def by_queue(name: bytes, handler: Handler, suffix: bytes = b"") -> Handler:
    """rebind, delete_queue, purge_queue, fetch: run by the queue's owner; requeue_dead (suffix `.dead`): by the
    owner of the queue's dead letters."""

    def run(session: Session, rid: bytes, args: bytes, confirm: bool) -> Held | None:
        relay = relay_of(session)
        queue = first_token(args)
        owner = queue_owner(relay.peers, queue, suffix)
        if owner == relay.peers.worker:
            return handler(session, rid, args, confirm)
        check_name(queue, f"{name.decode()}: queue")
        return relay.send(owner, line_of(rid, name, args, confirm), answer_first=True)

    return run


def by_queue_new_consumer(name: bytes, handler: Handler) -> Handler:
    """consume: run by the queue's owner; a `RelayStub` stands here for the consumer it makes there."""

    def run(session: Session, rid: bytes, args: bytes, confirm: bool) -> Held | None:
        relay = relay_of(session)
        owner = queue_owner(relay.peers, first_token(args), b"")
        if owner == relay.peers.worker:
            return handler(session, rid, args, confirm)
        parse_consume(args)  # a bad line gets its error from here, as from the owner
        if rid in session.consumers_by_id:
            raise ProtocolError(f"{name.decode()}: consumer {text(rid)!r} is already consuming on this connection")
        session.consumers_by_id[rid] = cast(Consumer, RelayStub(rid, owner))  # stands in for one
        try:
            return relay.send(owner, line_of(rid, name, args, confirm), answer_first=True)
        except ProtocolError:
            # refused here (its owner is restarting): no consumer stands under that id, so the client's
            # "try again" with the same id must not be told it is already consuming
            del session.consumers_by_id[rid]
            raise

    return run


def by_consumer(name: bytes, handler: Handler, ending: bool = False) -> Handler:
    """ack, reject, touch: run where the consumer's queue is; delete_consumer (`ending`) too, and its stub here
    goes at once."""

    def run(session: Session, rid: bytes, args: bytes, confirm: bool) -> Held | None:
        stub = session.consumers_by_id.get(first_token(args))
        if type(stub) is not RelayStub:
            return handler(session, rid, args, confirm)
        answer_first = confirm
        if ending:
            del session.consumers_by_id[stub.consumer_id]
            answer_first = True  # the queue may be deleted with it: bindings change
        return relay_of(session).send(stub.owner, line_of(rid, name, args, confirm), answer_first)

    return run


def by_token(name: bytes, handler: Handler, owner_of_token: Callable[[Peers, bytes], int | None]) -> Handler:
    """schedule, unschedule (the name's owner), reply (the worker that issued the token)."""

    def run(session: Session, rid: bytes, args: bytes, confirm: bool) -> Held | None:
        relay = relay_of(session)
        peers = relay.peers
        token = first_token(args)
        owner = owner_of_token(peers, token) if token else None
        if owner is None or owner == peers.worker or not 0 <= owner < peers.count:
            return handler(session, rid, args, confirm)
        return relay.send(owner, line_of(rid, name, args, confirm), answer_first=True)

    return run


def schedule_owner(peers: Peers, name: bytes) -> int | None:
    return peers.owner(name) if not name.startswith(b"--") else None


def token_owner(peers: Peers, token: bytes) -> int | None:
    worker, found, _ = token.partition(b"w")
    return int(worker) if found and worker.isdigit() else None


class Gather:
    """An action every worker answers (`stats`, `queues`, ...): the peers' answers, merged once all are in."""

    __slots__ = ("relay", "key", "waiting", "answers", "merge")

    def __init__(self, relay: RelaySession, key: bytes, waiting: int, merge: Callable[[list[bytes]], bytes]) -> None:
        self.relay = relay
        self.key = key
        self.waiting = waiting
        self.answers: list[bytes] = []
        self.merge = merge

    def take(self, payload: bytes, worker: int) -> None:
        self.answers.append(payload)

    def done(self) -> None:
        self.waiting -= 1
        if self.waiting == 0:
            relay = self.relay
            relay.peers.targets.pop(self.key, None)
            if not relay.connection.closed:
                relay.connection.write(self.merge(self.answers))
            relay.answered()


def gather(session: Session, line: bytes, local_answer: bytes, merge: Callable[[bytes, list[bytes]], bytes]) -> Held:
    """Ask every other worker `line`; once all have answered, write `merge(local_answer, answers)`."""
    relay = relay_of(session)
    peers = relay.peers
    links = []
    for worker in range(peers.count):
        if worker != peers.worker:
            link = peers.links[worker]
            if link is None:
                raise ProtocolError(f"{peers.unreachable(worker)}: ask again in a moment")
            links.append(link)
    key = peers.new_key(b"g")
    peers.targets[key] = Gather(relay, key, len(links), lambda answers: merge(local_answer, answers))
    for link in links:
        link.add(Frame.SESSION_LINES, key, line)
        link.frame(Frame.MARK, key)
    relay.awaiting += 1
    return Held.NEXT


def answer_lines(answer: bytes) -> list[bytes]:
    return [line for line in answer.split(b"\n") if line]


def every_worker_stats(name: bytes, handler: Handler) -> Handler:
    """`stats`: every worker's figures summed; `stats --worker=N`: worker N's."""

    def run(session: Session, rid: bytes, args: bytes, confirm: bool) -> Held | None:
        relay = relay_of(session)
        peers = relay.peers
        process = session.process
        worker = parse_stats_args(args, peers.count)
        if worker is not None and worker != peers.worker:
            return relay.send(worker, b"%b stats" % rid, answer_first=True)
        local = process.stats()
        if worker is not None:
            session.ok(rid, to_json(local))
            return None

        def merge(local_answer: bytes, answers: list[bytes]) -> bytes:
            return format_ok(rid, to_json(merge_stats(answers, local, peers.distinct_events())))

        return gather(session, b"%b stats" % rid, b"", merge)

    return run


class Capture:
    """A session stand-in that keeps what a local handler writes (the local part of a gathered answer)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.parts: list[bytes] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def ok(self, rid: bytes, data: bytes = b"") -> None:
        self.parts.append(format_ok(rid, data))


def every_worker_rows(key: str) -> Callable[[bytes, Handler], Handler]:
    """queues, schedules: every worker's rows of `{rid} ok {json}` lines, sorted by `key` as one worker would."""

    def wrap(name: bytes, handler: Handler) -> Handler:
        def run(session: Session, rid: bytes, args: bytes, confirm: bool) -> Held | None:
            capture = Capture(session)
            handler(capture, rid, args, confirm)  # a bad line raises here, before the others are asked
            def merge(local_answer: bytes, answers: list[bytes]) -> bytes:
                rows = []
                for answer in (local_answer, *answers):
                    for line in answer_lines(answer):
                        body = ok_body(line)
                        if body != b"--end":
                            rows.append(json.loads(body))
                rows.sort(key=lambda row: row[key])
                return format_rows(rid, [to_json(row) for row in rows])

            return gather(session, line_of(rid, name, args, False), b"".join(capture.parts), merge)

        return run

    return wrap


def every_worker_sum(name: bytes, handler: Handler) -> Handler:
    """settle: a lease id does not name its queue, so every worker settles what it holds; the counts add up."""

    def run(session: Session, rid: bytes, args: bytes, confirm: bool) -> Held | None:
        capture = Capture(session)
        handler(capture, rid, args, confirm)

        def merge(local_answer: bytes, answers: list[bytes]) -> bytes:
            total = 0
            for answer in (local_answer, *answers):
                for line in answer_lines(answer):
                    total += int(ok_body(line) or b"0")
            return format_ok(rid, b"%d" % total)

        return gather(session, line_of(rid, name, args, False), b"".join(capture.parts), merge)

    return run


def chosen_worker(name: bytes, handler: Handler) -> Handler:
    """_eval runs on worker 0, on worker N with --worker=N, or on queue Q's owner with --owner=Q (`state` is
    that worker's queues)."""

    def run(session: Session, rid: bytes, args: bytes, confirm: bool) -> Held | None:
        relay = relay_of(session)
        peers = relay.peers
        worker = 0
        first, _, code = args.partition(b" ")
        if (value := parse_flag_value(first, b"--worker")) is not None:
            worker = parse_worker(value, name.decode(), peers.count)
        elif (value := parse_flag_value(first, b"--owner")) is not None:
            worker = peers.owner(value)  # the worker that owns queue `value`
        else:
            code = args
        if worker == peers.worker:
            return handler(session, rid, code, confirm)
        return relay.send(worker, b"%b %b %b" % (rid, name, code), answer_first=True)

    return run


def after_other_workers(name: bytes, handler: Handler) -> Handler:
    """ping and sync answer after everything this session sent before them has run, wherever that was (a quiet
    publish's copies: stored, or refused with the error written first)."""

    def run(session: Session, rid: bytes, args: bytes, confirm: bool) -> Held | None:
        relay = relay_of(session)
        if relay.synced:
            relay.synced = False
            return handler(session, rid, args, confirm)  # this line ran once and waited for the sync: answer now
        if relay.mark_other_workers():
            relay.synced = True
            return Held.AGAIN
        return handler(session, rid, args, confirm)

    return run


WRAPPERS: dict[Placement, Callable[[bytes, Handler], Handler]] = {
    Placement.QUEUE_OWNER: by_queue,
    Placement.QUEUE_OWNER_NEW_CONSUMER: by_queue_new_consumer,
    Placement.DEAD_QUEUE_OWNER: lambda name, handler: by_queue(name, handler, b".dead"),
    Placement.CONSUMER_OWNER: by_consumer,
    Placement.CONSUMER_OWNER_ENDING: lambda name, handler: by_consumer(name, handler, ending=True),
    Placement.SCHEDULE_OWNER: lambda name, handler: by_token(name, handler, schedule_owner),
    Placement.TOKEN_ISSUER: lambda name, handler: by_token(name, handler, token_owner),
    Placement.EVERY_WORKER_STATS: every_worker_stats,
    Placement.EVERY_WORKER_ROWS_BY_QUEUE: every_worker_rows("queue"),
    Placement.EVERY_WORKER_ROWS_BY_NAME: every_worker_rows("name"),
    Placement.EVERY_WORKER_SUM: every_worker_sum,
    Placement.CHOSEN_WORKER: chosen_worker,
    Placement.AFTER_OTHER_WORKERS: after_other_workers,
}


def place(name: bytes, action: Action, handler: Handler) -> Handler:
    """`handler` (action `name`'s, or its stand-in past --max-memory) run where `action.placement` says."""
    wrap = WRAPPERS.get(action.placement)
    return handler if wrap is None else wrap(name, handler)

"""Step 4 of the flow with worker processes: which worker runs a line, and the forward when it is not this one.

`relay_table(handlers)` wraps an action table for a worker of several: a line about a queue
(consume, rebind, delete_queue, fetch), a relayed consumer (ack, reject, touch,
delete_consumer), a schedule or a reply token runs where that lives; `stats`, `queues`,
`schedules` and `settle` are asked of every worker and merged; `_eval` and `stats
--worker=N` reach one. `publish` keeps its handler: the Forwarder among the session's
brokers sends the copies. A forwarded line that answers, or changes bindings, holds the
session's next lines until the owner has run it (`peers.Hold`), so a client sees its
answers in the order it sent the lines, and never publishes past a binding it just made.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .actions import Handler, Session, check_name, parse_consume, parse_stats_args, parse_worker, to_json
from .peers import Gather, merge_stats
from .protocol import Hold, ProtocolError, format_ok, parse_flag_value, text


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


def forward(session: Any, owner: int, line: bytes, block: bool) -> None:
    """Send `line` to run in this session's place on worker `owner`; `block`: hold the next lines until it has."""
    peers = session.workers.peers
    link = peers.links[owner]
    if link is None:
        raise ProtocolError(f"worker {owner}, which owns this, is restarting: try again")
    key = session.peer_key()
    link.add(83, key, line)
    session.remote.add(owner)
    if block:
        link.frame(77, key)
        session.awaiting += 1
        raise Hold()
    session.unsynced.add(owner)


def first_token(args: bytes) -> bytes:
    return args.split(None, 1)[0] if args.strip() else b""


def by_queue(action: bytes, handler: Handler) -> Handler:
    """consume, rebind, delete_queue, fetch: run by the queue's owner."""

    def run(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
        peers = session.workers.peers
        name = first_token(args)
        owner = peers.owner(name) if name else peers.worker
        if owner == peers.worker:
            handler(session, rid, args, confirm)
            return
        if action == b"consume":
            parse_consume(args)  # a bad line gets its error from here, as from the owner
            if rid in session.consumers_by_id:
                raise ProtocolError(f"consume: consumer {text(rid)!r} is already consuming on this connection")
            session.consumers_by_id[rid] = RelayStub(rid, owner)  # type: ignore[assignment]  # stands in for one
        else:
            check_name(name, f"{action.decode()}: queue")
        forward(session, owner, line_of(rid, action, args, confirm), block=True)

    return run


def by_consumer(action: bytes, handler: Handler) -> Handler:
    """ack, reject, touch, delete_consumer: run where the consumer's queue is."""

    def run(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
        stub = session.consumers_by_id.get(first_token(args))
        if type(stub) is not RelayStub:
            handler(session, rid, args, confirm)
            return
        block = confirm
        if action == b"delete_consumer":
            del session.consumers_by_id[stub.consumer_id]
            block = True  # the queue may be deleted with it: bindings change
        forward(session, stub.owner, line_of(rid, action, args, confirm), block)

    return run


def by_name(action: bytes, handler: Handler, owner_of_token: Callable[[Any, bytes], int | None]) -> Handler:
    """schedule, unschedule (the name's owner), reply (the worker that issued the token)."""

    def run(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
        peers = session.workers.peers
        token = first_token(args)
        owner = owner_of_token(peers, token) if token else None
        if owner is None or owner == peers.worker or not 0 <= owner < peers.count:
            handler(session, rid, args, confirm)
            return
        forward(session, owner, line_of(rid, action, args, confirm), block=True)

    return run


def schedule_owner(peers: Any, name: bytes) -> int | None:
    return peers.owner(name) if not name.startswith(b"--") else None


def token_owner(peers: Any, token: bytes) -> int | None:
    worker, found, _ = token.partition(b"w")
    return int(worker) if found and worker.isdigit() else None


def gather(session: Any, rid: bytes, line: bytes, local_answer: bytes,
           merge: Callable[[bytes, list[bytes]], bytes]) -> None:
    """Ask every other worker `line`; once all have answered, write `merge(local_answer, answers)`."""
    peers = session.workers.peers
    others = [worker for worker in range(peers.count) if worker != peers.worker]
    missing = [worker for worker in others if peers.links[worker] is None]
    if missing:
        raise ProtocolError(f"worker {missing[0]} is restarting: ask again in a moment")
    key = peers.new_key(b"g")
    peers.targets[key] = Gather(session, key, len(others), lambda answers: merge(local_answer, answers))
    for worker in others:
        link = peers.links[worker]
        link.add(83, key, line)
        link.frame(77, key)
    session.awaiting += 1
    raise Hold()


def answer_lines(answer: bytes) -> list[bytes]:
    return [line for line in answer.split(b"\n") if line]


def handle_stats(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    """`stats`: every worker's figures summed; `stats --worker=N`: worker N's."""
    workers = session.workers
    peers = workers.peers
    worker = parse_stats_args(args, peers.count)
    if worker is not None and worker != peers.worker:
        forward(session, worker, b"%b stats" % rid, block=True)
    local = workers.stats()
    if worker is not None:
        session.ok(rid, to_json(local))
        return

    def merge(local_answer: bytes, answers: list[bytes]) -> bytes:
        return format_ok(rid, to_json(merge_stats(answers, local, peers.distinct_events())))

    gather(session, rid, b"%b stats" % rid, b"", merge)


def sorted_rows(key: str) -> Callable[[bytes, bytes], Callable[[bytes, list[bytes]], bytes]]:
    """A merge for answers of `{rid} ok {json}` lines ending in `{rid} ok --end`: all rows, sorted by `key`."""

    def for_rid(rid: bytes, head: bytes) -> Callable[[bytes, list[bytes]], bytes]:
        def merge(local_answer: bytes, answers: list[bytes]) -> bytes:
            rows = []
            for answer in (local_answer, *answers):
                for line in answer_lines(answer):
                    body = line.partition(b" ok ")[2]
                    if body != b"--end":
                        rows.append(json.loads(body))
            rows.sort(key=lambda row: row[key])
            return b"".join([b"%b%b\n" % (head, to_json(row)) for row in rows] + [head + b"--end\n"])

        return merge

    return for_rid


class Capture:
    """A session stand-in that keeps what a local handler writes (the local part of a gathered answer)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.parts: list[bytes] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def ok(self, rid: bytes, data: bytes = b"") -> None:
        self.parts.append(format_ok(rid, data))


def gathered_rows(action: bytes, handler: Handler, key: str) -> Handler:
    """queues, schedules: every worker's rows, sorted as one worker would."""
    merge_for = sorted_rows(key)

    def run(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
        capture = Capture(session)
        handler(capture, rid, args, confirm)  # a bad line raises here, before the others are asked
        gather(session, rid, line_of(rid, action, args, False), b"".join(capture.parts),
               merge_for(rid, rid + b" ok "))

    return run


def handle_settle(handler: Handler) -> Handler:
    """settle: a lease id does not name its queue, so every worker settles what it holds; the counts add up."""

    def run(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
        capture = Capture(session)
        handler(capture, rid, args, confirm)

        def merge(local_answer: bytes, answers: list[bytes]) -> bytes:
            total = 0
            for answer in (local_answer, *answers):
                for line in answer_lines(answer):
                    total += int(line.partition(b" ok ")[2] or b"0")
            return format_ok(rid, b"%d" % total)

        gather(session, rid, line_of(rid, b"settle", args, False), b"".join(capture.parts), merge)

    return run


def handle_eval(handler: Handler) -> Handler:
    """_eval runs on worker 0, on worker N with --worker=N, or on queue Q's owner with --owner=Q (`state` is
    that worker's queues)."""

    def run(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
        peers = session.workers.peers
        worker = 0
        first, _, code = args.partition(b" ")
        if (value := parse_flag_value(first, b"--worker")) is not None:
            worker = parse_worker(value, "_eval", peers.count)
        elif (value := parse_flag_value(first, b"--owner")) is not None:
            worker = peers.owner(value)  # the worker that owns queue `value`
        else:
            code = args
        if worker == peers.worker:
            handler(session, rid, code, confirm)
        else:
            forward(session, worker, b"%b _eval %b" % (rid, code), block=True)

    return run


def handle_ping(handler: Handler) -> Handler:
    """ping answers after everything this session sent before it has run, wherever that was."""

    def run(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
        if session.synced:  # type: ignore[attr-defined]
            session.synced = False  # type: ignore[attr-defined]
            handler(session, rid, args, confirm)  # this line ran once and waited for the sync: answer now
            return
        if session.mark_other_workers():  # type: ignore[attr-defined]
            session.synced = True  # type: ignore[attr-defined]
            raise Hold(again=True)
        handler(session, rid, args, confirm)

    return run


def relay_table(table: dict[bytes, Handler]) -> dict[bytes, Handler]:
    """`table` with the actions that may run on another worker wrapped."""
    wrapped = dict(table)
    for name, handler in table.items():
        if name in (b"consume", b"rebind", b"delete_queue", b"fetch"):
            wrapped[name] = by_queue(name, handler)
        elif name in (b"ack", b"reject", b"touch", b"delete_consumer"):
            wrapped[name] = by_consumer(name, handler)
        elif name in (b"schedule", b"unschedule"):
            wrapped[name] = by_name(name, handler, schedule_owner)
        elif name == b"reply":
            wrapped[name] = by_name(name, handler, token_owner)
        elif name == b"stats":
            wrapped[name] = handle_stats
        elif name == b"queues":
            wrapped[name] = gathered_rows(name, handler, "queue")
        elif name == b"schedules":
            wrapped[name] = gathered_rows(name, handler, "name")
        elif name == b"settle":
            wrapped[name] = handle_settle(handler)
        elif name == b"_eval":
            wrapped[name] = handle_eval(handler)
        elif name == b"ping":
            wrapped[name] = handle_ping(handler)
    return wrapped

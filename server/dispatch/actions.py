"""The declared actions, one small handler each, and the dispatcher.

`ACTIONS` declares every action: its handler, its error for a missing argument, and what the dispatcher must
know (needs arguments, protected like `_eval`, needs auth), what a scoped token needs to
run it (`ScopeCheck`, checked in dispatch/scopes.py) and where it runs among workers (`Placement`). Each
session runs lines against a table built once from those declarations for what it may
do (`actions_for`), so a protected action a session may not run is simply absent and the
hot path pays nothing for the check. `run_lines` splits each line, strips a leading
`--confirm`, refuses an empty argument list for actions that need one, and calls the
handler; a handler parses only its own arguments, calls the worker that owns the queue,
answers through its `Session`, and reports client mistakes by raising `ProtocolError`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeAlias

from ..core.schedules import BadRule
from ..core.state import Broker, Consumer, Queue, SeqConsumer, TimedConsumer, TimedSeqConsumer
from ..wire.outbox import Outbox
from ..wire.protocol import (
    Held,
    ProtocolError,
    delivery_tail,
    format_rows,
    looks_like_http,
    parse_count,
    parse_flag_value,
    parse_seconds,
    parse_unix_seconds,
    text,
)
from .process import VERSION, Forwarding, Process, full_queues_reason

if TYPE_CHECKING:
    from ..workers.relay import RelaySession

log = logging.getLogger("mqks.actions")

DASH: Final = 45  # b"-"[0]: the first byte of a flag
SPACE: Final = 32  # b" "[0]
CONFIRM: Final = b"--confirm"
# left in a publish's args by run_lines (its 10th byte is no space): handle_publish looks for it among flags
CONFIRM_QUIET: Final = b"--confirm-quiet"
CONSUME_MISSING = "consume: queue expected: {consumer_id} consume {queue} [{event} ...] [flags]"
REBIND_MISSING = ("rebind: queue expected: {id} rebind {queue} [{event} ...] [--remove ...] [--remove-mask ...] "
                  "[--add ...]")


class Publisher(Protocol):
    """What a publish calls: this process's broker, or with worker processes the Forwarder (workers/forwarding.py)."""

    def publish(self, msg_id: bytes, event: bytes, tail: bytes) -> None: ...

    def routes(self, event: bytes) -> bool: ...

    def full_queues(self, event: bytes) -> list[Queue]: ...

    def permits(self, event: bytes) -> bool: ...


class Session(Protocol):
    """What a handler may use of the client that sent the line."""

    peer: str
    peer_is_loopback: bool
    eval_enabled: bool
    eval_refusal: str | None  # why _eval is off whatever --eval says (token auth beyond loopback), or None
    authenticated: bool  # True from the start unless the server wants a token
    unauthenticated_lines: int
    said_hello: bool
    tls: bool
    ttl_seconds: float | None
    process: Process
    publisher: Publisher  # process.publisher (this broker, or the Forwarder to every worker), one load away
    outbox: Outbox
    consumers_by_id: dict[bytes, Consumer]
    actions: dict[bytes, Action]
    handlers: dict[bytes, Handler]  # the same table as bare handlers, for the per-line lookup
    closed: bool
    relay: RelaySession | None  # with worker processes, this client's session on the others (relay.py)

    def write(self, data: bytes) -> None: ...

    def ok(self, rid: bytes, data: bytes = b"") -> None: ...

    def error(self, rid: bytes, reason: str, line: bytes) -> None: ...

    def close(self, flush_first: bool = False) -> None: ...

    def authenticate(self, token: bytes) -> bool | None:
        """Check a token; True opens every action to this session, None: the server wants no token."""

    def set_ttl(self, seconds: float | None) -> None:
        """Expect traffic at least every `seconds` (None: no limit); 2x that in silence closes the session."""


# a handler returns None, or (relayed, see relay.py) Held when the session's next lines must wait
Handler: TypeAlias = Callable[[Session, bytes, bytes, bool], Held | None]


def check_name(name: bytes, what: str) -> bytes:
    if not name or name.startswith(b"--"):
        raise ProtocolError(f"{what} expected, got {text(name)!r}" if name else f"{what} expected")
    return name


def handle_publish(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    # partition, not find: find is a METH_VARARGS call (an argument tuple, then PyArg_ParseTuple), measured at twice
    # the cost of a partition and its copy of the data
    event, space, _ = args.partition(b" ")
    if not event or (event[0] == DASH and event.startswith(b"--")):
        if event == CONFIRM_QUIET:
            publish_quiet(session, rid, args[16:], confirm)
        else:
            publish_flagged(session, rid, args, confirm)
        return
    # wire.protocol.delivery_tail's bytes, written out on the hot path: its call and the cut of {data} measured up to
    # 5% of a publish (bench.hot_path, plain). The spec's delivery always has a space before {data}, even an empty one
    tail = b"".join((b" ok ", rid, b" event=", args) if space else (b" ok ", rid, b" event=", args, b" "))
    if confirm:
        publish_confirmed(session, rid, event, tail)
        return
    publisher = session.publisher
    if type(publisher) is Broker:
        publisher.publish(rid, event, tail)  # typed Broker here: a direct call when compiled, not a method lookup
    else:
        publisher.publish(rid, event, tail)


def publish_flagged(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    """`publish [--mandatory] [--delay=S | --at=UNIX_SECONDS] {event} {data}` (extensions): with --mandatory an
    event no queue is bound to (now, when the line is read) is refused; a delayed copy enters its queues when
    due."""
    mandatory = args.startswith(b"--mandatory") and args[11:12] in (b" ", b"")
    if mandatory:
        args = args[12:]
    flag, _, rest = args.partition(b" ")
    now = time.time()
    if flag.startswith(b"--at="):
        due = parse_unix_seconds(flag[5:], "publish: --at")
    elif flag.startswith(b"--delay="):
        due = now + parse_seconds(flag[8:], "publish: --delay")
    elif mandatory and not flag.startswith(b"--"):
        due, rest = 0.0, args  # at once
    else:
        check_name(flag, "publish: event")  # raises: an event never starts with "--"
    event, _, data = rest.partition(b" ")
    if not event or event[0] == DASH:
        check_name(event, "publish: event")
    if mandatory and not session.publisher.routes(event):
        raise ProtocolError(f"publish --mandatory: no queue is bound to {text(event)!r}: the message was not "
                            "published")
    tail = delivery_tail(rid, event, data)
    due_ms = math.ceil(due * 1000)  # never early: the first millisecond at or after the due time
    process = session.process
    if due_ms <= now * 1000:
        if confirm:
            publish_confirmed(session, rid, event, tail)
        else:
            session.publisher.publish(rid, event, tail)
        return
    journal = process.journal
    if confirm and journal is not None and journal.blocked:
        raise ProtocolError(journal.refusal())
    session.publisher.permits(event)  # a delayed copy is published by the process later, not by this session
    process.publish_later(due_ms, tail)
    if confirm:
        if journal is None:
            session.ok(rid)
        else:
            journal.confirm_later(session.outbox, rid)


def forwarder_for(process: Process, publisher: Publisher, event: bytes) -> Forwarding | None:
    """The Forwarder if some queues bound to `event` are other workers' (a confirmed publish goes through it), else
    None; refused while a worker that is not linked could have some. A line another worker forwarded (its session
    publishes to this worker's broker only) is never sent on."""
    forwarder, peers = process.forwarder, process.peers
    if forwarder is not None and peers is not None and publisher is not process.broker and publisher.permits(event):
        if peers.unlinked and peers.routing_unknown():
            raise ProtocolError(peers.unlinked_reason())
        if forwarder.routes_elsewhere(event):
            return forwarder
    return None


def publish_confirmed(session: Session, rid: bytes, event: bytes, tail: bytes) -> None:
    """Publish, then `ok`: at once in memory, once the log has it with --data-dir. Each worker's log answers for its
    own queues (publish_confirmed_here): one that takes no writes must not refuse what goes to the others' (issue 56:
    one wedged group refused a client's publishes to every queue of the cluster)."""
    process = session.process
    publisher = session.publisher
    forwarder = forwarder_for(process, publisher, event)
    if forwarder is not None:
        forwarder.publish_confirmed(session, rid, event, tail)
        return
    refusal = process.publish_confirmed_here(publisher, session.outbox, rid, rid, event, tail, answer_now=session)
    if refusal is not None:
        raise ProtocolError(refusal)


class QuietAnswers:
    """A quiet publish's place in the journal's confirms: its `ok` is dropped, its error (a failed commit) is the
    client's."""

    __slots__ = ("outbox",)

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox

    def write(self, data: bytes) -> None:
        if data.partition(b" ")[2].startswith(b"error "):  # one error line, or a run of `ok` lines
            self.outbox.write(data)


class Dropped:
    """A quiet publish's `ok` in memory: nobody hears it."""

    __slots__ = ()

    def write(self, data: bytes) -> None:
        pass


DROPPED: Final = Dropped()


def publish_quiet(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    """`publish --confirm-quiet {event} {data}` (extension): a confirmed publish that is answered only when refused
    (the error `--confirm` would get); a later `sync` answers once every earlier one is stored (one answer per
    batch instead of one per message). With worker processes a copy for another worker's queues is published and
    answered quietly there (Forwarder.publish_quiet), and the sync waits for those workers (relay.py); not on a
    cluster's nodes (quiet_confirms_offered)."""
    process = session.process
    if confirm:
        raise ProtocolError("publish: give one of --confirm and --confirm-quiet")
    event, space, _ = args.partition(b" ")
    if not event or event[0] == DASH:
        check_name(event, "publish: event")  # a flag is refused: the event comes right after
    tail = b"".join((b" ok ", rid, b" event=", args) if space else (b" ok ", rid, b" event=", args, b" "))
    publisher = session.publisher
    if process.journal is None and type(publisher) is Broker:
        # publish_confirmed_here's memory case, typed: direct compiled calls (bench.hot_path's run_lines into one
        # queue, compiled: 860 -> 520 ns a line; a plain publish 350, --confirm 750)
        full = publisher.full_queues(event)
        publisher.publish(rid, event, tail)
        if full:
            raise ProtocolError(full_queues_reason(full))
        return
    if not quiet_confirms_offered(process):
        raise ProtocolError("publish --confirm-quiet: not on a cluster's nodes (a copy another group refused could "
                            "be answered after a sync): use --confirm")
    forwarder = forwarder_for(process, publisher, event)
    if forwarder is not None:
        forwarder.publish_quiet(session, rid, event, tail)
        return
    target = DROPPED if process.journal is None else QuietAnswers(session.outbox)
    refusal = process.publish_confirmed_here(publisher, target, rid, rid, event, tail)
    if refusal is not None:
        raise ProtocolError(refusal)


def quiet_confirms_offered(process: Process) -> bool:
    """True if quiet publishes and `sync` are taken: one process, or worker processes of one broker. A cluster's
    group moves between nodes, and what a sync owes an owner failing over is not proven kept (hello says so)."""
    peers = process.peers
    return peers is None or peers.unit != "group"


def handle_sync(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    """`{id} sync` (extension) -> `{id} ok ` once every earlier publish of this connection is done: stored (with
    --data-dir: once the log has everything recorded before it), or refused with its own error line first."""
    if args.strip():
        raise ProtocolError(f"sync: unexpected {text(args)!r}; expected {{id}} sync")
    journal = session.process.journal
    if journal is None:
        session.ok(rid)
    else:
        journal.confirm_later(session.outbox, rid)  # confirms keep their order: after every earlier commit's


def parse_limit(token: bytes, limits: dict[str, int | None], action: str) -> bool:
    """`--max-retries=N|none` or `--max-length=N|none` (queue settings) into `limits`; False if `token` is neither."""
    for flag, name, least in ((b"--max-retries", "max_retries", 0), (b"--max-length", "max_length", 1)):
        value = parse_flag_value(token, flag)
        if value is None:
            continue
        if value == b"none":
            limits[name] = None
        else:
            limit = parse_count(value, f"{action}: {flag.decode()}") if value else -1
            if limit < least:
                raise ProtocolError(f"{action}: {flag.decode()} wants a whole number >= {least} (or none), "
                                    f"got {text(value)!r}")
            limits[name] = limit
        return True
    return False


DEFAULT_REQUEST_TIMEOUT_SECONDS = 30.0


def handle_request(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    """`{rid} request [--timeout=S] {event} {data}` (extension): publish; the first reply is the answer.

    Deliveries carry `,reply={token}` after the event; `{rid} ok --reply {data}` comes when a
    worker replies, `{rid} error ... no reply within S s` when none does in time.
    """
    seconds = DEFAULT_REQUEST_TIMEOUT_SECONDS
    first, _, rest = args.partition(b" ")
    if (value := parse_flag_value(first, b"--timeout")) is not None:
        seconds = parse_seconds(value, "request: --timeout") if value else 0.0
        if not seconds:
            raise ProtocolError(f"request: --timeout wants seconds > 0, got {text(value)!r}")
        args = rest
    event, _, data = args.partition(b" ")
    check_name(event, "request: event")
    if not session.publisher.routes(event):
        raise ProtocolError(f"request: no queue is bound to event {text(event)!r}")
    token = session.process.requests.open(session.outbox, rid, seconds)
    tail = delivery_tail(rid, b"%b,reply=%b" % (event, token), data)
    session.publisher.publish(rid, event, tail)


def handle_reply(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    """`{id} reply {token} {data}` (extension): answer a request; a second reply is dropped and counted."""
    token, _, data = args.partition(b" ")
    if not session.process.requests.reply(token, data):
        raise ProtocolError(f"reply: unknown token {text(token)!r}: never issued, timed out, or its requester left")
    if confirm:
        session.ok(rid)


SCHEDULE_USAGE = ("{id} schedule {name} --every=S|--cron M H DOM MON DOW [--count=N] [--nohaste] "
                  "{event} {data}")


def handle_schedule(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    """`schedule {name} --every=S|--cron M H DOM MON DOW [--count=N] [--nohaste] {event} {data}` (extension)."""
    name, _, rest = args.partition(b" ")
    check_name(name, "schedule: name")
    every: float | None = None
    cron: str | None = None
    count: int | None = None
    nohaste = False
    while rest.startswith(b"--"):
        token, _, rest = rest.partition(b" ")
        if token == b"--cron":
            fields = rest.split(b" ", 5)
            if len(fields) < 6 or not all(fields[:5]):
                raise ProtocolError(f"schedule: --cron wants five fields (M H DOM MON DOW), then the event; "
                                    f"expected {SCHEDULE_USAGE}")
            cron, rest = b" ".join(fields[:5]).decode(), fields[5]
        elif (value := parse_flag_value(token, b"--every")) is not None:
            every = parse_seconds(value, "schedule: --every") if value else 0.0
            if not every:
                raise ProtocolError(f"schedule: --every wants seconds > 0, got {text(value)!r}")
        elif (value := parse_flag_value(token, b"--count")) is not None:
            count = parse_count(value, "schedule: --count") if value else 0
            if not count:
                raise ProtocolError(f"schedule: --count wants a whole number >= 1, got {text(value)!r}")
        elif token == b"--nohaste":
            nohaste = True
        else:
            raise ProtocolError(f"schedule: unknown flag {text(token)!r}; expected {SCHEDULE_USAGE}")
    if (every is None) == (cron is None):
        raise ProtocolError(f"schedule: give one of --every=S and --cron; expected {SCHEDULE_USAGE}")
    event, _, data = rest.partition(b" ")
    check_name(event, "schedule: event")
    try:
        session.process.schedules.set(name, every, cron, count, nohaste, event, data)
    except BadRule as e:
        raise ProtocolError(f"schedule: {e}") from None
    if confirm:
        session.ok(rid)


def handle_unschedule(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    tokens = args.split()
    if len(tokens) != 1:
        raise ProtocolError("unschedule: expected {id} unschedule {name}")
    if not session.process.schedules.remove(tokens[0]):
        raise ProtocolError(f"unschedule: no schedule {text(tokens[0])!r}")
    if confirm:
        session.ok(rid)


def handle_schedules(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    """`{id} schedules` -> `{id} ok {json}` per schedule, sorted by name, then `{id} ok --end`."""
    if args.strip():
        raise ProtocolError(f"schedules: unexpected {text(args)!r}; expected {{id}} schedules")
    session.write(format_rows(rid, [to_json(row) for row in session.process.schedules.rows()]))


def parse_consume(args: bytes) -> tuple[bytes, list[bytes], list[bytes] | None, dict, dict[str, int | None]]:
    """`{queue} [events] [--add events] [flags]` -> (queue, events, added or None without --add, flags, limits)."""
    tokens = args.split()
    if not tokens:
        raise ProtocolError(CONSUME_MISSING)
    queue = check_name(tokens[0], "consume: queue")
    events: list[bytes] = []
    added: list[bytes] | None = None
    flags: dict = {"manual_ack": False, "prefetch": 0, "delete_when_unused_seconds": None, "seq": False,
                   "ack_timeout_seconds": None}
    limits: dict[str, int | None] = {}
    target: list[bytes] | None = events
    for token in tokens[1:]:
        if not token.startswith(b"--"):
            if target is None:
                raise ProtocolError(f"consume: event {text(token)!r} after a flag; "
                                    "put events before flags or after --add")
            target.append(token)
            continue
        target = None
        if token == b"--add":
            target = added = added if added is not None else []
        elif token == b"--manual-ack":
            flags["manual_ack"] = True
        elif token == b"--seq":
            flags["seq"] = True
        elif (value := parse_flag_value(token, b"--delete-queue-when-unused")) is not None:
            flags["delete_when_unused_seconds"] = parse_seconds(value, "--delete-queue-when-unused") if value else 0.0
        elif (value := parse_flag_value(token, b"--prefetch")) is not None:
            flags["prefetch"] = parse_count(value, "--prefetch")
        elif (value := parse_flag_value(token, b"--ack-timeout")) is not None:
            seconds = parse_seconds(value, "consume: --ack-timeout") if value else 0.0
            if not seconds:
                raise ProtocolError(f"consume: --ack-timeout wants seconds > 0, got {text(value)!r}")
            flags["ack_timeout_seconds"] = seconds
        elif not parse_limit(token, limits, "consume"):
            raise ProtocolError(f"consume: unknown flag {text(token)!r}")
    if flags["prefetch"] and not flags["manual_ack"]:
        raise ProtocolError("consume: --prefetch needs --manual-ack (auto-ack messages are never in flight)")
    if flags["ack_timeout_seconds"] is not None and not flags["manual_ack"]:
        raise ProtocolError("consume: --ack-timeout needs --manual-ack (auto-ack messages are never in flight)")
    return queue, events, added, flags, limits


def handle_consume(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    name, events, added, flags, limits = parse_consume(args)
    if rid in session.consumers_by_id:
        raise ProtocolError(f"consume: consumer {text(rid)!r} is already consuming on this connection")
    broker = session.process.broker
    made = name not in broker.queues
    queue = broker.queue(name)
    seq = flags.pop("seq")
    ack_timeout_seconds = flags.pop("ack_timeout_seconds")
    consumer: Consumer
    if ack_timeout_seconds is None:
        consumer = (SeqConsumer if seq else Consumer)(rid, queue, session.outbox, **flags)
    else:
        consumer = (TimedSeqConsumer if seq else TimedConsumer)(rid, queue, session.outbox, **flags,
                                                                ack_timeout_seconds=ack_timeout_seconds,
                                                                clock=broker.clock)
    try:
        broker.consume(consumer, events, added, limits)
    except ProtocolError:
        if made:  # refused before anything changed ("try again"): the line leaves no empty queue behind
            broker.queues.pop(name, None)
        raise
    if confirm:
        session.ok(rid)
    broker.pump(queue)


def handle_rebind(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    tokens = args.split()
    if not tokens:
        raise ProtocolError(REBIND_MISSING)
    name = check_name(tokens[0], "rebind: queue")
    lists: dict[bytes, list[bytes]] = {b"": [], b"--remove": [], b"--remove-mask": [], b"--add": []}
    limits: dict[str, int | None] = {}
    target = lists[b""]
    for token in tokens[1:]:
        if token.startswith(b"--"):
            if token in lists:
                target = lists[token]
            elif not parse_limit(token, limits, "rebind"):
                raise ProtocolError(f"rebind: unknown flag {text(token)!r}")
        else:
            target.append(token)
    broker = session.process.broker
    made = name not in broker.queues
    queue = broker.queue(name)
    try:
        changed = broker.rebind(queue, replace=lists[b""] or None, add=lists[b"--add"], remove=lists[b"--remove"],
                                remove_masks=lists[b"--remove-mask"])
    except ProtocolError:
        if made:  # as in handle_consume
            broker.queues.pop(name, None)
        raise
    if limits and broker.set_limits(queue, limits):
        changed = True
    if changed:
        broker.updates(queue)
    if confirm:
        session.ok(rid)


def parse_ack(session: Session, action: str, args: bytes) -> tuple[Consumer, list[bytes] | None]:
    """`{consumer_id} {msg_id} ...|--all` -> (consumer, msg ids or None for --all)."""
    tokens = args.split()
    if len(tokens) < 2:
        raise ProtocolError(f"{action}: expected {{consumer_id}} {{msg_id}}|--all")
    consumer = session.consumers_by_id.get(tokens[0])
    if consumer is None:
        raise ProtocolError(f"{action}: unknown consumer {text(tokens[0])!r} on this connection")
    if tokens[1] == b"--all":
        if len(tokens) > 2:
            raise ProtocolError(f"{action}: --all takes no message ids")
        return consumer, None
    if tokens[1].startswith(b"--"):
        raise ProtocolError(f"{action}: unknown flag {text(tokens[1])!r}")
    return consumer, tokens[1:]


def handle_ack(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    # `{consumer_id} {msg_id}`, one id in flight: straight to the broker, with no token list (an ack line per
    # message is what msg.ack() and nc users send); anything else, errors included, takes settle's way
    parts = args.split(b" ")  # one call by name (a find is another, and parses its arguments the old way)
    if len(parts) == 2 and parts[0] and parts[1] and parts[1][0] != DASH:
        consumer = session.consumers_by_id.get(parts[0])
        if consumer is not None and session.process.broker.ack_one(consumer, parts[1]):
            if confirm:
                session.ok(rid)
            return
    settle(session, rid, args, confirm, "ack")


def handle_reject(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    settle(session, rid, args, confirm, "reject")


def settle(session: Session, rid: bytes, args: bytes, confirm: bool, action: str) -> None:
    """`ack` or `reject` one, several or all un-acked messages of a consumer."""
    delay_seconds = None
    if action == "reject" and b"--delay" in args:
        head, _, flag = args.rpartition(b" ")
        value = parse_flag_value(flag, b"--delay")
        if value is not None:
            args = head
            delay_seconds = parse_seconds(value, "reject: --delay")
    consumer, msg_ids = parse_ack(session, action, args)
    broker = session.process.broker
    if delay_seconds:
        due_ms = math.ceil((time.time() + delay_seconds) * 1000)
        if unknown := broker.reject_later(consumer, msg_ids, due_ms):
            raise not_in_flight(action, unknown, consumer)
    elif msg_ids is None:
        (broker.ack_all if action == "ack" else broker.reject_all)(consumer)
    elif unknown := (broker.ack if action == "ack" else broker.reject)(consumer, msg_ids):
        raise not_in_flight(action, unknown, consumer)
    if confirm:
        session.ok(rid)


def not_in_flight(action: str, msg_ids: list[bytes], consumer: Consumer) -> ProtocolError:
    return ProtocolError(f"{action}: no un-acked message {text(b' '.join(msg_ids))!r} "
                         f"for consumer {text(consumer.consumer_id)!r}")


def handle_touch(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    """`touch {consumer_id} {msg_id} ...|--all` (extension): restart the ack-timeout clock of copies in flight."""
    consumer, msg_ids = parse_ack(session, "touch", args)
    broker = session.process.broker
    if msg_ids is None:
        msg_ids = list(consumer.seq_by_msg_id)
    if unknown := broker.touch(consumer, msg_ids):
        raise not_in_flight("touch", unknown, consumer)
    if confirm:
        session.ok(rid)


def handle_delete_consumer(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    tokens = args.split()
    if len(tokens) != 1:
        raise ProtocolError("delete_consumer: expected {consumer_id}")
    consumer = session.consumers_by_id.get(tokens[0])
    if consumer is None:
        raise ProtocolError(f"delete_consumer: unknown consumer {text(tokens[0])!r} on this connection")
    session.process.broker.remove_consumer(consumer)
    if confirm:
        session.ok(rid)


def handle_delete_queue(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    tokens = args.split()
    if len(tokens) != 1:
        raise ProtocolError("delete_queue: expected {queue}")
    name = check_name(tokens[0], "delete_queue: queue")
    session.process.broker.delete_queue(name)
    if confirm:
        session.ok(rid)


def handle_purge_queue(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    """`{id} purge_queue {queue}` -> `{id} ok {count}`: the messages waiting in it are gone (extension)."""
    tokens = args.split()
    if len(tokens) != 1:
        raise ProtocolError(PURGE_USAGE)
    name = check_name(tokens[0], "purge_queue: queue")
    session.ok(rid, b"%d" % session.process.broker.purge_queue(name))


def handle_requeue_dead(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    """`{id} requeue_dead {queue} [--limit=N | {msg_id}...]` -> `{id} ok {count}`: dead letters waiting in
    `{queue}.dead` go back to `{queue}`, retry counters at 0 (extension)."""
    tokens = args.split()
    if not tokens:
        raise ProtocolError(REQUEUE_DEAD_USAGE)
    name = check_name(tokens[0], "requeue_dead: queue")
    limit: int | None = None
    msg_ids: set[bytes] | None = None
    for token in tokens[1:]:
        if (value := parse_flag_value(token, b"--limit")) is not None:
            limit = parse_count(value, "--limit")
        elif token.startswith(b"--"):
            raise ProtocolError(f"requeue_dead: unexpected {text(token)!r}; {REQUEUE_DEAD_USAGE[14:]}")
        else:
            msg_ids = msg_ids or set()
            msg_ids.add(token)
    if limit is not None and msg_ids is not None:
        raise ProtocolError(f"requeue_dead: --limit or message ids, not both; {REQUEUE_DEAD_USAGE[14:]}")
    session.ok(rid, b"%d" % session.process.broker.requeue_dead(name, limit, msg_ids))


def handle_ping(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    session.ok(rid, args)


def handle_eval(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    """`_eval [--worker=N | --owner=Q] {expression}` with `state` (this worker's broker) and `process` in scope;
    with worker processes the relay has brought the line to worker N or to queue Q's owner."""
    process = session.process
    first, _, code = args.partition(b" ")
    if (value := parse_flag_value(first, b"--worker")) is not None:
        worker = parse_count(value, "--worker")
        if worker >= process.worker_count:
            count = process.worker_count
            raise ProtocolError(f"_eval: no worker {worker}: this server has {count} (0..{count - 1})")
    elif parse_flag_value(first, b"--owner") is None:
        code = args
    if not code.strip():
        raise ProtocolError("_eval: expected a Python expression")
    namespace = {"state": process.broker, "process": process}
    try:
        # remote code execution on purpose: the dispatcher lets only --eval servers' loopback peers here
        result = eval(code.decode(), namespace)
    except Exception as e:
        raise ProtocolError(f"_eval: {type(e).__name__}: {e}") from None
    session.ok(rid, repr(result).replace("\n", "\\n").encode())


def parse_worker(value: bytes, action: str, count: int) -> int:
    """`--worker=N` -> N, which must name a worker of this server."""
    try:
        worker = int(value)
    except ValueError:
        worker = -1
    if not 0 <= worker < count:
        raise ProtocolError(f"{action}: no worker {text(value)!r}: this server has {count} (0..{count - 1})")
    return worker


def to_json(value: object) -> bytes:
    """One compact JSON line (ASCII: a name never brings a newline or a tab into the answer)."""
    return json.dumps(value, separators=(",", ":")).encode()


def handle_stats(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    """`{id} stats [--worker=N]` -> `{id} ok {json}`: every worker's figures summed, or worker N's."""
    process = session.process
    worker = parse_stats_args(args, process.worker_count)
    figures = process.stats()
    if worker is not None:
        figures["worker"] = worker
    session.ok(rid, to_json(figures))


def parse_stats_args(args: bytes, count: int) -> int | None:
    """`[--worker=N]` of `stats` -> N (checked against `count` workers), or None for all."""
    worker = None
    for token in args.split():
        value = parse_flag_value(token, b"--worker")
        if value is None or worker is not None:
            raise ProtocolError(f"stats: unexpected {text(token)!r}; expected {{id}} stats [--worker=N]")
        worker = parse_worker(value, "stats", count)
    return worker


def handle_queues(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    """`{id} queues [--detail] [{mask}]` -> `{id} ok {json}` per queue, sorted by name, then `{id} ok --end`.

    `--detail` (ext) adds each queue's bindings, consumers and newest messages (process.queue_detail).
    """
    tokens = args.split()
    detail = bool(tokens) and tokens[0] == b"--detail"
    if detail:
        tokens = tokens[1:]
    if len(tokens) > 1 or (tokens and tokens[0].startswith(b"--")):
        raise ProtocolError(f"queues: unexpected {text(args)!r}; expected {{id}} queues [--detail] [{{mask}}]")
    rows = session.process.queue_rows(tokens[0] if tokens else None, detail)
    session.write(format_rows(rid, [to_json(row) for row in rows]))  # one write: the unread-output limit sees it whole


PROTOCOL_VERSION = 1  # the spec's line protocol; extensions are named in EXTENSIONS, never implied by it
# what `hello` says this server supports beyond the spec: one name per feature, added with the feature
EXTENSIONS: tuple[str, ...] = ("masks", "prefetch", "seq", "confirm", "rebind", "stats", "queues", "durable",
                               "workers", "ack_timeout", "touch", "dead_letters", "max_length", "delay", "schedules",
                               "request_reply", "max_memory", "auth", "tls", "hello", "ttl", "drain", "leases")
MAX_UNAUTHENTICATED_LINES = 3  # then the connection is closed: no guessing tokens at line rate
AUTH_REQUIRED = "authentication required: send {id} auth {token} first"


def handle_hello(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    """`{id} hello [--ttl=S]` -> `{id} ok {json}`: version, protocol, extensions, workers, the TTL in force."""
    tokens = args.split()
    value = parse_flag_value(tokens[0], b"--ttl") if len(tokens) == 1 else None
    if tokens and value is None:
        raise ProtocolError(f"hello: unexpected {text(args)!r}; expected {{id}} hello [--ttl=S]")
    if value is not None:
        session.set_ttl(parse_seconds(value, "--ttl") or None)  # --ttl=0: no limit
    session.said_hello = True
    process = session.process
    extensions = [*EXTENSIONS, "confirm_quiet"] if quiet_confirms_offered(process) else list(EXTENSIONS)
    session.ok(rid, to_json({"version": VERSION, "protocol": PROTOCOL_VERSION, "extensions": extensions,
                             "ttl": session.ttl_seconds, "tls": session.tls, "authenticated": session.authenticated,
                             **process.topology()}))


def handle_auth(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    """`{id} auth {token}`: the line is never logged (errors are logged with `auth ***` in its place)."""
    redacted = rid + b" auth ***"
    found = session.authenticate(args.strip())
    if found is None:
        session.error(rid, "auth: this server takes no token (start mqksd with --auth-token-file or "
                           "MQKS_AUTH_TOKEN to require one)", redacted)
    elif found:
        session.ok(rid)
    else:
        session.unauthenticated_lines += 1
        session.error(rid, "authentication failed", redacted)
        if session.unauthenticated_lines >= MAX_UNAUTHENTICATED_LINES:
            log.warning("closing %s: %d failed or missing authentications", session.peer,
                        session.unauthenticated_lines)
            session.close(flush_first=True)


FETCH_USAGE = ("fetch: expected {id} fetch {queue} --lease={lease_id} [--max=N] [--max-bytes=B] "
               "[--lease-seconds=S] [--add] [--runs]")
SETTLE_LEASE_USAGE = "settle: expected {id} settle {lease_id} ... --ack|--release"
FETCH_MAX_COUNT = 1_000_000
DEFAULT_FETCH_BYTES = 1 << 20
DEFAULT_LEASE_SECONDS = 60.0


def handle_fetch(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    """`{id} fetch {queue} --lease=L ...` -> `{id} ok {msg_id} event=E[,retry=n],seq=S {data}` per message,
    then `{id} ok --end {count}`. The messages stay held under lease L until `settle` or expiry."""
    tokens = args.split()
    if not tokens:
        raise ProtocolError(FETCH_USAGE)
    name = check_name(tokens[0], "fetch: queue")
    lease_id = b""
    max_count, max_bytes, seconds, add, runs = 1, DEFAULT_FETCH_BYTES, DEFAULT_LEASE_SECONDS, False, False
    for token in tokens[1:]:
        if (value := parse_flag_value(token, b"--lease")) is not None:
            lease_id = value
        elif (value := parse_flag_value(token, b"--max")) is not None:
            max_count = parse_count(value, "--max")
        elif (value := parse_flag_value(token, b"--max-bytes")) is not None:
            max_bytes = parse_count(value, "--max-bytes")
        elif (value := parse_flag_value(token, b"--lease-seconds")) is not None:
            seconds = parse_seconds(value, "--lease-seconds")
        elif token == b"--add":
            add = True
        elif token == b"--runs":  # the never-delivered messages in blocks, as stored (leases.take_blocks)
            runs = True
        else:
            raise ProtocolError(f"fetch: unexpected {text(token)!r}; {FETCH_USAGE[7:]}")
    if not lease_id:
        raise ProtocolError(f"fetch: --lease={{lease_id}} is required; {FETCH_USAGE[7:]}")
    if not 1 <= max_count <= FETCH_MAX_COUNT:
        raise ProtocolError(f"fetch: --max wants 1..{FETCH_MAX_COUNT}, got {max_count}")
    if max_bytes < 1:
        raise ProtocolError("fetch: --max-bytes wants a number >= 1")
    if seconds <= 0:
        raise ProtocolError("fetch: --lease-seconds wants seconds > 0")
    # one answer never passes the point where deliveries to this client pause: it must fit the
    # limit on unread output with room to spare
    max_bytes = min(max_bytes, session.outbox.high_water_bytes)
    broker = session.process.broker
    lines, count = broker.leases.fetch(name, lease_id, max_count, max_bytes, seconds, add, rid, runs)
    lines.append(b"%b ok --end %d\n" % (rid, count))
    session.write(b"".join(lines))


def handle_settle(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    """`{id} settle {lease_id} ... --ack|--release` -> `{id} ok {count}`: the messages those leases held."""
    tokens = args.split()
    ack = release = False
    lease_ids = []
    for token in tokens:
        if token == b"--ack":
            ack = True
        elif token == b"--release":
            release = True
        elif token.startswith(b"--"):
            raise ProtocolError(f"settle: unknown flag {text(token)!r}; {SETTLE_LEASE_USAGE[8:]}")
        else:
            lease_ids.append(token)
    if ack == release or not lease_ids:
        raise ProtocolError(SETTLE_LEASE_USAGE)
    count = 0
    # a lease lives in its queue's worker; its id does not name the queue, so every worker is asked (relay.py)
    settle_lease = session.process.broker.leases.settle
    for lease_id in lease_ids:
        count += settle_lease(lease_id, ack)
    session.ok(rid, b"%d" % count)


class Placement(Enum):
    """Where a line runs when the broker is several worker processes (relay.py wraps the handler by it)."""

    HERE = "here"  # the worker the client is connected to (publish routes on from there)
    QUEUE_OWNER = "queue owner"  # the owner of the queue its first argument names
    QUEUE_OWNER_NEW_CONSUMER = "queue owner, making a consumer"  # and a stub here stands for the consumer it makes
    DEAD_QUEUE_OWNER = "dead-letter queue owner"  # the owner of `{queue}.dead`, its first argument naming {queue}
    CONSUMER_OWNER = "consumer owner"  # the owner of the queue of the consumer its first argument names
    CONSUMER_OWNER_ENDING = "consumer owner, ending it"  # and the consumer's stub here goes at once
    SCHEDULE_OWNER = "schedule owner"  # the owner of the schedule its first argument names
    TOKEN_ISSUER = "token issuer"  # the worker that issued the reply token
    EVERY_WORKER_STATS = "every worker, figures summed"
    EVERY_WORKER_ROWS_BY_QUEUE = "every worker, rows sorted by queue"
    EVERY_WORKER_ROWS_BY_NAME = "every worker, rows sorted by name"
    EVERY_WORKER_SUM = "every worker, counts added"
    CHOSEN_WORKER = "the worker --worker=N or --owner=Q names"
    AFTER_OTHER_WORKERS = "here, once the other workers ran what this session sent them"


class ScopeCheck(Enum):
    """What a scoped token (`--auth-token-file`) needs to run an action; dispatch/scopes.py checks it, in one place.

    Every action declares one: an action that forgot would otherwise be open to every scoped token.
    """

    ANY = "any token"  # no name of the token's to check (its consumer, lease or reply token, or no argument)
    PUBLISH = "the event it publishes"  # checked by the session's publisher (ScopedPublisher), as it publishes
    SCHEDULE = "the event its schedule publishes"  # checked when the schedule is set: it publishes later, unscoped
    READ_QUEUE = "the queue its first argument names"  # matched against the token's `consume` patterns
    MANAGE = "manage = true"  # deletes, purges or requeues what other tokens may read
    FULL_ACCESS_ONLY = "a full-access token"  # _eval: a Python prompt in the broker is every right at once


@dataclass(frozen=True, slots=True)
class Action:
    """An action as the dispatcher sees it."""

    handler: Handler
    missing_args: str  # the error for a line with no {data}, when the action needs some
    scope: ScopeCheck  # no default: an Action that does not say is refused (TypeError) when ACTIONS is built
    needs_args: bool = True
    protected: bool = False  # only with `mqksd --eval`, and only for loopback peers
    needs_auth: bool = True  # refused before `auth` on a server that wants a token
    placement: Placement = Placement.HERE


SETTLE_USAGE = "expected {consumer_id} {msg_id}|--all"
PURGE_USAGE = "purge_queue: expected {id} purge_queue {queue}"
REQUEUE_DEAD_USAGE = "requeue_dead: expected {id} requeue_dead {queue} [--limit=N | {msg_id}...]"

P, S = Placement, ScopeCheck
ACTIONS: dict[bytes, Action] = {
    b"publish": Action(handle_publish, "publish: event expected", scope=S.PUBLISH),
    b"consume": Action(handle_consume, CONSUME_MISSING, scope=S.READ_QUEUE, placement=P.QUEUE_OWNER_NEW_CONSUMER),
    b"ack": Action(handle_ack, "ack: " + SETTLE_USAGE, scope=S.ANY, placement=P.CONSUMER_OWNER),
    b"reject": Action(handle_reject, "reject: " + SETTLE_USAGE, scope=S.ANY, placement=P.CONSUMER_OWNER),
    b"touch": Action(handle_touch, "touch: " + SETTLE_USAGE, scope=S.ANY, placement=P.CONSUMER_OWNER),
    b"rebind": Action(handle_rebind, REBIND_MISSING, scope=S.READ_QUEUE, placement=P.QUEUE_OWNER),
    b"delete_consumer": Action(handle_delete_consumer, "delete_consumer: expected {consumer_id}", scope=S.ANY,
                               placement=P.CONSUMER_OWNER_ENDING),
    b"delete_queue": Action(handle_delete_queue, "delete_queue: expected {queue}", scope=S.MANAGE,
                            placement=P.QUEUE_OWNER),
    b"purge_queue": Action(handle_purge_queue, PURGE_USAGE, scope=S.MANAGE, placement=P.QUEUE_OWNER),
    b"requeue_dead": Action(handle_requeue_dead, REQUEUE_DEAD_USAGE, scope=S.MANAGE, placement=P.DEAD_QUEUE_OWNER),
    b"request": Action(handle_request, "request: event expected: {id} request [--timeout=S] {event} {data}",
                       scope=S.PUBLISH),
    b"reply": Action(handle_reply, "reply: expected {id} reply {token} {data}", scope=S.ANY,
                     placement=P.TOKEN_ISSUER),
    b"schedule": Action(handle_schedule, "schedule: name expected: " + SCHEDULE_USAGE, scope=S.SCHEDULE,
                        placement=P.SCHEDULE_OWNER),
    b"unschedule": Action(handle_unschedule, "unschedule: expected {id} unschedule {name}", scope=S.MANAGE,
                          placement=P.SCHEDULE_OWNER),
    b"schedules": Action(handle_schedules, "", scope=S.ANY, needs_args=False, placement=P.EVERY_WORKER_ROWS_BY_NAME),
    b"ping": Action(handle_ping, "", scope=S.ANY, needs_args=False, needs_auth=False,
                    placement=P.AFTER_OTHER_WORKERS),
    b"sync": Action(handle_sync, "", scope=S.ANY, needs_args=False, placement=P.AFTER_OTHER_WORKERS),
    b"stats": Action(handle_stats, "", scope=S.ANY, needs_args=False, placement=P.EVERY_WORKER_STATS),
    b"queues": Action(handle_queues, "", scope=S.ANY, needs_args=False, placement=P.EVERY_WORKER_ROWS_BY_QUEUE),
    b"auth": Action(handle_auth, "auth: expected {id} auth {token}", scope=S.ANY, needs_auth=False),
    b"hello": Action(handle_hello, "", scope=S.ANY, needs_args=False),
    b"fetch": Action(handle_fetch, FETCH_USAGE, scope=S.READ_QUEUE, placement=P.QUEUE_OWNER),
    b"settle": Action(handle_settle, SETTLE_LEASE_USAGE, scope=S.ANY, placement=P.EVERY_WORKER_SUM),
    b"_eval": Action(handle_eval, "_eval: expected a Python expression", scope=S.FULL_ACCESS_ONLY, protected=True,
                     placement=P.CHOSEN_WORKER),
}


def refuse_publish_over_memory(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    """`publish` past --max-memory: a confirmed one (quiet too) gets an error, an unconfirmed one is dropped and
    counted."""
    if confirm or args.startswith(CONFIRM_QUIET):
        raise ProtocolError(memory_reason(session))
    session.process.dropped_by_memory += 1


def refuse_request_over_memory(session: Session, rid: bytes, args: bytes, confirm: bool) -> None:
    raise ProtocolError(memory_reason(session))


def memory_reason(session: Session) -> str:
    return session.process.memory_reason()


OVER_MEMORY: dict[bytes, Handler] = {b"publish": refuse_publish_over_memory, b"request": refuse_request_over_memory}

_TABLES: dict[bool, dict[bytes, Action]] = {
    allowed: {name: action for name, action in ACTIONS.items() if allowed or not action.protected}
    for allowed in (False, True)
}
# before `auth`, on a server that wants a token: the few actions that need none
_BEFORE_AUTH: dict[bytes, Action] = {name: action for name, action in ACTIONS.items() if not action.needs_auth}


def actions_for(eval_enabled: bool, peer_is_loopback: bool, authenticated: bool = True) -> dict[bytes, Action]:
    """The actions a session may run, built once from the declarations (no per-line check)."""
    return _TABLES[eval_enabled and peer_is_loopback] if authenticated else _BEFORE_AUTH


Placer: TypeAlias = Callable[[bytes, Action, Handler], Handler]


class HandlerTables:
    """The handler tables a process's sessions run lines against, built once from ACTIONS.

    `place` (relay.place, in a worker of several) wraps each handler by its action's placement.
    A line another worker forwarded runs here and never further: `for_forwarded` is never wrapped.
    """

    def __init__(self, place: Placer | None = None) -> None:
        self.local: dict[tuple[bool, bool], dict[bytes, Handler]] = {
            (allowed, over_memory): {name: OVER_MEMORY.get(name, action.handler) if over_memory else action.handler
                                     for name, action in table.items()}
            for allowed, table in _TABLES.items() for over_memory in (False, True)
        }
        self.served = self.local if place is None else {
            key: {name: place(name, ACTIONS[name], handler) for name, handler in table.items()}
            for key, table in self.local.items()
        }
        self.before_auth = {name: action.handler for name, action in _BEFORE_AUTH.items()}  # run here

    def for_session(self, eval_enabled: bool, peer_is_loopback: bool, authenticated: bool = True,
                    over_memory: bool = False, scope: Any = None) -> dict[bytes, Handler]:
        """`actions_for` as name -> handler: one attribute load less per line (measured: ~2%).

        `over_memory`: the table for a broker past --max-memory, whose publishes are refused. Before
        `auth` the table holds no publish, so the memory state does not change it. `scope`: a scoped token's
        session runs the table with its checks (dispatch/scopes.py); a full-access one the plain table.
        """
        if not authenticated:
            return self.before_auth
        table = self.served[eval_enabled and peer_is_loopback, over_memory]
        return table if scope is None else scope.table(table)

    def for_forwarded(self, over_memory: bool = False) -> dict[bytes, Handler]:
        """The table for lines another worker's client sent (that worker checked what it may run)."""
        return self.local[True, over_memory]


ONE_PROCESS = HandlerTables()
handlers_for = ONE_PROCESS.for_session


def run_lines(session: Session, lines: list[bytes | None], rejected: deque[tuple[bytes, str]]) -> None:
    """Run complete lines in order; a bad line costs only its own error answer.

    A `None` in `lines` is a line the splitter refused; its (rid, reason) waits in `rejected`.
    """
    handlers = session.handlers
    # looked up once a batch: most lines are publishes or acks, called directly when compiled (neither holds)
    publish, ack = handle_publish, handle_ack
    # with worker processes, a Held keeps what is left of it for later. Typed: the compiled build indexes the split
    # line's list and tests bytes natively (an untyped line made every one of those a generic call)
    remaining = iter(lines)
    for line in remaining:
        if not line:
            if line is None:
                rid, reason = rejected.popleft()
                session.error(rid, reason, b"")
            continue  # an empty line is ignored
        # `{rid} {action} {data}`, split inline: a helper call per line costs measurably here, and so did two
        # partitions (two calls, and a copy of the whole line after the rid)
        parts = line.split(b" ", 2)
        rid = parts[0]
        count = len(parts)
        action_name = parts[1] if count > 1 else b""
        args = parts[2] if count > 2 else b""
        handler = handlers.get(action_name)
        if handler is None or not rid:
            if handlers is not session.handlers:  # an `auth` earlier in this batch opened the full table
                handlers = session.handlers
                handler = handlers.get(action_name)
            if handler is None or not rid:
                refuse(session, rid, action_name, line)
                if session.closed:
                    return  # nothing after an HTTP header (or past the unauthenticated limit) may run
                continue
        confirm = False
        if args and args[0] == DASH and args.startswith(CONFIRM) and (len(args) == 9 or args[9] == SPACE):
            confirm = True
            args = args[10:]
        try:
            if not args and (action := session.actions[action_name]).needs_args:
                raise ProtocolError(action.missing_args)
            if handler is publish:
                handle_publish(session, rid, args, confirm)
            elif handler is ack:
                handle_ack(session, rid, args, confirm)
            elif (held := handler(session, rid, args, confirm)) is not None:
                relay = session.relay
                assert relay is not None, "only a relayed handler holds"
                relay.hold(line, remaining, held)
                return
        except ProtocolError as e:
            session.error(rid, str(e), line)
        except Exception:
            log.exception("internal error on line %r", line[:200])
            session.error(rid, "internal error", line)


def refuse(session: Session, rid: bytes, action_name: bytes, line: bytes) -> None:
    """Answer a line whose action this session may not run: unknown, protected, or HTTP."""
    if looks_like_http(line):
        # a browser page must not be able to speak MQKS to a broker on localhost
        log.warning("closing %s: its line looks like HTTP: %r", session.peer, line[:80])
        session.close()
    elif not session.authenticated:
        # any word of the line may be a token sent the wrong way (`s3cret` alone at nc): none is logged
        session.unauthenticated_lines += 1
        session.error(rid if rid and action_name else b"-", AUTH_REQUIRED, b"(not logged before auth)")
        if session.unauthenticated_lines >= MAX_UNAUTHENTICATED_LINES:
            log.warning("closing %s: %d failed or missing authentications", session.peer,
                        session.unauthenticated_lines)
            session.close(flush_first=True)
    elif rid == b"help" and not action_name:
        session.error(b"-", unknown_action(session, b"help"), line)  # a person at `nc` asking
    elif not rid or not action_name:  # a lone word is its id: the answer goes where the client looks
        session.error(rid or b"-", f"expected {{request_id}} {{action}} {{data}}; actions: {action_names(session)}",
                      line)
    elif (action := ACTIONS.get(action_name)) is not None and action.protected:
        if session.eval_refusal is not None:
            session.error(rid, session.eval_refusal, line)
            return
        reason = ("answers loopback clients only" if session.eval_enabled
                  else "is disabled: start mqksd with --eval to enable it (loopback clients only)")
        session.error(rid, f"{action_name.decode()} {reason}", line)
    else:
        session.error(rid, unknown_action(session, action_name), line)


def action_names(session: Session) -> str:
    """The actions this session may run: a protected one is listed only where it is allowed."""
    return " ".join(name.decode() for name in session.actions)


def unknown_action(session: Session, action_name: bytes) -> str:
    return f'unknown action "{text(action_name)}"; actions: {action_names(session)}'


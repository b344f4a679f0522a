"""Publishes that cross workers: the Forwarder sends a client's publish to the workers that own a bound queue, a
confirmed one is answered once every part has answered (FanIn), and dead letters move to the worker that owns their
`.dead` queue (DeadLetterTransfer).

Nothing crosses one message at a time: a publish is appended to the link's run of `P` lines, and the link writes
its runs as frames when the batch is flushed (frames.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from ..core import dead_letters
from ..core.state import Broker, Queue
from ..wire.outbox import Outbox
from ..wire.protocol import format_ok, msg_id_of
from .frames import NEWLINE, Frame

if TYPE_CHECKING:
    from ..dispatch.actions import Session
    from ..dispatch.process import Process
    from .peers import Peers
    from .relay import RelaySession

# per message: a plain int, since an IntEnum member's lookup costs ~190 ns on Python 3.11
PUBLISH_KIND = Frame.PUBLISH.value
SESSION_LINES_KIND = Frame.SESSION_LINES.value


class ConfirmTarget(Protocol):
    """What a `c` line answers, under the id the asker gave its `C` line: a FanIn or a DeadLetterTransfer."""

    owners: tuple[int, ...]  # the workers whose answer it waits for
    parts: int  # answers still owed; 0 once it is answered

    @property
    def outbox(self) -> Outbox | None: ...  # the client it answers, if any

    def write(self, line: bytes) -> None: ...

    def link_lost(self, worker: int, process: Process) -> None: ...


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
            self.answer()

    def answer(self) -> None:
        self.outbox.write(b"%b %b\n" % (self.rid, self.error) if self.error is not None else format_ok(self.rid))

    def link_lost(self, worker: int, process: Process) -> None:
        """`worker` went before it answered: the client hears that its copy may not be there."""
        self.parts = 1
        self.write(process.error_line(self.rid, f"worker {worker} stopped before it had the message"))


class QuietFanIn(FanIn):
    """A quiet publish's FanIn (actions.publish_quiet): its client hears only a refusal, and its session's next
    sync waits until every part has answered (RelaySession.quiet_fanins)."""

    __slots__ = ("relay",)

    def __init__(self, relay: RelaySession, outbox: Outbox, rid: bytes, parts: int, owners: Iterable[int]) -> None:
        super().__init__(outbox, rid, parts, owners)
        self.relay = relay
        relay.quiet_fanins += 1

    def answer(self) -> None:
        if self.error is not None:
            self.outbox.write(b"%b %b\n" % (self.rid, self.error))
        self.relay.quiet_answered()


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
        owners = self.cache.get(event)
        return bool(owners if owners is not None else self.replica.owners(event))

    def full_queues(self, event: bytes) -> list[Queue]:
        return self.local.full_queues(event)  # other owners answer for theirs (links.IncomingLink.on_confirmed)

    def permits(self, event: bytes) -> bool:
        return True  # a scoped session's publisher (dispatch/scopes.py) is the one that refuses

    def publish_confirmed(self, session: Session, rid: bytes, event: bytes, tail: bytes) -> None:
        """A confirmed publish some of whose queues are elsewhere: one answer once every owner has it."""
        owners = self.cache.get(event)
        if owners is None:
            owners = self.replica.owners(event)
        local = self.local
        local_part = bool(local.routes(event))
        only = self.links[owners[0]] if len(owners) == 1 and not local_part else None
        if only is not None:
            # one owner has every bound queue: it runs the line in this client's session and answers
            # there, after the deliveries the publish caused, exactly as one worker would
            relay = session.relay
            assert relay is not None
            line = b"%b publish --confirm %b" % (rid, tail[len(rid) + 11 :])
            if only.run_kind == SESSION_LINES_KIND and only.run_key == relay.key:
                # this session's run is open on the link: its send put the owner among `remote` and `unsynced`,
                # and a sync mark would have closed the run (nearly every forwarded line of a pipelined client;
                # with the cache read here and in routes_elsewhere: 560 -> 320 ns a line, timed over stub links)
                only.run.append(line)
            else:
                relay.send(owners[0], line, answer_first=False)
            return
        self.fan_out(FanIn(session.outbox, rid, len(owners) + 1, owners), rid, event, tail, local_part)

    def publish_quiet(self, session: Session, rid: bytes, event: bytes, tail: bytes) -> None:
        """A quiet publish (actions.publish_quiet) some of whose queues are elsewhere: each owner answers only a
        refusal. To one owner it goes as the session's line, whose sync mark that owner answers after its log has
        the line's copies (links.IncomingLink.mark); to several, as a QuietFanIn the sync waits for."""
        owners = self.cache.get(event)
        if owners is None:
            owners = self.replica.owners(event)
        relay = session.relay
        assert relay is not None
        local_part = bool(self.local.routes(event))
        if len(owners) == 1 and not local_part:
            only = self.links[owners[0]]
            line = b"%b publish --confirm-quiet %b" % (rid, tail[len(rid) + 11 :])
            if only is not None and only.run_kind == SESSION_LINES_KIND and only.run_key == relay.key:
                only.run.append(line)  # as publish_confirmed's: the owner is among `remote` and `unsynced`
            else:
                relay.send(owners[0], line, answer_first=False)  # raises "try again" if the owner is restarting
            return
        self.fan_out(QuietFanIn(relay, session.outbox, rid, len(owners) + 1, owners), rid, event, tail, local_part)

    def fan_out(self, fanin: FanIn, rid: bytes, event: bytes, tail: bytes, local_part: bool) -> None:
        """A confirmed publish's copies to each owner, and its local part: `fanin` answers once all have."""
        owners = fanin.owners
        local = self.local
        process = self.peers.process
        msg_id = msg_id_of(tail)
        fanin_id = b"%d" % next(self.next_fanin)
        self.fanins[fanin_id] = fanin
        for owner in owners:
            link = self.links[owner]
            if link is None:
                fanin.write(process.error_line(rid, f"{self.peers.unreachable(owner, 'a bound queue')}: the "
                                                    "message was not put there"))
            else:
                link.add(Frame.PUBLISH_CONFIRMED, b"-", b"%b %b%b" % (fanin_id, event, tail))
        if local_part:  # the fan-in answers for this worker's part as the client's outbox would
            refusal = process.publish_confirmed_here(local, fanin, rid, msg_id, event, tail)
            if refusal is not None:
                fanin.write(process.error_line(rid, refusal))
        else:
            local.publish(msg_id, event, tail)
            local.unrouted -= 1  # counted unrouted here, and routed to other workers
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
    A ConfirmTarget as a fan-in is, so the link routes the owner's `ok` to it.
    """

    __slots__ = ("peers", "rid", "owner", "owners", "parts", "records", "source", "queue", "taken")

    outbox = None  # no client waits on it

    def __init__(self, peers: Peers, key: bytes, owner: int, records: list[bytes], source: Broker, queue: Queue,
                 taken: list[tuple[int, Any]]) -> None:
        self.peers = peers
        self.rid = key
        self.owner = owner
        self.owners: tuple[int, ...] = (owner,)
        self.parts = 1
        self.records = records
        self.source = source
        self.queue = queue
        self.taken = taken

    def write(self, line: bytes) -> None:
        """The owner's answer: `ok` once its log has them (it has no other)."""
        self.parts = 0
        dead_letters.moved(self.source, self.queue, self.taken)

    def link_lost(self, worker: int, process: Process) -> None:
        """The owner went before it answered: again once it is back."""
        self.peers.dead_waiting.setdefault(self.owner, []).append(self)

"""Worker processes (`mqksd --workers N`, N >= 2): this worker's view of the others.

Each worker owns the queues of its slots (server/dispatch/slots.py) and accepts clients like any other. A line
about a queue another worker owns is forwarded to that owner (relay.py); every worker keeps a replica of every
other worker's bindings (replica.py), so a publish goes only to the owners of bound queues (forwarding.py). Nothing
crosses one message at a time: what a batch of lines owes a peer is gathered in runs and written as frames once,
when the batch is flushed (links.py, frames.py).

`Peers` holds the links, the answer targets (a client's RelaySession, a gather, an ask_all, a hold on output: each
an AnswerTarget, named by the key its `>` and `.` frames carry), the confirmed publishes awaiting answers, and the
barrier that holds client output until every worker has applied this worker's binding changes.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, Protocol

import gevent
import gevent.socket
from gevent.event import Event

from ...common.figures import merge_stats
from ..core.state import Queue
from ..dispatch.slots import owner_of
from ..wire.outbox import Outbox
from ..wire.protocol import ok_body
from .bindings_trust import KEEPALIVES_PER_TRUST, Promises, Trusts
from .forwarding import ConfirmTarget, DeadLetterTransfer, Forwarder, RemoteDeadLetters
from .frames import NEWLINE, Frame
from .links import RELAY_WINDOW_BYTES, IncomingLink, PeerLink
from .replica import Replica

if TYPE_CHECKING:
    from ..dispatch.process import Process

__all__ = ["RELAY_WINDOW_BYTES", "AnswerTarget", "Peers"]

log = logging.getLogger("mqks.peers")

CONNECT_RETRY_SECONDS = 0.05
ASK_SECONDS = 2.0  # a /metrics scrape waits this long at most for the other workers' figures


class AnswerTarget(Protocol):
    """What the `>` and `.` frames under a key reach: relay.py's RelaySession (a client's session on the others) and
    Gather (a line every worker answers), and here ask_all's Waiter and a HoldRelease."""

    def take(self, payload: bytes, worker: int) -> None: ...  # `>`: output of `worker` for it

    def done(self) -> None: ...  # `.`: a worker has run everything sent to it before the mark


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


class KeepaliveAnswer:
    """The answer to a link's keepalive mark: the owner had read everything sent before `sent_at` (bindings_trust)."""

    __slots__ = ("peers", "key", "link", "sent_at")

    def __init__(self, peers: Peers, key: bytes, link: PeerLink, sent_at: float) -> None:
        self.peers = peers
        self.key = key
        self.link = link
        self.sent_at = sent_at

    def take(self, payload: bytes, worker: int) -> None:
        """A mark's session has no output."""

    def done(self) -> None:
        self.peers.targets.pop(self.key, None)
        self.link.answered_at = max(self.link.answered_at, self.sent_at)


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
        # other workers with no link from here: while one's bindings are unknown here, a confirmed publish cannot
        # promise it reached every bound queue (actions.publish_confirmed refuses it; see routing_unknown)
        self.unlinked = count - 1
        # a cluster's group: the epoch of the owner that sent the bindings the replica holds, and the epoch the map
        # names now (None: not a cluster, where a lost link's bindings are never trusted)
        self.bindings_epoch: list[Any] = [None] * count
        self.owner_epoch: Callable[[int], Any] = lambda worker: None
        # ... and for how long, across a lost link (bindings_trust.py; a cluster's group sets the seconds)
        self.trusts = Trusts(count)
        self.promises = Promises(lambda worker: self.owner_epoch(worker))
        # how a link is opened: a Unix socket in run_dir here; a cluster's node dials the group's owner over TCP
        self.dial: Callable[[int], socket.socket] = self.dial_unix
        self.unit = "worker"  # what errors call a peer: "group" in a cluster, where a group's owner is on any node
        self.link_hello = b"- _link %d\n" % self.worker
        # each peer's latest link (ready or still waiting for its bindings) and the address it was opened to: a
        # cluster's owner may move
        self.dialled: dict[int, tuple[Any, PeerLink]] = {}
        self.dialling: dict[int, tuple[Any, gevent.Greenlet]] = {}  # a dial under way: its address, its greenlet
        self.address_of: Callable[[int], Any] = self.socket_path
        self.connect_retry_seconds = CONNECT_RETRY_SECONDS
        self.incoming: set[IncomingLink] = set()
        self.keepers: list[gevent.Greenlet] = []  # one per peer: dials it, and again whenever the link is lost
        self.targets: dict[bytes, AnswerTarget] = {}  # by the key its frames carry
        self.fanins: dict[bytes, ConfirmTarget] = {}  # by fan-in id: what a `c` line answers
        self.replica = Replica()
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
        # groups whose link went before they acked our latest binding change (a cluster's): output waits for them too
        self.unacked_losses: set[int] = set()
        self.barrier_timer: gevent.Greenlet | None = None
        self.dead_waiting: dict[int, list[DeadLetterTransfer]] = {}  # for a worker that is restarting
        local = process.broker
        local.bindings_changed = self.broadcast_bindings
        local.binding_refusal = self.binding_refusal
        local.broker_for = self.broker_for

    def holds_output(self) -> bool:
        """True while no client may see anything from this worker: a binding change made here is not applied by
        every other worker yet, or dead letters sent to one are not in its hands."""
        return self.acked_epoch != self.epoch or bool(self.holds)

    def answers_owed_to(self, outbox: Outbox) -> bool:
        """True while a confirmed publish of the client of `outbox` waits for another worker's answer."""
        return any(fanin.outbox is outbox for fanin in self.fanins.values())

    def unreachable(self, owner: int, what: str = "") -> str:
        """Why lines for `owner`'s queues cannot run now, in the words of this kind of broker: a worker restarts,
        a cluster's group fails over."""
        owns = f", which owns {what}," if what else ""
        if self.unit == "group":
            return f"group {owner}{owns} has no owner reachable from here (failing over)"
        return f"worker {owner}{owns} is restarting"

    def count_unlinked(self) -> None:
        """Counted again from the links at each change, never stepped: a stepped count can leave the links (a link
        made twice, or replaced before the old one is lost), and once CI saw publishes refused for two minutes as
        "group  is not linked here", naming no group, while every link was there."""
        self.unlinked = sum(1 for worker, link in enumerate(self.links) if link is None and worker != self.worker)

    def unknown_bindings(self) -> list[int]:
        """The unlinked workers whose bindings are not known here. A cluster's group whose link was lost is routed to by
        the bindings its owner last sent while the map still names that owner (its part of a publish fails, and the
        client tries again): a cut-off node must not stop confirmed publishes to every queue of the cluster until its
        groups have new owners (issue 56), for a few leases at most (bindings_trust.py: its owner refuses new
        bindings that long). Once the map names a new owner, whose clients may bind queues before it links here, they
        are unknown until its own bindings come."""
        epochs, owner_epoch, trusts = self.bindings_epoch, self.owner_epoch, self.trusts
        unknown = []
        for worker, link in enumerate(self.links):
            if link is None and worker != self.worker:
                epoch = epochs[worker]
                if epoch is None or owner_epoch(worker) != epoch or trusts.expired(worker):
                    unknown.append(worker)
        return unknown

    def routing_unknown(self) -> bool:
        """True while a confirmed publish may miss a bound queue (called only while a link is missing)."""
        return bool(self.unknown_bindings())

    def forget_bindings(self, worker: int) -> None:
        """`worker` restarted, or a new link to it begins: what the replica had of its bindings is gone until its
        dump is in (linked)."""
        self.replica.forget(worker)
        self.bindings_epoch[worker] = None

    def unlinked_reason(self) -> str:
        missing = ", ".join(map(str, self.unknown_bindings()))
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
        self.fanins[transfer.rid] = transfer  # answered as a fan-in
        for record in transfer.records:
            link.add(Frame.DEAD_LETTERS, transfer.rid, record)
        self.hold_until_marked(link)  # no client hears of it (the reject's `ok`) before the owner has it

    def new_key(self, prefix: bytes = b"") -> bytes:
        return b"%b%d" % (prefix, next(self.next_key))

    # -- bindings ---------------------------------------------------------------------------------

    def binding_refusal(self) -> str | None:
        """Why an event may not be bound here now: a group without a link here may still route by what it had of
        this group's bindings (bindings_trust.py). None: bind."""
        if not self.promises.until:
            return None
        waiting = self.promises.waiting_for({link.worker for link in self.incoming if not link.closed})
        if not waiting:
            return None
        return (f"{self.unit} {', '.join(map(str, waiting))} may still route publishes by this {self.unit}'s "
                "bindings without a link here: a queue bound now could miss them; try again")

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
        if self.unacked_losses and not self.losses_settled():
            return
        self.acked_epoch = self.epoch
        marks, self.deferred_marks = self.deferred_marks, []
        for link, key in marks:
            if not link.closed:
                link.mark(key)
        self.process.flush_pending()

    def losses_settled(self) -> bool:
        """True once no group whose link went before it applied our latest change may still route by what it had
        (bindings_trust.py): it linked again, has a new owner, or its promise ran out; else the barrier looks again
        when the first promise ends."""
        live = {link.worker for link in self.incoming if not link.closed}
        self.unacked_losses.intersection_update(self.promises.waiting_for(live))
        if not self.unacked_losses:
            return True
        if self.barrier_timer is None:
            first_end = min(self.promises.until[worker][0] for worker in self.unacked_losses)
            self.barrier_timer = gevent.spawn_later(max(first_end - time.monotonic(), 0.05), self.check_barrier_later)
        return False

    def check_barrier_later(self) -> None:
        self.barrier_timer = None
        self.check_barrier()

    def incoming_lost(self, link: IncomingLink) -> None:
        """`link`'s worker left: it acks nothing more, so the others decide the barrier; but it may still route by
        the bindings it had (bindings_trust.py), so a change it never acked holds output until that ends."""
        self.incoming.discard(link)
        self.promises.link_lost(link.worker, link.marked_at)
        if link.acked < self.epoch and self.promises.seconds:
            self.unacked_losses.add(link.worker)
        self.check_barrier()

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
        # and a change of none, which it acks once the dump is applied: a change waiting on the barrier is released
        # only then (until its dump is in, a cluster's peer may still route by what it had of us)
        link.frame(Frame.BINDINGS, b"%d" % self.epoch)
        link.flush()
        link.serve(first_bytes)

    def connect_all(self, timeout: float, give_up: Callable[[], bool]) -> bool:
        """Open a link to every peer and wait for every peer's link here, until `timeout` or `give_up()`; True if all
        are up."""
        self.keepers = [gevent.spawn(self.keep_linked, worker) for worker in range(self.count) if worker != self.worker]
        deadline = gevent.get_hub().loop.now() + timeout
        # both ways: a worker that has not linked here yet would miss this one's binding changes (the barrier
        # waits only for the links that exist), and confirm publishes to queues it does not know are bound
        while (any(self.links[w] is None for w in range(self.count) if w != self.worker)
               or len({link.worker for link in self.incoming if not link.closed}) < self.count - 1):
            if gevent.get_hub().loop.now() > deadline or give_up():
                return False
            gevent.sleep(CONNECT_RETRY_SECONDS)
        return True

    def close(self) -> None:
        """Every link goes, and nothing dials again (a cluster node's process ends this group's server, not itself)."""
        for keeper in self.keepers:
            keeper.kill(block=False)
        for incoming in list(self.incoming):  # its reader sees the end and cleans up as for any lost link
            try:
                incoming.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def dial_unix(self, worker: int) -> socket.socket:
        sock = gevent.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.socket_path(worker))
        except OSError:
            sock.close()
            raise
        return sock

    def readdress(self, worker: int) -> None:
        """`worker`'s address changed (a cluster group's new owner): a link to the old one goes, and is made anew; a
        dial to the old one under way is given up (one to a host cut off would wait out its connect timeout, 5 s,
        before the new owner is dialled)."""
        new_address = self.address_of(worker)
        address, link = self.dialled.get(worker, (None, None))
        if link is not None and not link.closed and address != new_address:
            link.lost("its owner moved")
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        dialling = self.dialling.get(worker)
        if dialling is not None and dialling[0] != new_address:
            dialling[1].kill(block=False)

    def dial_or_error(self, worker: int) -> Any:
        """A socket to `worker`, or the OSError that stopped it (returned: a dial's greenlet never ends failed)."""
        try:
            return self.dial(worker)
        except OSError as e:
            return e

    def keep_linked(self, worker: int) -> None:
        """Connect to `worker`, and again whenever the link is lost (the peer restarts)."""
        while True:
            address = self.address_of(worker)
            epoch = self.owner_epoch(worker)  # the owner this address is of: its bindings come on the link
            dialled_at = time.monotonic()
            attempt = gevent.spawn(self.dial_or_error, worker)  # its own greenlet: readdress may give it up
            self.dialling[worker] = (address, attempt)
            try:
                dialled = attempt.get()
            finally:
                self.dialling.pop(worker, None)
                attempt.kill(block=False)  # this keeper was killed while it waited: the dial goes too
            if isinstance(dialled, gevent.GreenletExit):
                continue  # given up: the map names another owner, dialled now
            if isinstance(dialled, OSError):
                gevent.sleep(self.connect_retry_seconds)
                continue
            sock = dialled
            try:
                sock.sendall(self.link_hello)
            except OSError:
                sock.close()
                gevent.sleep(self.connect_retry_seconds)
                continue
            link = PeerLink(sock, self, worker)
            link.owner_epoch = epoch
            link.answered_at = dialled_at  # its bindings, when they come, answer the hello
            self.dialled[worker] = (address, link)
            writer = gevent.spawn(link.write_loop)
            keepalive = gevent.spawn(self.keep_alive, link) if self.trusts.seconds else None
            try:
                link.read_loop()
            except Exception:  # a bug in a frame's handling must not end the linking: the worker is out of reach
                log.exception("link to worker %d failed", worker)
                link.lost("its reader failed")
            finally:  # lost, or this group's server ended (close)
                writer.kill(block=False)
                if keepalive is not None:
                    keepalive.kill(block=False)
                sock.close()
            gevent.sleep(self.connect_retry_seconds)

    def keep_alive(self, link: PeerLink) -> None:
        """Mark the link now and then: each answer renews how long its owner's bindings are trusted once it is lost."""
        while not link.closed:
            gevent.sleep(self.trusts.seconds / KEEPALIVES_PER_TRUST)
            key = self.new_key(b"k")
            self.targets[key] = KeepaliveAnswer(self, key, link, time.monotonic())
            link.frame(Frame.MARK, key)
            self.process.flush_pending()

    def linked(self, link: PeerLink) -> None:
        """`link`'s peer has sent its bindings: lines for its queues, and publishes that may reach them, go now."""
        link.ready = True
        worker = link.worker
        self.links[worker] = link
        self.bindings_epoch[worker] = link.owner_epoch
        self.count_unlinked()
        log.info("linked to worker %d", worker)
        waiting = self.dead_waiting.pop(worker, [])
        for transfer in waiting:
            self.send_dead_letters(transfer)

    def link_lost(self, link: PeerLink, reason: str) -> None:
        if self.links[link.worker] is link:
            self.links[link.worker] = None
            self.trusts.link_lost(link.worker, link.answered_at)
            self.count_unlinked()
        log.warning("link to worker %d lost (%s): its clients here are closed; reconnecting", link.worker, reason)
        for fanin_id, fanin in list(self.fanins.items()):
            if link.worker in fanin.owners:
                del self.fanins[fanin_id]
                fanin.link_lost(link.worker, self.process)
        for key, target in list(self.targets.items()):
            if isinstance(target, HoldRelease) and target.link is link:
                target.done()  # that worker is gone: what it was sent is lost with it, and so is the wait
            elif isinstance(target, KeepaliveAnswer) and target.link is link:
                del self.targets[key]
        self.on_link_lost(link.worker)
        self.process.flush_pending()

    def ask_all(self, line: bytes, timeout: float = ASK_SECONDS, workers: Collection[int] | None = None) -> list[bytes]:
        """Run `line` on every other worker (or every other one of `workers`) and wait (this greenlet only) for their
        answers; a worker that is restarting, or silent past `timeout`, is left out."""
        key = self.new_key(b"g")
        links = [link for worker, link in enumerate(self.links) if link is not None and worker != self.worker
                 and (workers is None or worker in workers)]
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

    def cluster_stats(self, workers: Collection[int] | None = None) -> dict[str, Any]:
        """`stats` summed over every worker (or this one and `workers`), for a reader that is not a client
        (/metrics)."""
        return merge_stats(self.ask_all(b"m stats", workers=workers), self.process.stats(), self.distinct_events())

    def cluster_deepest_queues(self, limit: int, workers: Collection[int] | None = None
                               ) -> list[tuple[str, int, int, int]]:
        rows = list(self.process.deepest_queues(limit))
        for answer in self.ask_all(b"m queues", workers=workers):
            for line in answer.split(NEWLINE):
                body = ok_body(line)
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

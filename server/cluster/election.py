"""Who owns a group: a standby follows its stream, claims it after a lease of silence (or when handed it), and
takes it over by a conditional append; an owner hands it over when asked.

The stream decides, never a clock: a takeover appends epoch + 1 expecting the last sequence this node read,
so of two claims at once one is refused (it reads on and stands by again), and an owner that was taken over
is fenced by its next append. Timing only decides when to try: the lease (an idle owner sends a heartbeat every
quarter of it, a core NATS message that names its log's last sequence), a claim delay that grows with the
groups a node owns (nodes share the groups), and balancing (a caught-up standby asks for its group when its
node owns two fewer than the owner's, or when an operator pinned it here).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import gevent

from .candidacy import Candidacy

log = logging.getLogger("mqks.log")

STANDBY_REPORT_SECONDS = 10.0  # a standby tells `mqks cluster status` how far it has read this often (a KV put, R3)
# ... and, while it has read nothing new, this often (under client/cluster.py's STANDBY_DOWN_SECONDS, after which
# status shows it down): an idle default cluster's 32 standbys put 3.2 R3 entries a second, NATS's largest idle cost
STANDBY_IDLE_REPORT_SECONDS = 20.0
BALANCE_SECONDS = 5.0  # a caught-up standby looks this often whether its node should own this group instead
# ... and this soon after a look that would have asked but could not yet: another standby of its node was pulling a
# group, or a put to the map did not go through (issue 56: a healed node's standbys all stood by again when NATS
# answered and looked together; all but one looked again 5 s later, and the node got a group back every 5 s)
BALANCE_RETRY_SECONDS = 1.0
FOLLOW_BATCH_SECONDS = 0.05  # a standby reading under load takes what came meanwhile at once
RETRY_SECONDS = 0.5  # following failed (NATS unreachable): try again after this
# a claim first looks at its stream's tail; a look unanswered this long is no answer (NATS never answers a request
# sent while the stream has no leader: it would wait out its 5 s timeout), and the look is made again
TAIL_LOOK_SECONDS = 1.0
# frames heard after a silence this many heartbeats long are a sign of life only if their owner answers its ping: a
# stream's new leader delivers what a cut owner stored as it was cut off seconds later (issue 56: 4.3 s after the cut,
# before the tail check; the takeover came 4 s late, and the cut node's queues were served again 21.6 s after the cut)
LATE_FRAMES_HEARTBEATS = 1.25
# a silent owner that answers its ping is waited for up to this many leases of silence: it steps down after one
# lease of a log it cannot write to, so only an owner wedged in a way nobody foresaw is claimed from
OWNER_ANSWERS_LEASES = 2.0
# balancing moves a group whose owner took it over lately at once; one its owner has held longer only once the
# counts have stayed uneven this long: after a failover the failed node's groups spread, not the others' (issue 56:
# healthy groups changed hands while a host was cut off)
RECENT_OWNER_LEASES = 3.0
UNEVEN_PATIENCE_SECONDS = 60.0


class Reading(Protocol):
    """How far a reading of the stream has come (server/journal/jetstream_log.py's StreamReading)."""

    read: int
    replayer: Any  # .owner, .handoff: what the frames read so far say


class FollowedStream(Protocol):
    """What the election needs of the storage log: read, follow, look at the tail, append conditionally."""

    name: str  # the group's log: its owner ping and hand-off subjects say it
    label: str  # the log as log lines name it

    def start_reading(self) -> Any: ...

    def read_to_tail(self, reading: Any) -> Iterator[list[bytes]]: ...  # the records of each read

    def ask_owner(self, silent_is_owner: bool = False) -> str | None: ...

    def follow(self, reading: Any, fresh_after: int = 0) -> None: ...

    def read_followed(self, reading: Any, timeout: float) -> tuple[bool, list[bytes]]: ...  # (heard, records)

    def last_seq(self) -> int: ...

    def stop_following(self, reading: Any) -> None: ...

    def take_over(self, reading: Any) -> bytes | None: ...


def replay_as_candidate(stream: FollowedStream, standby: Standby) -> Iterator[bytes]:
    """read_as_candidate's records one by one."""
    for records in read_as_candidate(stream, standby):
        yield from records


class StandbyMap(Protocol):
    """What the election needs of the cluster map (map.py's ClusterMap)."""

    def owner_counts(self) -> tuple[dict[str, int], str | None]: ...

    def balance_view(self, fresh_pin: bool = False) -> tuple[dict[str, int], str | None, str | None]: ...

    def report_standby(self, seq: int) -> None: ...

    def ask_for_group(self, stream: str, node: str, of_node: str | None = None) -> dict[str, Any]: ...

    def can_write(self) -> bool: ...


def read_as_candidate(stream: FollowedStream, standby: Standby) -> Iterator[list[bytes]]:
    """The records of the group's stream up to this node's takeover, whose record ends them, a list per read (the
    journal's recovery applies each in one pass): read to the tail, stand by until this node should claim, take
    over; a claim that loses reads on and stands by again."""
    reading = stream.start_reading()
    while True:
        yield from stream.read_to_tail(reading)
        yield from standby.stand_by(reading)
        record = stream.take_over(reading)
        if record is not None:
            yield [record]
            return
        standby.claim_lost()
        log.info("%s: another node took it over first; standing by again", stream.label)


class Standby:
    """A node's warm standby for one group: follows the stream, applying every frame as the owner stores it."""

    def __init__(self, candidacy: Candidacy, stream: FollowedStream, cluster_map: StandbyMap,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = gevent.sleep) -> None:
        self.candidacy = candidacy
        self.stream = stream
        self.cluster_map = cluster_map
        self.clock = clock
        self.sleep = sleep
        self.owner_since = clock()  # since when this standby has seen the group's current owner (its epoch)
        self.uneven_since: float | None = None  # since when the counts have asked for this group without a pause
        self.pulling = False  # this standby asked for its group and the owner said yes: the node's pull turn is its

    def stand_by(self, reading: Reading) -> Iterator[list[bytes]]:
        """The records of the frames the owner stores, until this node should claim the group: its owner has
        appended nothing for the lease (then the claim delay), or handed the group to this node (or to any)."""
        candidacy, stream, clock = self.candidacy, self.stream, self.clock
        lease = candidacy.lease_seconds
        replayer = reading.replayer
        owner = self.ask_owner()
        now = clock()
        seen_epoch = replayer.epoch
        if owner is None:  # nobody answers for it: a new cluster, or its owner is gone
            expires = now + candidacy.first_claim_delay
            if replayer.owner:
                # the log names an owner: one that took over a moment ago on another NATS server may have no
                # interest here yet (CI under load: a node took back the group it had just handed over). Its
                # heartbeat comes within this, and the claim asks again first
                expires = max(expires, now + candidacy.heartbeat_seconds * 1.5)
            log.info("%s: no owner answers; claiming it in %.1f s unless another node does first",
                     stream.label, expires - now)
        else:
            expires = now + lease
            log.info("%s: owned by %s; standing by (lease %g s)", stream.label, owner, lease)
        # balanced_at: the first look at balancing is at once, a node that rejoins (a heal, a restart) asks for
        # groups as soon as it has caught up, not a balancing period later
        reported = claimed_at = tail_checked_at = balanced_at = -1e9
        balance_every = min(BALANCE_SECONDS, lease / 2)
        owner_waited_for = False  # a silent owner that answers its ping was waited for (logged once)
        doubted_at = -1e9  # when frames heard after a silence last found their owner not answering its ping
        unanswered_since: float | None = None  # since when the claim's look at the stream has had no answer
        reported_seq = -1
        heard_at = now  # the owner's last frame or heartbeat
        following = followed = False
        stored_before = 0  # frames up to this sequence were stored before the follower (re)started: no sign of life
        replayer.handoff = None  # a hand-off read before this node stood by was meant for the standbys of then
        while True:
            if replayer.handoff in (candidacy.node, "*"):
                log.info("%s: handed to this node by %s", stream.label, replayer.owner)
                stream.stop_following(reading)
                return
            now = clock()
            if now >= expires:
                if claimed_at < 0:
                    claimed_at = now
                    expires = now + candidacy.claim_delay(self.fewest_elsewhere())
                    if expires > now:
                        continue
                stored = self.look_at_tail()
                if stored is None:
                    # no stream leader answers from here (this host cut off, or NATS electing): a claim could not
                    # land now, and one that landed after a heal took the group from an owner that was only out of
                    # reach, waiting on the same election (issue 56: failing takeovers by the healed node)
                    if unanswered_since is None:
                        unanswered_since = now
                        log.warning("%s: its stream does not answer from here: not claiming it until it does",
                                    stream.label)
                    self.sleep(RETRY_SECONDS)
                    continue
                if unanswered_since is not None:
                    # the owner's silence meanwhile is this standby's deafness, not the owner's
                    log.info("%s: its stream answers again after %.0f s; its owner's silence counts from now",
                             stream.label, now - unanswered_since)
                    heard_at, unanswered_since = max(heard_at, now), None
                if stored > reading.read:
                    # frames the follower did not bring (the takeover's fence would refuse it): read them first, and
                    # the claim looks again once they came (stored before following anew, they are no sign of life)
                    following, stored_before = False, max(stored_before, stored)
                    expires = now + RETRY_SECONDS
                elif owner is None:
                    owner = self.ask_owner()  # the first ask's silence, confirmed
                    if owner is not None:
                        log.info("%s: owned by %s after all; standing by (lease %g s)", stream.label, owner, lease)
                        expires, claimed_at = clock() + lease, -1e9
                        continue
                    stream.stop_following(reading)
                    return
                else:
                    silent = now - heard_at
                    answer = self.ask_owner(silent_is_owner=False)
                    if answer is not None and silent < OWNER_ANSWERS_LEASES * lease:
                        # alive and reachable, yet silent: its log out of reach for now (a NATS election, a cut
                        # stream leader). A claim would hit the same log, and take the group from a live owner
                        # (issue 56: healthy groups changed hands while another host was cut). The owner steps
                        # down by itself after a lease of that; this wait is bounded all the same
                        if not owner_waited_for:
                            log.warning("%s: nothing from its owner %s for %.0f s, but it answers its ping: waiting "
                                        "for its log (at most %g s more)", stream.label, answer, silent,
                                        OWNER_ANSWERS_LEASES * lease - silent)
                            owner_waited_for = True
                        expires = now + candidacy.heartbeat_seconds
                        continue
                    log.warning("%s: nothing from its owner %s for %.0f s: taking it over", stream.label,
                                replayer.owner or "?", silent)
                    stream.stop_following(reading)
                    return
            if now - reported >= STANDBY_REPORT_SECONDS and (
                    reading.read != reported_seq or now - reported >= STANDBY_IDLE_REPORT_SECONDS):
                reported, reported_seq = now, reading.read
                self.cluster_map.report_standby(reading.read)
            try:
                if not following:
                    if followed:
                        # following anew (it failed, or its NATS node went): the frames stored meanwhile come now,
                        # and an owner that stored them and then died must not look alive for a lease more (issue 56:
                        # takeovers came 24 s after a cut, not 12)
                        stored_before = max(stored_before, stream.last_seq())
                    stream.follow(reading, fresh_after=stored_before)
                    following = followed = True
                # frames and heartbeats wake it; else it sleeps until the next thing due: the claim, a report, a
                # look at balancing or at the tail (it looked at the clock each second: a quarter of an idle
                # node's wakeups, sixteen standbys per node)
                due = min(expires, balanced_at + balance_every,
                          reported + (STANDBY_REPORT_SECONDS if reading.read != reported_seq
                                      else STANDBY_IDLE_REPORT_SECONDS),
                          max(heard_at + candidacy.heartbeat_seconds * 1.5,
                              tail_checked_at + candidacy.heartbeat_seconds))
                heard, records = stream.read_followed(reading, max(0.05, due - now))
                if (not heard and now - heard_at >= candidacy.heartbeat_seconds * 1.5
                        and now - tail_checked_at >= candidacy.heartbeat_seconds):
                    # a quiet stream, or a follower that lost its NATS node? The owner's heartbeat comes this
                    # often; a check per empty read was a stream info a second per standby (issue 39)
                    tail_checked_at = now
                    stored = stream.last_seq()
                    if stored > reading.read:  # frames the follower does not bring: follow anew
                        following = False
                        stored_before = stored
            except (gevent.Timeout, Exception) as e:  # NATS unreachable: this node could not take over either
                log.warning("%s: following it failed (%r); again", stream.label, e)
                following = False
                self.sleep(RETRY_SECONDS)
                continue
            if records:
                yield records
            if replayer.epoch != seen_epoch:  # a new owner: taken over, or handed on
                seen_epoch, self.owner_since = replayer.epoch, clock()
            if records:
                # under load, the frames of the next moment are read and applied together: a read per frame (two
                # standbys of every group each read each frame) was most of a standby's cost beside applying them
                self.sleep(FOLLOW_BATCH_SECONDS)
            silence = clock() - heard_at
            if heard and silence >= candidacy.heartbeat_seconds * LATE_FRAMES_HEARTBEATS and (
                    clock() - doubted_at < candidacy.heartbeat_seconds
                    or self.ask_owner(silent_is_owner=False) is None):
                if doubted_at < heard_at:
                    log.info("%s: frames after %.1f s of silence, but its owner does not answer its ping: stored "
                             "before it went, no sign of life", stream.label, silence)
                doubted_at, heard = clock(), False
            if heard:
                owner = replayer.owner or owner
                heard_at = clock()
                expires = heard_at + lease
                claimed_at = -1e9
                if owner_waited_for:
                    log.info("%s: its owner %s is heard again", stream.label, owner)
                    owner_waited_for = False
            # heard or not: a busy group's standby hears frames at every read, and balanced only in a quiet moment
            # (issue 56: a healed node got groups back 18-25 s after the heal, when its groups' load paused)
            if now - balanced_at >= balance_every:
                balanced_at = now
                balance_every = BALANCE_RETRY_SECONDS if self.balance() else min(BALANCE_SECONDS, lease / 2)

    def look_at_tail(self) -> int | None:
        """The stream's last sequence as its leader says now; None when none answers from here in TAIL_LOOK_SECONDS."""
        try:
            with gevent.Timeout(TAIL_LOOK_SECONDS):
                return self.stream.last_seq()
        except (gevent.Timeout, Exception):
            return None

    def claim_lost(self) -> None:
        """The claim did not take the group (another node appended first, or no stream leader answered): a pull that
        brought the hand-off is over, and another standby of this node may ask (issue 56: after a heal, a takeover
        NATS did not answer held the node's turn for 30 s, and the healed node asked for no other group)."""
        if self.pulling:
            self.pulling = False
            self.candidacy.end_pull()

    def fewest_elsewhere(self) -> int:
        """The fewest groups another node that may claim this group owns, as the map says: not this node, not the
        group's owner (silent, maybe cut off). 0 when the map names none: a node that owns none is not in it."""
        counts, owner = self.cluster_map.owner_counts()
        others = [count for node, count in counts.items() if node not in (owner, self.candidacy.node)]
        return min(others, default=0)

    def ask_owner(self, silent_is_owner: bool = True) -> str | None:
        """The owner's answer to its ping; None when none listens (or, unless `silent_is_owner`, none answers: an
        owner cut off from this side of a partition still has listeners here until NATS's routes notice)."""
        try:
            return self.stream.ask_owner(silent_is_owner=silent_is_owner)
        except Exception:  # NATS out of reach: as if an owner answered, so nobody claims in a hurry
            return "?"

    def balance(self) -> bool:
        """Ask for this group when it is pinned here (`mqks cluster move` put it on this node, and a failover took it
        away), or when it is not pinned and this node owns at least two groups fewer than its owner's node: nodes
        that restarted or joined get work back. One request at a time per node, so two of its standbys never both
        pull; a pinned group is never pulled elsewhere, so an operator's moves (draining a node) stay. True when it
        could not tell or would have asked but could not yet (the map behind or out of reach, another standby's pull,
        a put that did not go through): look again soon."""
        candidacy, cluster_map = self.candidacy, self.cluster_map
        try:
            counts, owner, pin = cluster_map.balance_view(False)
            if owner is None or owner == candidacy.node:
                # no owner known, or this node, which stands by for the group: the map is behind (issue 56: a healed
                # node's owner that stepped down after the heal stood by while its map still named it)
                return True
            if pin is None and counts.get(owner, 0) - candidacy.owned_here() >= 2:
                counts, owner, pin = cluster_map.balance_view(True)  # about to ask: a pin made since counts
        except OSError:  # NATS out of reach: nothing to balance now
            return True
        if owner is None or owner == candidacy.node:
            return True
        if pin is not None:
            if pin != candidacy.node:
                return False
            why = f"it is pinned to this node (mqks cluster move) and node {owner} has it"
        elif counts.get(owner, 0) - candidacy.owned_here() >= 2:
            now = self.clock()
            if self.uneven_since is None:
                self.uneven_since = now
            if (now - self.owner_since >= RECENT_OWNER_LEASES * candidacy.lease_seconds
                    and now - self.uneven_since < UNEVEN_PATIENCE_SECONDS):
                return False  # held long by its owner: a group taken over lately goes first
            why = f"node {owner} owns {counts[owner]} groups, this node {candidacy.owned_here()}"
        else:
            self.uneven_since = None
            return False
        if not candidacy.may_pull():
            return True
        label = self.stream.label
        if not cluster_map.can_write():
            # as the owner it would put its entry in the map at once, and nobody would link to it until then (issue
            # 56: a healed node's puts timed out for 12 s while its reads worked; the groups it was handed had no
            # owner reachable from the other nodes all that time)
            log.info("%s: %s, but a put to the cluster's map from here does not go through yet: not asking", label,
                     why)
            candidacy.end_pull()
            return True
        log.info("%s: %s: asking for it", label, why)
        try:
            answer = cluster_map.ask_for_group(self.stream.name, candidacy.node, owner)
        except Exception as e:
            log.info("%s: its owner did not take the request (%s)", label, e)
            candidacy.end_pull()
            return False
        self.pulling = bool(answer.get("ok"))
        if not answer.get("ok"):  # another node's standby asked first: this node's turn to pull is over
            if answer.get("owner", owner) != owner:
                log.info("%s: node %s owns it now, not node %s: not moved", label, answer["owner"], owner)
            else:
                log.info("%s: its owner hands it to node %s instead", label, answer.get("to"))
            candidacy.end_pull()
        return False


class HandOffRequests:
    """An owner's side of a hand-off: `mqks cluster move`, or a balancing standby, asks it to hand its group to a
    node; the first node asked for gets it (later askers hear where it goes), and the hub drains and stops."""

    def __init__(self, node: str, owner: str, wake: Callable[[], None]) -> None:
        self.node = node
        self.owner = owner  # as the group's owner describes itself
        self.wake = wake  # tells the hub (Server.on_log_wake), from the asyncio thread
        self.move_to: str | None = None

    def answer(self, name: str, request: str) -> bytes:
        """The answer to one request (in the asyncio thread): ok when the group goes to the node asked for.
        `request` is that node, then (from a balancing standby) the node the asker counted as the owner: a request
        meant for another owner is refused, since the asker's map was behind (issue 56: after a heal, a group the
        healed node had just been handed went on to a third node that counted its old owner's groups)."""
        asked_for, _, of_node = request.partition(" ")
        if of_node and of_node != self.node:
            return json.dumps({"ok": False, "from": self.owner, "to": self.move_to, "owner": self.node}).encode()
        if self.move_to is None and asked_for != self.node:
            log.warning("group %s: asked to hand it over to node %s", name, asked_for)
            self.move_to = asked_for
            self.wake()
        # not ok: it goes to another node already (two standbys asked at once), not to this one
        return json.dumps({"ok": self.move_to == asked_for, "from": self.owner,
                           "to": self.move_to or asked_for}).encode()

"""The election's decisions (server/cluster/election.py) over a fake storage log and a fake clock: when a standby
claims its group, when it waits, what a hand-off, a lost claim, a follower that lost its NATS node and balancing
do. In process and in fake time: a lease of 12 s passes in microseconds, and every wait is the code's own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from mqks.client.cluster import STANDBY_DOWN_SECONDS
from mqks.server.cluster.candidacy import CLAIM_DELAY_CAP_SECONDS, CLAIM_DELAY_PER_GROUP_SECONDS, Candidacy
from mqks.server.cluster.election import (
    BALANCE_RETRY_SECONDS,
    BALANCE_SECONDS,
    RECENT_OWNER_LEASES,
    STANDBY_IDLE_REPORT_SECONDS,
    STANDBY_REPORT_SECONDS,
    UNEVEN_PATIENCE_SECONDS,
    Standby,
    replay_as_candidate,
)
from mqks.server.journal.jetstream_log import EPOCH, FRAME, HANDOFF, OWNER, Replayer

pytestmark = pytest.mark.timeout(10)

LEASE = 12.0


class Clock:
    """Fake time: the stream's waits and the standby's sleeps move it forward."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Reading:
    def __init__(self) -> None:
        self.replayer = Replayer()
        self.read = 0
        self.last_seq = 0


def frame(epoch: int, k: int, data: bytes, owner: str = "", handoff: str = "") -> tuple[dict[str, str], bytes]:
    headers = {EPOCH: str(epoch), FRAME: str(k)}
    if owner:
        headers[OWNER] = owner
    if handoff:
        headers[HANDOFF] = handoff
    return headers, data


class FakeStream:
    """A group's stream as the election sees it (election.py's FollowedStream): messages stored so far, messages
    a writer will store at given (fake) times, an owner that answers its ping or not."""

    name = "c-0-of-4"
    label = "group c-0-of-4"

    def __init__(self, clock: Clock, owner: str | None = None) -> None:
        self.clock = clock
        self.owner = owner  # what the owner ping answers (None: nobody listens)
        self.first_answers: list[str | None] = []  # what the first pings answer, before `owner`
        # a ping that must be answered to count (the claim's last look) finds the owner alive until this fake time
        # (by default it is gone: an owner that stopped storing and beating died)
        self.answers_until = 0.0
        self.asked = 0
        self.messages: list[tuple[dict[str, str], bytes]] = []
        self.arrivals: list[tuple[float, tuple[dict[str, str], bytes]]] = []  # (at, message), in time order
        self.following_from = 0  # 0: not following
        self.follower_lost = False  # the follower's NATS node went: it brings nothing more until followed anew
        self.follows = 0
        self.fresh_after = 0
        self.takeovers: list[int] = []  # the sequence each takeover expected
        self.rival_before_claim: tuple[dict[str, str], bytes] | None = None  # another node claims first, once

    def store(self, message: tuple[dict[str, str], bytes]) -> None:
        self.messages.append(message)

    def at(self, seconds: float, message: tuple[dict[str, str], bytes]) -> None:
        self.arrivals.append((self.clock.now + seconds, message))

    def _arrive(self) -> None:
        while self.arrivals and self.arrivals[0][0] <= self.clock.now:
            self.messages.append(self.arrivals.pop(0)[1])

    def _feed(self, reading: Reading, up_to: int) -> list[bytes]:
        lines: list[bytes] = []
        while reading.read < up_to:
            headers, data = self.messages[reading.read]
            reading.read += 1
            lines += reading.replayer.feed(headers, data)
        return lines

    # -- FollowedStream
    def start_reading(self) -> Reading:
        reading = Reading()
        reading.last_seq = len(self.messages)
        return reading

    def read_to_tail(self, reading: Reading) -> Iterator[list[bytes]]:
        yield self._feed(reading, reading.last_seq)

    def ask_owner(self, silent_is_owner: bool = False) -> str | None:
        self.asked += 1
        if self.first_answers:
            return self.first_answers.pop(0)
        if not silent_is_owner and self.clock.now >= self.answers_until:
            return None
        return self.owner

    def follow(self, reading: Reading, fresh_after: int = 0) -> None:
        self.fresh_after = fresh_after
        self.following_from = reading.read + 1
        self.follower_lost = False
        self.follows += 1

    def read_followed(self, reading: Reading, timeout: float) -> tuple[bool, list[bytes]]:
        assert self.following_from, "read_followed before follow"
        self._arrive()
        if len(self.messages) == reading.read or self.follower_lost:
            next_at = self.arrivals[0][0] if self.arrivals else float("inf")
            self.clock.now = min(self.clock.now + timeout, next_at)
            self._arrive()
        if self.follower_lost or len(self.messages) == reading.read:
            return False, []
        return len(self.messages) > self.fresh_after, self._feed(reading, len(self.messages))

    def last_seq(self) -> int:
        self._arrive()
        return len(self.messages)

    def stop_following(self, reading: Reading) -> None:
        self.following_from = 0

    def take_over(self, reading: Reading) -> bytes | None:
        self.takeovers.append(reading.read)
        if self.rival_before_claim is not None:
            self.messages.append(self.rival_before_claim)
            self.owner = f"{self.rival_before_claim[0][OWNER]} (epoch {self.rival_before_claim[0][EPOCH]})"
            self.rival_before_claim = None
        if reading.read != len(self.messages):
            reading.last_seq = len(self.messages)
            return None
        epoch = reading.replayer.epoch + 1
        record = b"W %d node a" % epoch
        self.messages.append(frame(epoch, 0, record, owner="node a"))
        return record


class FakeMap:
    """The cluster map as the election sees it (election.py's StandbyMap)."""

    def __init__(self, counts: dict[str, int] | None = None, owner: str | None = None, pin: str | None = None,
                 answer: dict[str, Any] | None = None) -> None:
        self.view = (counts or {}, owner, pin)
        self.answer = answer if answer is not None else {"ok": True}
        self.reports: list[int] = []
        self.asked: list[tuple[str, str]] = []
        self.asked_of: list[str | None] = []  # the owner each ask was meant for
        self.writable: list[bool] = []  # what the next can_write() calls answer (then True)
        self.fresh_reads = 0

    def owner_counts(self) -> tuple[dict[str, int], str | None]:
        return self.view[0], self.view[1]

    def balance_view(self, fresh_pin: bool = False) -> tuple[dict[str, int], str | None, str | None]:
        self.fresh_reads += fresh_pin
        return self.view

    def report_standby(self, seq: int) -> None:
        self.reports.append(seq)

    def can_write(self) -> bool:
        return self.writable.pop(0) if self.writable else True

    def ask_for_group(self, stream: str, node: str, of_node: str | None = None) -> dict[str, Any]:
        self.asked.append((stream, node))
        self.asked_of.append(of_node)
        return self.answer


class Node:
    """What a node's other processes tell a candidacy: groups owned, one pull turn at a time."""

    def __init__(self, owned: int = 0) -> None:
        self.owned = owned
        self.turn_taken = False
        self.turns_ended = 0

    def may_pull(self) -> bool:
        if self.turn_taken:
            return False
        self.turn_taken = True
        return True

    def end_pull(self) -> None:
        self.turn_taken = False
        self.turns_ended += 1


def standby(clock: Clock, stream: FakeStream, cluster_map: FakeMap | None = None, node: Node | None = None,
            name: str = "a") -> Standby:
    node = node or Node()
    candidacy = Candidacy("c", name, 0, LEASE, owned_here=lambda: node.owned, may_pull=node.may_pull,
                          end_pull=node.end_pull)
    return Standby(candidacy, stream, cluster_map or FakeMap(), clock=clock, sleep=clock.sleep)


def owned_by_b(stream: FakeStream) -> None:
    """Node b took the group over (epoch 1) and stored one publish."""
    stream.store(frame(1, 0, b"W 1 node b", owner="node b"))
    stream.store(frame(1, 1, b"P one"))


def heartbeats(stream: FakeStream, every: float, until: float, epoch: int = 1, first_k: int = 2) -> None:
    k = first_k
    t = every
    while t <= until:
        stream.at(t, frame(epoch, k, b""))
        k += 1
        t += every


def test_a_new_group_nobody_answers_for_is_claimed_after_its_spread_delay():
    clock = Clock()
    stream = FakeStream(clock, owner=None)
    candidacy_delay = Candidacy("c", "a", 0, LEASE).first_claim_delay
    started = clock.now
    records = list(replay_as_candidate(stream, standby(clock, stream)))
    assert records == [b"W 1 node a"]  # its own takeover record ends the replay
    assert stream.takeovers == [0]
    assert clock.now - started == pytest.approx(candidacy_delay, abs=0.06)


def test_an_owner_named_by_the_log_whose_ping_finds_no_listener_yet_is_not_claimed_from():
    """Node b took the group over a moment ago, on another NATS server whose interest has not reached this
    standby's yet: the first ping finds no listener. Its heartbeats keep the group with b."""
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    stream.first_answers = [None]
    owned_by_b(stream)
    heartbeats(stream, LEASE / 4, 3 * LEASE)
    started = clock.now
    records = list(replay_as_candidate(stream, standby(clock, stream)))
    assert clock.now - started >= 4 * LEASE  # a lease after b's last heartbeat, not a spread delay after the ping
    assert records[-1] == b"W 2 node a" and len(stream.takeovers) == 1


def test_a_claim_after_a_silent_ping_asks_again_and_stands_by_when_the_owner_answers_now():
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    stream.first_answers = [None]
    owned_by_b(stream)  # and b stays silent: no heartbeat reaches this standby
    started = clock.now
    list(replay_as_candidate(stream, standby(clock, stream)))
    assert stream.asked == 3  # the first ask, the one before the claim, and the last look after b's lease
    # the second ask answered: the claim waited out b's lease after it (its heartbeat never came)
    assert clock.now - started >= LEASE


def test_a_standby_applies_what_the_owner_stores_and_never_claims_while_it_hears_heartbeats():
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    owned_by_b(stream)
    stream.at(1.0, frame(1, 2, b"P two\nP three"))
    heartbeats(stream, LEASE / 4, 10 * LEASE, first_k=3)
    started = clock.now
    records = list(replay_as_candidate(stream, standby(clock, stream)))
    # the owner fell silent after its last heartbeat at 10 leases: claimed one lease later, not before
    assert clock.now - started >= 11 * LEASE
    assert records[:4] == [b"W 1 node b", b"P one", b"P two", b"P three"]
    assert records[-1] == b"W 2 node a" and stream.takeovers == [len(stream.messages) - 1]


def test_a_silent_owner_that_answers_its_ping_is_waited_for_and_kept_once_it_is_heard_again():
    """Issue 56: while another host was cut off, NATS elected new stream leaders; owners that could not store for a
    while went silent, and standbys took their groups over though the owners were alive and reachable."""
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    owned_by_b(stream)
    started = clock.now
    stream.answers_until = started + 9 * LEASE  # alive all along, then gone
    stream.at(1.8 * LEASE, frame(1, 2, b"P stored after the election"))  # heard again before 2 leases of silence
    for k in range(3, 27):  # then its heartbeats, each quarter lease, up to 8 leases
        stream.at(1.8 * LEASE + (k - 2) * LEASE / 4, frame(1, k, b""))
    records = list(replay_as_candidate(stream, standby(clock, stream)))
    assert b"P stored after the election" in records
    # not claimed while b answered: only after it was gone (its last heartbeat at 7.8 leases, gone at 9)
    assert 9 * LEASE <= clock.now - started < 9.5 * LEASE
    assert records[-1] == b"W 2 node a" and len(stream.takeovers) == 1


def test_a_silent_owner_that_answers_its_ping_is_claimed_from_after_two_leases_all_the_same():
    """The wait is bounded: an owner steps down by itself after a lease of a log it cannot write to, and one that
    does not (wedged in a way nobody foresaw) must not hold its group for good. The takeover fences it."""
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    owned_by_b(stream)
    started = clock.now
    stream.answers_until = float("inf")
    records = list(replay_as_candidate(stream, standby(clock, stream)))
    assert 2 * LEASE <= clock.now - started <= 2 * LEASE + LEASE / 4 + 0.1
    assert records[-1] == b"W 2 node a"


def test_an_owner_cut_off_from_this_side_is_claimed_from_after_its_lease_though_its_ping_times_out():
    """Its listeners stay known here until NATS's routes notice the cut: its ping times out, which the claim's last
    look does not take for an answer (the first ask does: an owner may be paused)."""
    clock = Clock()
    stream = FakeStream(clock, owner="an owner that does not answer")  # a timeout, with silent_is_owner
    owned_by_b(stream)
    started = clock.now
    records = list(replay_as_candidate(stream, standby(clock, stream)))
    assert LEASE <= clock.now - started < 1.5 * LEASE
    assert records[-1] == b"W 2 node a"


class CutOffStream(FakeStream):
    """The stream as a standby on a host cut off sees it: from `cut_at` until NATS has elected its leaders after the
    heal (`answers_at`) no stream leader answers from here and no owner's listener is reachable. Node b owns the group
    all along, idle: it stores nothing, and its heartbeats (core NATS, never stored) are heard here outside the cut
    until it stalls on the same election; it is gone at `answers_until`. A takeover sent meanwhile lands once a stream
    leader answers again, as JetStream's retried request does."""

    def __init__(self, clock: Clock, cut_at: float, answers_at: float, stall_seconds: float, gone_at: float) -> None:
        super().__init__(clock, owner="node b (epoch 1)")
        owned_by_b(self)
        self.cut_at, self.answers_at, self.answers_until = cut_at, answers_at, gone_at
        self.stall = (answers_at - stall_seconds, answers_at)  # b's log out of reach: no heartbeats
        self.claimed_at: list[float] = []

    def reachable(self) -> bool:
        return not self.cut_at <= self.clock.now < self.answers_at

    def ask_owner(self, silent_is_owner: bool = False) -> str | None:
        if not self.cut_at <= self.clock.now < self.stall[0]:  # the routes are back once the cut is healed
            return super().ask_owner(silent_is_owner)
        self.asked += 1
        return None

    def last_seq(self) -> int:
        if not self.reachable():
            raise TimeoutError("nats: timeout")
        return super().last_seq()

    def read_followed(self, reading: Reading, timeout: float) -> tuple[bool, list[bytes]]:
        now, beat = self.clock.now, LEASE / 4
        beats = (self.cut_at - beat * n for n in range(int((self.cut_at - 1000.0) / beat), -1, -1))
        later = (self.answers_at + beat * n for n in range(int((self.answers_until - self.answers_at) / beat)))
        heard_at = next((t for t in (*beats, *later) if now < t <= now + timeout), None)
        self.clock.now = now + timeout if heard_at is None else heard_at
        return heard_at is not None, []

    def take_over(self, reading: Reading) -> bytes | None:
        self.clock.now = max(self.clock.now, self.answers_at)
        self.claimed_at.append(self.clock.now)
        return super().take_over(reading)


def test_a_standby_cut_off_with_its_nats_server_does_not_take_a_live_owners_group_at_the_heal():
    """Issue 56: a healed node's standbys had heard nothing from the other side's owners for the whole cut, claimed
    their groups meanwhile (no owner answered from the cut host), and those takeovers landed once NATS elected leaders
    after the heal: an idle group's fence still matched, and a live owner waiting on the same election was fenced.
    A claim needs its stream to answer from here first, and the owner's silence counts only from then."""
    clock = Clock()
    start = clock.now
    stream = CutOffStream(clock, cut_at=start + 2.0, answers_at=start + 2.0 + 30.0 + 8.0, stall_seconds=7.0,
                          gone_at=start + 2.0 + 30.0 + 8.0 + 3 * LEASE)
    records = list(replay_as_candidate(stream, standby(clock, stream)))
    assert records[-1] == b"W 2 node a" and len(stream.takeovers) == 1
    assert stream.claimed_at[0] >= stream.answers_until  # once b was gone, not at the heal


def test_a_standby_whose_stream_answers_nothing_from_here_claims_once_it_answers():
    """A dead owner's group is still claimed by a standby whose stream had no leader for a while (a NATS election on
    the majority's side of a cut): the look waits for the leader, not for another lease."""
    clock = Clock()
    start = clock.now
    stream = CutOffStream(clock, cut_at=start + 2.0, answers_at=start + 2.0 + 1.5 * LEASE, stall_seconds=0.0,
                          gone_at=start + 2.0)
    list(replay_as_candidate(stream, standby(clock, stream)))
    assert len(stream.takeovers) == 1
    assert stream.answers_at <= stream.claimed_at[0] < stream.answers_at + 1.0


def test_a_claim_that_finds_frames_its_follower_did_not_bring_reads_them_first_and_claims_at_once():
    """The takeover's fence would refuse a claim behind the tail: it stood by again, and claimed a lease later. Here the
    owner stored a frame just before it died, after the standby's last look at the tail, on a follower that was lost."""
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    owned_by_b(stream)
    started = clock.now
    for k, at in enumerate((1.0, 2.0, 3.0)):
        stream.at(at, frame(1, k + 2, b""))
    stream.at(14.0, frame(1, 5, b"P stored as b died"))  # after the tail check at 13.5, before the lease ends at 15
    original_read = stream.read_followed

    def losing_its_follower(reading: Reading, timeout: float) -> tuple[bool, list[bytes]]:
        if stream.follows == 1 and clock.now >= started + 3.5:
            stream.follower_lost = True  # the first follower's NATS node went: it brings nothing more
        return original_read(reading, timeout)

    stream.read_followed = losing_its_follower  # type: ignore[method-assign]
    records = list(replay_as_candidate(stream, standby(clock, stream)))
    assert b"P stored as b died" in records and records[-1] == b"W 2 node a"
    assert len(stream.takeovers) == 1 and stream.follows == 2
    assert clock.now - started < 3.0 + LEASE + 1.0  # a lease after b's last heard frame, not two


def test_frames_a_follower_brings_late_after_a_silence_count_only_if_their_owner_answers():
    """Issue 56: the cut owner's last frames, stored as the cut came, reached the majority's standby 4.3 s later (once
    NATS had elected the stream's new leader, before its tail check): counted as a sign of life, they put the takeover
    4 s later, and the cut node's queues were served again 21.6 s after the cut. Frames heard after a silence longer
    than a heartbeat's count only once the owner answers its ping."""
    def claimed_after(answers: bool) -> float:
        clock = Clock()
        stream = FakeStream(clock, owner="node b (epoch 1)")
        owned_by_b(stream)
        started = clock.now
        stream.at(0.5, frame(1, 2, b"P heard at once"))
        stream.at(1.0, frame(1, 3, b"P stored as b was cut off"))
        stream.answers_until = started + 100 * LEASE if answers else 0.0
        if answers:  # alive: its frames go on once the stream's new leader is elected
            heartbeats(stream, LEASE / 4, 4 * LEASE, first_k=4)
        release = started + 0.5 + 4.3  # the stream's new leader delivers what the follower had not brought
        original_read = stream.read_followed

        def stalled_until_release(reading: Reading, timeout: float) -> tuple[bool, list[bytes]]:
            stream.follower_lost = started + 0.52 <= clock.now < release and stream.follows == 1
            if stream.follower_lost:
                timeout = min(timeout, release - clock.now)
            return original_read(reading, timeout)

        stream.read_followed = stalled_until_release  # type: ignore[method-assign]
        records = list(replay_as_candidate(stream, standby(clock, stream)))
        assert b"P stored as b was cut off" in records and records[-1] == b"W 2 node a"
        return clock.now - started

    assert claimed_after(answers=False) == pytest.approx(0.5 + LEASE, abs=0.2)  # a lease after b was last heard
    assert claimed_after(answers=True) >= 4 * LEASE + LEASE  # alive: heard as before


def test_a_node_that_owns_groups_claims_later_by_its_claim_delay():
    def claimed_after(owned: int) -> float:
        clock = Clock()
        stream = FakeStream(clock, owner="node b (epoch 1)")
        owned_by_b(stream)
        started = clock.now
        list(replay_as_candidate(stream, standby(clock, stream, node=Node(owned=owned))))
        return clock.now - started

    spread = Candidacy("c", "a", 0, LEASE, owned_here=lambda: 1).claim_delay() - CLAIM_DELAY_PER_GROUP_SECONDS
    assert 0 <= spread < 1
    assert claimed_after(0) == pytest.approx(LEASE, abs=0.06)
    assert claimed_after(2) == pytest.approx(LEASE + 2 * CLAIM_DELAY_PER_GROUP_SECONDS + spread, abs=0.06)
    assert claimed_after(10) == pytest.approx(LEASE + CLAIM_DELAY_CAP_SECONDS + spread, abs=0.06)  # capped


def test_only_the_groups_a_node_owns_beyond_the_fewest_another_claimant_owns_delay_its_claim():
    """Issue 56: when a host was cut off, both nodes left owned five groups and each waited the cap (2 s) before
    claiming the cut node's groups, though neither owned fewer. The cut owner's count does not count."""
    def claimed_after(owned: int, counts: dict[str, int]) -> float:
        clock = Clock()
        stream = FakeStream(clock, owner="node c (epoch 1)")
        owned_by_b(stream)
        started = clock.now
        cluster_map = FakeMap(counts=counts, owner="c")
        list(replay_as_candidate(stream, standby(clock, stream, cluster_map, Node(owned=owned))))
        return clock.now - started

    spread = Candidacy("c", "a", 0, LEASE, owned_here=lambda: 1).claim_delay() - CLAIM_DELAY_PER_GROUP_SECONDS
    assert 0 <= spread < 1
    assert claimed_after(5, {"a": 5, "b": 5, "c": 6}) == pytest.approx(LEASE + spread, abs=0.06)
    assert claimed_after(7, {"a": 7, "b": 5, "c": 4}) == pytest.approx(
        LEASE + 2 * CLAIM_DELAY_PER_GROUP_SECONDS + spread, abs=0.06)
    # a node that owns none is not in the map: the delay is the whole one
    assert claimed_after(5, {"a": 5, "c": 6}) == pytest.approx(LEASE + CLAIM_DELAY_CAP_SECONDS + spread, abs=0.06)


def test_nodes_that_own_as_many_groups_share_a_lost_nodes_groups_by_a_stable_hash():
    """The partition test: both majority nodes at the cap claimed every group of the cut node at once, and one took
    all six (balancing then moved them again). Ordered by a hash of group and node, each takes about half."""
    def first_claimer(group: int) -> str:
        delays = {node: Candidacy("c", node, group, LEASE, owned_here=lambda: 5).claim_delay() for node in "bc"}
        return min(delays, key=lambda node: delays[node])

    winners = [first_claimer(group) for group in range(16)]
    assert 4 <= winners.count("b") <= 12  # not all to one node (a fair coin: 4-12 of 16 in 99 % of layouts)
    assert winners == [first_claimer(group) for group in range(16)]  # stable: every node computes the same


def test_a_hand_off_to_this_node_is_claimed_at_once_and_one_to_another_node_is_not():
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    owned_by_b(stream)
    stream.at(2.0, frame(1, 2, b"", handoff="a"))
    started = clock.now
    assert list(replay_as_candidate(stream, standby(clock, stream)))[-1] == b"W 2 node a"
    assert clock.now - started == pytest.approx(2.0, abs=0.06)

    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    owned_by_b(stream)
    stream.at(2.0, frame(1, 2, b"", handoff="c"))  # node c takes it: this standby waits for c's writes
    stream.at(3.0, frame(2, 0, b"W 2 node c", owner="node c"))
    heartbeats(stream, LEASE / 4, 5 * LEASE, epoch=2, first_k=1)
    started = clock.now
    records = list(replay_as_candidate(stream, standby(clock, stream)))
    assert b"W 2 node c" in records and records[-1] == b"W 3 node a"
    assert clock.now - started >= 5 * LEASE


def test_a_hand_off_to_any_node_after_a_planned_stop_is_claimed_at_once():
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    owned_by_b(stream)
    stream.at(1.0, frame(1, 2, b"", handoff="*"))
    started = clock.now
    list(replay_as_candidate(stream, standby(clock, stream)))
    assert clock.now - started == pytest.approx(1.0, abs=0.06)


def test_a_hand_off_read_before_standing_by_was_for_the_standbys_of_then():
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 2)")
    owned_by_b(stream)
    stream.store(frame(1, 2, b"", handoff="a"))  # to this node, long ago: another process of it took the group then
    stream.store(frame(2, 0, b"W 2 node b", owner="node b"))
    started = clock.now
    list(replay_as_candidate(stream, standby(clock, stream)))
    assert clock.now - started == pytest.approx(LEASE, abs=0.06)  # not at once: it waited out b's lease


def test_a_claim_that_loses_reads_the_winners_records_and_stands_by_again():
    clock = Clock()
    stream = FakeStream(clock, owner=None)
    owned_by_b(stream)
    stream.rival_before_claim = frame(2, 0, b"W 2 node c", owner="node c")
    stream.at(5.0, frame(2, 1, b"P from c"))
    records = list(replay_as_candidate(stream, standby(clock, stream)))
    assert len(stream.takeovers) == 2  # refused once (c appended first), then won after c's lease
    assert records[-3:] == [b"W 2 node c", b"P from c", b"W 3 node a"]


def test_a_hand_off_whose_claim_loses_ends_the_nodes_pull_turn():
    """Issue 56: after a heal, the healed node asked for a group and was handed it; its takeover found no stream
    leader (NATS electing) and stood by again, and the node's turn to pull stayed taken for 30 s: it asked for no
    other group meanwhile."""
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    owned_by_b(stream)
    stream.at(1.0, frame(1, 2, b"", handoff="a"))  # b answers the ask: it hands the group to a
    stream.rival_before_claim = frame(2, 0, b"W 2 node c", owner="node c")  # and a's claim loses all the same
    node = Node(owned=0)
    cluster_map = FakeMap(counts={"b": 3, "a": 0}, owner="b")
    list(replay_as_candidate(stream, standby(clock, stream, cluster_map, node)))
    assert len(stream.takeovers) == 2 and cluster_map.asked
    assert node.turns_ended == 1  # at the lost claim; the group it won later ends its next turn by owning it


def test_a_follower_that_lost_its_nats_node_is_noticed_by_the_tail_and_made_again():
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    owned_by_b(stream)
    heartbeats(stream, LEASE / 4, 4 * LEASE)
    stream.answers_until = clock.now + 4 * LEASE  # alive, and answering its ping, until its last heartbeat
    original_follow = stream.follow

    def follow_then_lose(reading: Reading, fresh_after: int = 0) -> None:
        original_follow(reading, fresh_after)
        if stream.follows == 1:
            stream.follower_lost = True  # the first follower brings nothing: its NATS node went

    stream.follow = follow_then_lose  # type: ignore[method-assign]
    started = clock.now
    list(replay_as_candidate(stream, standby(clock, stream)))
    assert stream.follows == 2
    # heard again through the new follower: claimed one lease after the owner's last heartbeat, not after the first
    assert clock.now - started >= 4 * LEASE + LEASE


def test_frames_a_new_follower_brings_from_before_it_followed_are_no_sign_of_a_live_owner():
    """Issue 56: after a cut, standbys followed anew and took the frames the cut owner had stored before it for a
    sign of life: their takeovers came 24 s after the cut instead of 12."""
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    owned_by_b(stream)
    stream.at(LEASE / 4, frame(1, 2, b""))  # b's last heartbeat: then it is cut off
    original_follow = stream.follow

    def follow_then_lose(reading: Reading, fresh_after: int = 0) -> None:
        original_follow(reading, fresh_after)
        if stream.follows == 1:
            stream.follower_lost = True  # the first follower brings nothing: its NATS node went with the cut

    stream.follow = follow_then_lose  # type: ignore[method-assign]
    started = clock.now
    records = list(replay_as_candidate(stream, standby(clock, stream)))
    assert stream.follows == 2  # the tail showed a frame the follower did not bring
    assert LEASE <= clock.now - started < LEASE + 1  # a lease after it last heard b, not after the catch-up
    assert records[-1] == b"W 2 node a"


def test_following_that_fails_is_tried_again_and_the_owner_is_not_claimed_meanwhile():
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    owned_by_b(stream)
    failures = iter([True, True, True])

    original_follow = stream.follow

    def flaky_follow(reading: Reading, fresh_after: int = 0) -> None:
        if next(failures, False):
            raise OSError("nats: no servers available for connection")
        original_follow(reading, fresh_after)

    stream.follow = flaky_follow  # type: ignore[method-assign]
    started = clock.now
    list(replay_as_candidate(stream, standby(clock, stream)))
    assert stream.follows == 1
    assert clock.now - started == pytest.approx(LEASE, abs=0.06)


def test_a_standby_reports_how_far_it_has_read():
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    owned_by_b(stream)
    heartbeats(stream, LEASE / 4, 3 * LEASE)
    cluster_map = FakeMap()
    list(replay_as_candidate(stream, standby(clock, stream, cluster_map)))
    assert cluster_map.reports[0] == 2  # at once: what the replay read
    assert len(cluster_map.reports) >= (3 * LEASE) // STANDBY_REPORT_SECONDS
    assert cluster_map.reports == sorted(cluster_map.reports) and cluster_map.reports[-1] > 2


def test_a_standby_that_read_nothing_new_reports_less_often_but_before_status_would_show_it_down():
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    owned_by_b(stream)  # and then silent: taken over after the lease
    cluster_map = FakeMap()
    list(replay_as_candidate(stream, standby(clock, stream, cluster_map)))
    assert cluster_map.reports == [2]  # at once; not again 10 s later with the same position (one R3 put saved)
    assert STANDBY_REPORT_SECONDS < STANDBY_IDLE_REPORT_SECONDS < STANDBY_DOWN_SECONDS


def balancing(cluster_map: FakeMap, node: Node) -> FakeStream:
    """A standby of node a, caught up, for long enough to balance a few times; the owner stays."""
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    owned_by_b(stream)
    heartbeats(stream, LEASE / 4, 4 * BALANCE_SECONDS)
    list(replay_as_candidate(stream, standby(clock, stream, cluster_map, node)))
    return stream


def test_a_node_that_owns_two_groups_fewer_than_the_owners_asks_for_the_group_once_per_turn():
    node = Node(owned=1)
    cluster_map = FakeMap(counts={"b": 3, "a": 1}, owner="b")
    balancing(cluster_map, node)
    assert cluster_map.asked == [("c-0-of-4", "a")]  # one ask: the node's turn is held until the group comes
    assert cluster_map.asked_of == ["b"]  # meant for the owner it counted: a newer one refuses it
    assert cluster_map.fresh_reads >= 1  # the pin read again right before asking


def test_a_group_its_owner_has_held_long_is_asked_for_only_once_the_counts_stay_uneven():
    """Issue 56: while a host was cut off, balancing among the others moved groups they had held all along. A group
    taken over lately (or one this standby began watching lately) is asked for at once; one held longer only after
    the counts have stayed uneven for UNEVEN_PATIENCE_SECONDS."""
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    cluster_map = FakeMap(counts={"b": 9, "a": 7}, owner="b")
    held_long = standby(clock, stream, cluster_map, Node(owned=7))
    clock.now += RECENT_OWNER_LEASES * LEASE  # watched b own it for three leases
    held_long.balance()
    clock.now += UNEVEN_PATIENCE_SECONDS - 1
    held_long.balance()
    assert cluster_map.asked == []
    clock.now += 1
    held_long.balance()
    assert cluster_map.asked == [("c-0-of-4", "a")]
    taken_lately = standby(clock, stream, FakeMap(counts={"b": 9, "a": 7}, owner="b"), Node(owned=7))
    taken_lately.balance()
    assert taken_lately.cluster_map.asked == [("c-0-of-4", "a")]  # type: ignore[attr-defined]


def test_a_node_whose_puts_to_the_map_do_not_go_through_does_not_ask_for_a_group_yet():
    """Issue 56: right after a heal, the healed node's reads worked and its puts timed out for 12 s; the groups it
    asked for and got had no owner reachable from the other nodes until its entries went through."""
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    owned_by_b(stream)
    heartbeats(stream, LEASE / 4, 4 * BALANCE_SECONDS)
    cluster_map = TimedMap(clock, counts={"b": 8, "a": 0}, owner="b")
    cluster_map.writable = [False, False]
    node = Node(owned=0)
    started = clock.now
    list(replay_as_candidate(stream, standby(clock, stream, cluster_map, node)))
    assert cluster_map.asked == [("c-0-of-4", "a")] and node.turns_ended == 2  # the turn ends at each refusal
    # at the third look, the first that can write; each look after a put that did not go through comes sooner than a
    # balancing period (issue 56: a put sent before NATS had elected the bucket's leader held the turn 5 s, and the
    # next look came 5 s later still)
    assert 2 * BALANCE_RETRY_SECONDS <= cluster_map.asked_at[0] - started < BALANCE_SECONDS


def test_a_standby_whose_node_is_pulling_another_group_asks_soon_after_that_pull_ends():
    """Issue 56: a healed node's standbys all stood by again at the moment NATS answered, looked at balancing
    together, and all but the one that took the node's turn looked again a balancing period later: the healed node got
    a group every 5 s."""
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    owned_by_b(stream)
    heartbeats(stream, LEASE / 4, 4 * BALANCE_SECONDS)
    cluster_map = TimedMap(clock, counts={"b": 8, "a": 1}, owner="b")
    node = Node(owned=1)
    node.turn_taken = True  # another standby of node a is pulling its group: it comes 1.5 s from now
    started = clock.now
    original_read = stream.read_followed

    def ending_the_pull(reading: Reading, timeout: float) -> tuple[bool, list[bytes]]:
        heard, records = original_read(reading, timeout)
        if clock.now - started >= 1.5 and not node.turns_ended:
            node.end_pull()  # the other group is owned here now: the turn is over
        return heard, records

    stream.read_followed = ending_the_pull  # type: ignore[method-assign]
    list(replay_as_candidate(stream, standby(clock, stream, cluster_map, node)))
    assert cluster_map.asked == [("c-0-of-4", "a")]
    assert cluster_map.asked_at[0] - started <= 1.5 + BALANCE_RETRY_SECONDS + 0.1  # not a balancing period later


def test_a_standby_whose_map_is_behind_looks_at_balancing_again_soon():
    """Issue 56 (the partition test): a healed node's owner stepped down after the heal and stood by at once, while
    its process's map still named this node the owner (the watch was being made again); its next look came a
    balancing period later, 5.3 s after NATS was healthy."""
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 2)")
    owned_by_b(stream)
    heartbeats(stream, LEASE / 4, 4 * BALANCE_SECONDS)
    cluster_map = TimedMap(clock, counts={"a": 3}, owner="a")  # this node's old entry: the map is behind
    started = clock.now
    original_view = cluster_map.balance_view

    def catching_up(fresh_pin: bool = False) -> tuple[dict[str, int], str | None, str | None]:
        if clock.now - started >= 0.5:  # the watch brings the new owners' entries
            cluster_map.view = ({"b": 3, "c": 3}, "b", None)
        return original_view(fresh_pin)

    cluster_map.balance_view = catching_up  # type: ignore[method-assign]
    list(replay_as_candidate(stream, standby(clock, stream, cluster_map, Node(owned=0))))
    assert cluster_map.asked == [("c-0-of-4", "a")]
    assert cluster_map.asked_at[0] - started <= 0.5 + BALANCE_RETRY_SECONDS + 0.1


def test_a_refused_ask_ends_the_nodes_turn_so_it_may_ask_again():
    node = Node(owned=0)
    cluster_map = FakeMap(counts={"b": 2}, owner="b", answer={"ok": False, "to": "c"})
    balancing(cluster_map, node)
    assert len(cluster_map.asked) >= 2 and node.turns_ended == len(cluster_map.asked)


def test_no_ask_when_the_counts_are_close_or_the_group_is_pinned_elsewhere_or_owned_here():
    for cluster_map, node in ((FakeMap(counts={"b": 2, "a": 1}, owner="b"), Node(owned=1)),
                              (FakeMap(counts={"b": 5}, owner="b", pin="b"), Node(owned=0)),
                              (FakeMap(counts={"a": 1}, owner="a"), Node(owned=1)),
                              (FakeMap(), Node())):
        balancing(cluster_map, node)
        assert cluster_map.asked == [], cluster_map.view


def test_a_group_pinned_to_this_node_is_asked_for_whatever_the_counts():
    cluster_map = FakeMap(counts={"b": 1, "a": 4}, owner="b", pin="a")
    balancing(cluster_map, Node(owned=4))
    assert cluster_map.asked == [("c-0-of-4", "a")]


class TimedMap(FakeMap):
    """A FakeMap that notes when it was asked, in fake time."""

    def __init__(self, clock: Clock, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.clock = clock
        self.asked_at: list[float] = []

    def ask_for_group(self, stream: str, node: str, of_node: str | None = None) -> dict[str, Any]:
        self.asked_at.append(self.clock.now)
        return super().ask_for_group(stream, node, of_node)


def test_a_busy_groups_standby_looks_at_balancing_though_it_hears_frames_at_every_read():
    """Issue 56: a standby balanced only after a read that heard nothing, so the standbys of groups under load (a
    frame every read) never asked, and a healed node got groups back only once their load paused."""
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    owned_by_b(stream)
    busy = 4 * BALANCE_SECONDS
    for k in range(int(busy / 0.04)):  # a publish stored every 40 ms: every read hears one (then b goes silent)
        stream.at((k + 1) * 0.04, frame(1, k + 2, b"P %d" % k))
    cluster_map = TimedMap(clock, counts={"b": 8, "a": 0}, owner="b")
    started = clock.now
    list(replay_as_candidate(stream, standby(clock, stream, cluster_map, Node(owned=0))))
    assert cluster_map.asked == [("c-0-of-4", "a")]
    assert cluster_map.asked_at[0] - started < busy  # while b was storing frames, not once it went quiet


def test_a_standby_looks_at_balancing_as_soon_as_it_stands_by():
    """A node that rejoins (a heal, a restart) asks for a group once caught up, not a balancing period later."""
    clock = Clock()
    stream = FakeStream(clock, owner="node b (epoch 1)")
    owned_by_b(stream)
    heartbeats(stream, LEASE / 4, 2 * BALANCE_SECONDS)
    cluster_map = TimedMap(clock, counts={"b": 8, "a": 0}, owner="b")
    started = clock.now
    list(replay_as_candidate(stream, standby(clock, stream, cluster_map, Node(owned=0))))
    assert cluster_map.asked_at and cluster_map.asked_at[0] - started < 1.0

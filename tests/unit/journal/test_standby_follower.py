"""A standby's follower (server/journal/stream_reader.py): frames pushed by NATS reach the hub in order, once, with
one wake per batch; a gap in the consumer's count (a frame lost to a slow consumer) follows again from the missing
frame; gaps in stream sequences alone (a stream shared with other groups) are not losses; a replaced follower's
late frames and NATS's status messages are ignored; an idle owner's heartbeat (a core NATS message) is heard once the
follower has every frame it says is stored; a replay reads to the tail and takes the stream over, fenced on it. In
process, over a fake hub connection and bridge."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from gevent.event import Event

pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")

from mqks.server.journal import records, stream_reader
from mqks.server.journal.jetstream_log import EPOCH, FRAME, LAST, MORE, OWNER, JetStreamLog, StreamReading
from mqks.server.journal.stream import EXPECTED
from mqks.server.nats_io.hub_nats import ack_sequences

pytestmark = pytest.mark.timeout(10)


class FakeHub:
    """What the follower uses of the hub's NATS connection: inboxes and subscriptions (recorded)."""

    def __init__(self) -> None:
        self.inboxes = 0
        self.subscriptions: list[SimpleNamespace] = []
        self.syncs = 0

    def new_inbox(self) -> str:
        self.inboxes += 1
        return f"_INBOX.{self.inboxes}"

    def subscribe(self, subject: str, callback: Any) -> int:
        self.subscriptions.append(SimpleNamespace(subject=subject, cb=callback, active=True))
        return len(self.subscriptions) - 1

    def unsubscribe(self, sid: int) -> None:
        self.subscriptions[sid].active = False

    def sync(self, timeout: float = 5.0) -> None:
        self.syncs += 1


class FakeBridge:
    """The bridge as the follower's JetStream API calls see it: the consumers it adds (recorded)."""

    def __init__(self, hub: FakeHub) -> None:
        self.hub = hub
        self.consumers: list[Any] = []

    def hub_nats(self) -> FakeHub:
        return self.hub

    def jetstream(self, timeout: float = 5.0) -> Any:
        async def add_consumer(stream: str, config: Any) -> None:
            assert self.hub.syncs, "the consumer was made before NATS had the subscription it delivers to"
            self.consumers.append((stream, config))

        return SimpleNamespace(_jsm=SimpleNamespace(add_consumer=add_consumer))

    def run(self, make: Callable[[Any], Any], timeout: float = 10.0) -> Any:
        return asyncio.run(make(self))


def frame(seq: int, delivery: int, data: bytes = b"x", headers: dict[str, str] | None = None) -> tuple[Any, ...]:
    """The message at stream sequence `seq`, the consumer's `delivery`-th, as the hub connection hands it over."""
    return ("_INBOX.x", f"$JS.ACK.s.follower.1.{seq}.{delivery}.1700000000.0", headers or {"Mqks-Epoch": "1"}, data)


def with_fakes(stream_log: JetStreamLog) -> tuple[JetStreamLog, FakeHub, FakeBridge]:
    hub = FakeHub()
    bridge = FakeBridge(hub)
    stream_log.nats.bridge = bridge  # type: ignore[assignment]
    return stream_log, hub, bridge


def new_log() -> tuple[JetStreamLog, FakeHub, FakeBridge]:
    return with_fakes(JetStreamLog(["nats://127.0.0.1:1"], "s-0-of-2", "test"))


def shared_log(hears_beats: bool = False) -> tuple[JetStreamLog, FakeHub, FakeBridge]:
    """A group's log in a shared stream; `hears_beats`: a leased group's, whose reader hears its owner's heartbeats."""
    stream_log = JetStreamLog(["nats://127.0.0.1:1"], "s-g4-s0-of-1", "test", group="s-2-of-4",
                              stream_subjects=[f"mqks.log.s-{g}-of-4" for g in range(4)])
    stream_log.reader.hears_beats = hears_beats
    return with_fakes(stream_log)


class CountingEvent(Event):
    """The follower's event, counting how often the follower wakes the waiting hub."""

    wakes = 0

    def set(self) -> None:
        self.wakes += 1
        super().set()


def test_frames_reach_the_hub_in_order_with_one_wake_per_batch() -> None:
    stream_log, hub, bridge = new_log()
    stream_log.reader._follow_event = event = CountingEvent()
    stream_log.reader._follow(start_seq=5)
    cb = hub.subscriptions[-1].cb
    for delivery, seq in enumerate((5, 6, 7), 1):
        cb(*frame(seq, delivery, b"f%d" % seq))
    (stream, config), = bridge.consumers
    assert (stream, config.opt_start_seq, config.deliver_subject) == ("s-0-of-2", 5, hub.subscriptions[-1].subject)
    assert config.num_replicas == 1 and config.mem_storage  # no raft group of its own on NATS
    assert event.wakes == 1
    assert stream_log.reader._follow_event.is_set()
    assert [(seq, data) for seq, _, data in stream_log.reader._take_followed()] == [(5, b"f5"), (6, b"f6"), (7, b"f7")]
    assert not stream_log.reader._follow_event.is_set() and stream_log.reader._take_followed() == []


def test_the_stream_and_consumer_sequences_come_from_either_form_of_the_ack_subject() -> None:
    assert ack_sequences("$JS.ACK.s.follower.1.41.7.1700000000.0") == (41, 7)
    assert ack_sequences("$JS.ACK.hub.ACCHASH.s.follower.1.41.7.1700000000.0.r4nd") == (41, 7)


def test_a_duplicate_is_dropped_and_status_messages_are_not_frames() -> None:
    stream_log, hub, _ = new_log()
    stream_log.reader._follow(start_seq=1)
    cb = hub.subscriptions[-1].cb
    cb(*frame(1, 1))
    cb(*frame(1, 1))  # delivered twice
    cb("_INBOX.x", "", {"Status": "100", "Description": "Idle Heartbeat"}, b"")
    cb(*frame(2, 2))
    assert [seq for seq, _, _ in stream_log.reader._take_followed()] == [1, 2]


def test_a_gap_follows_again_from_the_missing_frame_keeping_what_came_before() -> None:
    stream_log, hub, bridge = new_log()
    stream_log.reader._follow(start_seq=1)
    first = hub.subscriptions[-1]
    first.cb(*frame(1, 1))
    first.cb(*frame(2, 2))
    first.cb(*frame(4, 4))  # 3 was lost
    assert stream_log.reader._refollowing is not None
    stream_log.reader._refollowing.join(timeout=2)  # the new follower is made in a greenlet of its own
    assert not first.active
    second = hub.subscriptions[-1]
    assert second is not first
    first.cb(*frame(5, 5))  # the replaced follower's late frame
    second.cb(*frame(3, 1))
    second.cb(*frame(4, 2))
    assert [config.opt_start_seq for _, config in bridge.consumers] == [1, 3]
    assert [seq for seq, _, _ in stream_log.reader._take_followed()] == [1, 2, 3, 4]


def test_following_anew_drops_frames_the_hub_has_not_taken() -> None:
    """The hub follows anew after the last sequence it applied: frames still queued would come twice."""
    stream_log, hub, _ = new_log()
    stream_log.reader._follow(start_seq=1)
    hub.subscriptions[-1].cb(*frame(1, 1))
    hub.subscriptions[-1].cb(*frame(2, 2))
    stream_log.reader._follow(start_seq=1)
    hub.subscriptions[-1].cb(*frame(1, 1))
    assert [seq for seq, _, _ in stream_log.reader._take_followed()] == [1]


def test_a_group_of_a_shared_stream_follows_its_subject_and_skips_no_frame_for_the_others() -> None:
    """The other groups' frames take the sequences between this group's: the consumer counts 1, 2, 3 all the same."""
    stream_log, hub, bridge = shared_log()
    stream_log.reader._follow(start_seq=5)
    for delivery, seq in enumerate((5, 9, 12), 1):
        hub.subscriptions[-1].cb(*frame(seq, delivery))
    (stream, config), = bridge.consumers  # followed once: no gap seen
    assert (stream, config.filter_subject) == ("s-g4-s0-of-1", "mqks.log.s-2-of-4")
    assert [seq for seq, _, _ in stream_log.reader._take_followed()] == [5, 9, 12]


def test_an_idle_owners_heartbeat_is_heard_once_the_follower_has_every_frame_it_names() -> None:
    stream_log, hub, _ = shared_log(hears_beats=True)
    reading = StreamReading()
    reading.read, reading.replayer.epoch = 4, 2

    def beat(epoch: int, last: int) -> tuple[Any, ...]:
        return "mqks.beat.s-2-of-4", "", {EPOCH: str(epoch), LAST: str(last)}, b""

    def heard() -> bool:
        got, records = stream_log.read_followed(reading, 0)
        assert records == []
        return got

    stream_log.reader._follow(start_seq=5)
    follower, beats = hub.subscriptions
    assert beats.subject == "mqks.beat.s-2-of-4"
    assert not heard()
    beats.cb(*beat(2, 4))
    assert heard()
    assert not heard()  # once per heartbeat
    beats.cb(*beat(2, 9))  # frame 9 is stored and the follower has not brought it: not yet
    assert not heard()
    follower.cb(*frame(9, 1, b"", {EPOCH: "2", "Mqks-Frame": "1"}))
    assert heard() and reading.read == 9  # the frame itself
    beats.cb(*beat(2, 9))
    assert heard()
    beats.cb(*beat(1, 9))  # a taken-over owner that has not noticed yet
    assert not heard()
    stream_log.reader._stop_following()
    assert not follower.active and not beats.active


class StoredStream(FakeBridge):
    """A stream of its own holding `messages` (headers, data), read by a pull reader whose first fetch fails (a 503
    while the stream's leader settles); no broker answers its owner ping; the takeover's PubAck names the next
    sequence."""

    def __init__(self, hub: FakeHub, messages: list[tuple[dict[str, str], bytes]]) -> None:
        super().__init__(hub)
        self.messages = messages
        self.fetches = 0
        self.takeover_headers: dict[str, str] = {}

    def jetstream(self, timeout: float = 5.0) -> Any:
        bridge = self

        class Reader:
            next_seq = 1

            async def fetch(self, batch: int, timeout: float) -> list[Any]:
                bridge.fetches += 1
                if bridge.fetches == 1:
                    raise RuntimeError("503: no stream leader yet")
                taken = bridge.messages[self.next_seq - 1:self.next_seq - 1 + min(batch, 2)]
                msgs = [SimpleNamespace(metadata=SimpleNamespace(sequence=SimpleNamespace(stream=self.next_seq + i)),
                                        headers=headers, data=data) for i, (headers, data) in enumerate(taken)]
                self.next_seq += len(msgs)
                return msgs

            async def unsubscribe(self) -> None:
                pass

        async def pull_subscribe(subject: str, durable: Any, stream: str, config: Any) -> Reader:
            reader = Reader()
            reader.next_seq = config.opt_start_seq or 1
            return reader

        async def stream_info(stream: str, subjects_filter: str | None = None) -> Any:
            state = SimpleNamespace(bytes=0, messages=len(self.messages), last_seq=len(self.messages))
            return SimpleNamespace(state=state, cluster=None)

        return SimpleNamespace(pull_subscribe=pull_subscribe, stream_info=stream_info)

    async def request(self, subject: str, data: bytes, timeout: float, headers: dict[str, str] | None = None) -> Any:
        from nats.errors import NoRespondersError

        if subject.startswith("mqks.owner."):
            raise NoRespondersError
        self.takeover_headers = dict(headers or {})
        return SimpleNamespace(data=json.dumps({"stream": "s", "seq": len(self.messages) + 1}).encode())


def test_a_replay_reads_to_the_tail_through_a_failed_read_and_takes_the_stream_over_fenced_on_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`mqksd --log`: every frame that counts, in order (a frame in parts joined, an old writer's late frame
    dropped), then the takeover (epoch + 1) expecting the last sequence read, and the writer starts after it."""
    monkeypatch.setattr(stream_reader, "RETRY_SECONDS", 0.01)
    hub = FakeHub()
    hub.reconnects = 0  # type: ignore[attr-defined]
    hub.publish = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    messages = [({EPOCH: "1", FRAME: "0", OWNER: "node a"}, b"T1"),
                ({EPOCH: "1", FRAME: "1"}, b"r1\nr2"),
                ({EPOCH: "2", FRAME: "0", OWNER: "node b"}, b"T2"),
                ({EPOCH: "1", FRAME: "2"}, b"zombie"),  # node a's frame stored after node b took over
                ({EPOCH: "2", FRAME: "1", MORE: "1"}, b"r3-"),
                ({EPOCH: "2", FRAME: "2"}, b"end")]
    stream_log = JetStreamLog(["nats://127.0.0.1:1"], "s", "node c")
    bridge = StoredStream(hub, messages)
    stream_log.nats.bridge = bridge  # type: ignore[assignment]
    replayed = list(stream_log.replay())
    stream_log.writer._stopping = True  # the writer greenlet starts and ends: this test is about the reader
    assert replayed[:-1] == [b"T1", b"r1", b"r2", b"T2", b"r3-end"]
    assert replayed[-1] == records.takeover(3, b"node c")
    assert bridge.fetches >= 3  # the failed read was made again, from where it stopped
    assert bridge.takeover_headers[EXPECTED] == "6" and bridge.takeover_headers[EPOCH] == "3"
    assert (stream_log.epoch, stream_log.writer.tail_seq) == (3, 7)
    figures = stream_log.stats()
    assert figures["replayed_records"] == 5 and figures["ignored_frames"] == 1  # the takeover of its own aside

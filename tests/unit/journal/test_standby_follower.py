"""A standby's follower (server/journal/jetstream_log.py): frames pushed by NATS reach the hub in order, once, with
one wake per batch; a gap in the consumer's count (a frame lost to a slow consumer) follows again from the missing
frame; gaps in stream sequences alone (a stream shared with other groups) are not losses; a replaced follower's
late frames and NATS's status messages are ignored; an idle owner's heartbeat (a core NATS message) is heard once the
follower has every frame it says is stored. In process, over a fake NATS connection."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")

from mqks.server.journal.jetstream_log import EPOCH, LAST, JetStreamLog, StreamReading

pytestmark = pytest.mark.timeout(10)


class FakeNats:
    """What the follower uses of nats-py: inboxes, subscriptions, and the consumers it adds (recorded)."""

    def __init__(self) -> None:
        self.inboxes = 0
        self.consumers: list[Any] = []
        self.subscriptions: list[SimpleNamespace] = []

    def new_inbox(self) -> str:
        self.inboxes += 1
        return f"_INBOX.{self.inboxes}"

    async def subscribe(self, subject: str, cb: Any) -> SimpleNamespace:
        async def unsubscribe() -> None:
            sub.active = False

        sub = SimpleNamespace(subject=subject, cb=cb, active=True, unsubscribe=unsubscribe)
        self.subscriptions.append(sub)
        return sub

    def jetstream(self, timeout: float = 5.0) -> Any:
        async def add_consumer(stream: str, config: Any) -> None:
            self.consumers.append((stream, config))

        return SimpleNamespace(_jsm=SimpleNamespace(add_consumer=add_consumer))


def frame(seq: int, delivery: int, data: bytes = b"x", headers: dict[str, str] | None = None) -> Any:
    """The message at stream sequence `seq`, the consumer's `delivery`-th."""
    return SimpleNamespace(data=data, headers=headers or {"Mqks-Epoch": "1"},
                           metadata=SimpleNamespace(sequence=SimpleNamespace(stream=seq, consumer=delivery)))


def new_log() -> tuple[JetStreamLog, FakeNats]:
    stream_log = JetStreamLog(["nats://127.0.0.1:1"], "s-0-of-2", "test")
    nc = FakeNats()
    stream_log.bridge.nc = nc
    return stream_log, nc


def hub_wakes(stream_log: JetStreamLog) -> int:
    """Run what the asyncio side queued for the hub; how many callbacks there were."""
    count = len(stream_log.bridge.results)
    stream_log.bridge.drain()
    return count


def test_frames_reach_the_hub_in_order_with_one_wake_per_batch() -> None:
    stream_log, nc = new_log()

    async def scenario() -> None:
        await stream_log._follow(nc, start_seq=5)
        cb = nc.subscriptions[-1].cb
        for delivery, seq in enumerate((5, 6, 7), 1):
            await cb(frame(seq, delivery, b"f%d" % seq))

    asyncio.run(scenario())
    (stream, config), = nc.consumers
    assert (stream, config.opt_start_seq, config.deliver_subject) == ("s-0-of-2", 5, nc.subscriptions[-1].subject)
    assert config.num_replicas == 1 and config.mem_storage  # no raft group of its own on NATS
    assert hub_wakes(stream_log) == 1
    assert stream_log._follow_event.is_set()
    assert [(seq, data) for seq, _, data in stream_log._take_followed()] == [(5, b"f5"), (6, b"f6"), (7, b"f7")]
    assert not stream_log._follow_event.is_set() and stream_log._take_followed() == []


def test_a_duplicate_is_dropped_and_status_messages_are_not_frames() -> None:
    stream_log, nc = new_log()

    async def scenario() -> None:
        await stream_log._follow(nc, start_seq=1)
        cb = nc.subscriptions[-1].cb
        await cb(frame(1, 1))
        await cb(frame(1, 1))  # delivered twice
        await cb(SimpleNamespace(data=b"", headers={"Status": "100", "Description": "Idle Heartbeat"}))
        await cb(frame(2, 2))

    asyncio.run(scenario())
    assert [seq for seq, _, _ in stream_log._take_followed()] == [1, 2]


def test_a_gap_follows_again_from_the_missing_frame_keeping_what_came_before() -> None:
    stream_log, nc = new_log()

    async def scenario() -> None:
        await stream_log._follow(nc, start_seq=1)
        first = nc.subscriptions[-1]
        await first.cb(frame(1, 1))
        await first.cb(frame(2, 2))
        await first.cb(frame(4, 4))  # 3 was lost
        await asyncio.sleep(0)  # the new follower is made in a task of its own
        await asyncio.sleep(0)
        assert not first.active
        second = nc.subscriptions[-1]
        assert second is not first
        await first.cb(frame(5, 5))  # the replaced follower's late frame
        await second.cb(frame(3, 1))
        await second.cb(frame(4, 2))

    asyncio.run(scenario())
    assert [config.opt_start_seq for _, config in nc.consumers] == [1, 3]
    assert [seq for seq, _, _ in stream_log._take_followed()] == [1, 2, 3, 4]


def test_following_anew_drops_frames_the_hub_has_not_taken() -> None:
    """The hub follows anew after the last sequence it applied: frames still queued would come twice."""
    stream_log, nc = new_log()

    async def scenario() -> None:
        await stream_log._follow(nc, start_seq=1)
        await nc.subscriptions[-1].cb(frame(1, 1))
        await nc.subscriptions[-1].cb(frame(2, 2))
        await stream_log._follow(nc, start_seq=1)
        await nc.subscriptions[-1].cb(frame(1, 1))

    asyncio.run(scenario())
    assert [seq for seq, _, _ in stream_log._take_followed()] == [1]


def test_a_group_of_a_shared_stream_follows_its_subject_and_skips_no_frame_for_the_others() -> None:
    """The other groups' frames take the sequences between this group's: the consumer counts 1, 2, 3 all the same."""
    stream_log = JetStreamLog(["nats://127.0.0.1:1"], "s-g4-s0-of-1", "test", group="s-2-of-4",
                              stream_subjects=[f"mqks.log.s-{g}-of-4" for g in range(4)])
    nc = FakeNats()
    stream_log.bridge.nc = nc

    async def scenario() -> None:
        await stream_log._follow(nc, start_seq=5)
        for delivery, seq in enumerate((5, 9, 12), 1):
            await nc.subscriptions[-1].cb(frame(seq, delivery))

    asyncio.run(scenario())
    (stream, config), = nc.consumers  # followed once: no gap seen
    assert (stream, config.filter_subject) == ("s-g4-s0-of-1", "mqks.log.s-2-of-4")
    assert [seq for seq, _, _ in stream_log._take_followed()] == [5, 9, 12]


def test_an_idle_owners_heartbeat_is_heard_once_the_follower_has_every_frame_it_names() -> None:
    stream_log = JetStreamLog(["nats://127.0.0.1:1"], "s-g4-s0-of-1", "test", group="s-2-of-4",
                              stream_subjects=[f"mqks.log.s-{g}-of-4" for g in range(4)], lease_seconds=12.0)
    nc = FakeNats()
    stream_log.bridge.nc = nc
    reading = StreamReading()
    reading.read, reading.replayer.epoch = 4, 2

    def beat(epoch: int, last: int) -> Any:
        return SimpleNamespace(data=b"", headers={EPOCH: str(epoch), LAST: str(last)})

    def heard() -> bool:
        stream_log.bridge.drain()  # the hub's side
        got, records = stream_log.read_followed(reading, 0)
        assert records == []
        return got

    asyncio.run(stream_log._follow(nc, start_seq=5))
    follower, beats = nc.subscriptions
    assert beats.subject == "mqks.beat.s-2-of-4"
    assert not heard()
    asyncio.run(beats.cb(beat(2, 4)))
    assert heard()
    assert not heard()  # once per heartbeat
    asyncio.run(beats.cb(beat(2, 9)))  # frame 9 is stored and the follower has not brought it: not yet
    assert not heard()
    asyncio.run(follower.cb(frame(9, 1, b"", {EPOCH: "2", "Mqks-Frame": "1"})))
    assert heard() and reading.read == 9  # the frame itself
    asyncio.run(beats.cb(beat(2, 9)))
    assert heard()
    asyncio.run(beats.cb(beat(1, 9)))  # a taken-over owner that has not noticed yet
    assert not heard()
    asyncio.run(stream_log._stop_following(nc))
    assert not follower.active and not beats.active

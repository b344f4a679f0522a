"""The replicated log's frame replayer (server/journal/stream_reader.py: Replayer) on frames as a stream holds
them: frames of one writer in counter order whatever order they were stored in, a frame in parts joined, a frame
stored twice read once, a taken-over writer's late frames ignored, heartbeats empty, a hand-off remembered."""

from __future__ import annotations

import pytest

pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")

from mqks.server.journal.jetstream_log import EPOCH, FRAME, HANDOFF, MORE, OWNER, SNAPSHOT, Replayer

pytestmark = pytest.mark.timeout(10)


def headers(epoch: int, k: int, **more: str) -> dict[str, str]:
    return {EPOCH: str(epoch), FRAME: str(k), **more}


def takeover(replayer: Replayer, epoch: int, owner: str = "node a") -> list[bytes]:
    record = b"W %d %b" % (epoch, owner.encode())
    return replayer.feed(headers(epoch, 0, **{OWNER: owner}), record)


def test_frames_stored_out_of_order_come_out_in_counter_order():
    replayer = Replayer()
    assert takeover(replayer, 1) == [b"W 1 node a"]
    assert replayer.feed(headers(1, 2), b"P c\nP d") == []  # frame 1 is not there yet
    assert replayer.feed(headers(1, 3), b"P e") == []
    assert replayer.feed(headers(1, 1), b"P a\nP b") == [b"P a", b"P b", b"P c", b"P d", b"P e"]
    assert replayer.frames == 4 and replayer.owner == "node a"


def test_a_frame_in_parts_is_one_frame_once_its_last_part_is_read():
    replayer = Replayer()
    takeover(replayer, 1)
    assert replayer.feed(headers(1, 1, **{MORE: "1"}), b"P big-") == []
    assert replayer.feed(headers(1, 2, **{MORE: "1"}), b"and-") == []
    assert replayer.feed(headers(1, 3), b"long\nP next") == [b"P big-and-long", b"P next"]


def test_a_frame_stored_twice_is_read_once_and_a_heartbeat_holds_no_record():
    replayer = Replayer()
    takeover(replayer, 1)
    assert replayer.feed(headers(1, 1), b"P a") == [b"P a"]
    assert replayer.feed(headers(1, 1), b"P a") == []
    assert replayer.feed(headers(1, 2), b"") == []  # an idle owner's heartbeat
    assert replayer.feed(headers(1, 3), b"P b") == [b"P b"]


def test_a_taken_over_writers_late_frames_are_ignored():
    replayer = Replayer()
    takeover(replayer, 1)
    assert replayer.feed(headers(1, 1), b"P old") == [b"P old"]
    assert replayer.feed(headers(1, 3), b"P waits-for-2") == []
    assert takeover(replayer, 2, "node b") == [b"W 2 node b"]  # frame 3 of epoch 1 is dropped with it
    assert replayer.feed(headers(1, 2), b"P zombie") == []
    assert replayer.feed(headers(2, 1), b"P new") == [b"P new"]
    assert (replayer.epoch, replayer.owner, replayer.ignored) == (2, "node b", 1)


def test_a_reader_that_starts_at_a_snapshot_left_by_a_purge_reads_from_it():
    """The frames before a snapshot were purged: the snapshot's first frame stands for them."""
    replayer = Replayer()
    assert replayer.feed(headers(3, 40, **{SNAPSHOT: "1"}), b"SB\nN q 5") == [b"SB", b"N q 5"]
    assert replayer.feed(headers(3, 41), b"SE") == [b"SE"]
    assert replayer.epoch == 3


def test_a_hand_off_is_what_the_last_frame_read_names():
    replayer = Replayer()
    takeover(replayer, 1)
    replayer.feed(headers(1, 1, **{HANDOFF: "c"}), b"")
    assert replayer.handoff == "c"
    replayer.feed(headers(1, 2), b"P after")
    assert replayer.handoff is None

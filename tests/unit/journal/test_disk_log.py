"""The write-ahead log's storage on real files, in process: round trips, fsync policies, torn tails, corruption
(a full disk and a process out of descriptors are in tests/e2e/test_log.py: they need a process of their own).

Frames are read back only through `replay()`, except where a test cuts or flips bytes: those
tests find frame boundaries from the documented header (`<II`: payload length, crc32).
Nothing sleeps and hopes: durability is awaited through the `wake` callable and `poll()`, with
a deadline.
"""

from __future__ import annotations

import logging
import random
import struct
import threading
import time
from pathlib import Path

import pytest
from waiting import WAIT_SECONDS, wait_for

from mqks.server.journal.log import HEADER_BYTES, Log, LogCorrupt

pytestmark = pytest.mark.timeout(60)

def frame_records(frame: int, count: int) -> list[bytes]:
    """The records of test frame `frame`: distinct, so an order or a loss shows."""
    return [b"P %d %d " % (frame, i) + b"d" * (i % 7) for i in range(count)]


def wait_durable(log: Log, wake: threading.Event, number: int) -> list[int]:
    """Poll until commit `number` is durable; return the commits reported failed on the way."""
    failed: list[int] = []
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        wake.clear()  # before poll: a wake that comes after it is not lost
        durable, newly = log.poll()
        failed += newly
        if durable >= number:
            return failed
        assert time.monotonic() < deadline, f"commit {number} not durable after {WAIT_SECONDS:g}s (at {durable})"
        wake.wait(0.1)


def write_frames(data_dir: Path, counts: list[int], **options) -> list[list[bytes]]:
    """Commit one frame per count, close the log, and return each frame's records."""
    log = Log(str(data_dir), **options)
    frames = []
    for frame, count in enumerate(counts):
        records = frame_records(frame, count)
        for record in records:
            log.append(record)
        assert log.commit() == frame + 1
        frames.append(records)
    log.close()
    return frames


def replay_all(data_dir: Path, repair: bool = False) -> tuple[list[bytes], dict]:
    """Replay the log in `data_dir` to the end on a fresh Log; its records and stats."""
    log = Log(str(data_dir))
    try:
        return list(log.replay(repair=repair)), log.stats()
    finally:
        log.close()


def segments(data_dir: Path) -> list[Path]:
    return sorted(data_dir.glob("*.log"))


def frame_offsets(data: bytes) -> list[int]:
    """The offset where each whole frame in `data` starts, and then the end of the last one."""
    offsets = [0]
    while offsets[-1] + HEADER_BYTES <= len(data):
        (size,) = struct.unpack_from("<I", data, offsets[-1])
        if offsets[-1] + HEADER_BYTES + size > len(data):
            break
        offsets.append(offsets[-1] + HEADER_BYTES + size)
    return offsets


def flatten(frames: list[list[bytes]]) -> list[bytes]:
    return [record for records in frames for record in records]


def test_records_round_trip_in_order_across_segments(tmp_path):
    data_dir = tmp_path / "log"
    wake = threading.Event()
    log = Log(str(data_dir), segment_bytes=512, wake=wake.set)
    append = log.append  # bound once, as the broker does: it must stay the open batch's
    frames = []
    for frame in range(200):
        records = frame_records(frame, 1 + frame % 7)
        for record in records:
            append(record)
        assert log.commit() == frame + 1
        frames.append(records)
    assert log.commit() is None  # an empty batch makes no frame
    assert wait_durable(log, wake, 200) == []
    log.close()
    assert len(segments(data_dir)) > 5

    log = Log(str(data_dir), segment_bytes=512, wake=wake.set)
    assert list(log.replay()) == flatten(frames)
    # after replay the next commits continue the log
    for record in frame_records(200, 3):
        log.append(record)
    assert log.commit() == 1
    log.close()
    records, stats = replay_all(data_dir)
    assert records == flatten(frames) + frame_records(200, 3)
    assert stats["replayed_records"] == len(records)
    assert stats["truncated_bytes"] == 0


def test_commit_before_replaying_an_existing_log_is_refused(tmp_path):
    data_dir = tmp_path / "log"
    write_frames(data_dir, [2])
    log = Log(str(data_dir))
    log.append(b"x")
    with pytest.raises(RuntimeError, match="replay"):
        log.commit()
    assert list(log.replay()) == frame_records(0, 2)
    assert log.commit() == 1
    log.close()


@pytest.mark.parametrize("fsync", ["always", "everysec", "no"])
def test_poll_reports_commits_durable_under_each_fsync_policy(tmp_path, fsync):
    data_dir = tmp_path / "log"
    wake = threading.Event()
    log = Log(str(data_dir), fsync=fsync, wake=wake.set)
    frames = []
    for frame in range(50):
        frames.append(frame_records(frame, 64))
        for record in frames[-1]:
            log.append(record)
        log.commit()
    assert wait_durable(log, wake, 50) == []
    assert log.unsynced_bytes == 0
    if fsync == "always":
        assert log.stats()["fsyncs"] >= 1
    elif fsync == "everysec":
        # the last writes before a quiet period are synced within a second, not left to the OS
        wait_for(lambda: log.stats()["fsyncs"] >= 1, "the everysec sync after the writes stopped")
    else:
        assert log.stats()["fsyncs"] == 0
    log.close()
    assert replay_all(data_dir)[0] == flatten(frames)


def test_torn_tail_is_truncated_at_every_cut(tmp_path, caplog):
    source = tmp_path / "source"
    frames = write_frames(source, [3, 1, 4, 2, 5], fsync="no")
    [segment] = segments(source)
    data = segment.read_bytes()
    offsets = frame_offsets(data)
    assert offsets[-1] == len(data) and len(offsets) == 6
    # every cut inside the last frame (its header included), and some anywhere in the log
    cuts = list(range(offsets[-2], len(data))) + random.Random(7).sample(range(1, offsets[-2]), 12)
    for cut in cuts:
        data_dir = tmp_path / f"cut-{cut}"
        data_dir.mkdir()
        path = data_dir / segment.name
        path.write_bytes(data[:cut])
        whole = sum(1 for end in offsets[1:] if end <= cut)
        start = offsets[whole]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mqks.log"):
            records, stats = replay_all(data_dir)
        assert records == flatten(frames[:whole]), f"cut at {cut}"
        assert stats["truncated_bytes"] == cut - start
        assert path.stat().st_size == start
        if cut > start:
            [message] = [r.getMessage() for r in caplog.records if r.name == "mqks.log"]
            assert f"{path}: torn frame at offset {start}" in message
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mqks.log"):
            again, stats = replay_all(data_dir)
        assert again == records and stats["truncated_bytes"] == 0 and not caplog.records


@pytest.mark.parametrize("damage", ["zeroed end", "zero-filled tail"])
def test_a_last_frame_with_a_torn_writes_trace_is_cut(tmp_path, damage):
    data_dir = tmp_path / "log"
    frames = write_frames(data_dir, [2, 3, 4], fsync="no")
    [segment] = segments(data_dir)
    data = bytearray(segment.read_bytes())
    start = frame_offsets(bytes(data))[2]
    if damage == "zeroed end":
        data[-3:] = bytes(3)  # its last sector never reached the disk: the checksum fails, zeros remain
    else:
        data += bytes(4096)  # what a filesystem may leave past the last write after a crash
    segment.write_bytes(data)
    records, _ = replay_all(data_dir)
    assert records == flatten(frames[:2]) if damage == "zeroed end" else flatten(frames)
    assert segment.stat().st_size == (start if damage == "zeroed end" else len(data) - 4096)
    assert replay_all(data_dir)[1]["truncated_bytes"] == 0


def test_a_flipped_byte_in_a_complete_last_frame_is_damage_not_a_torn_write(tmp_path):
    data_dir = tmp_path / "log"
    frames = write_frames(data_dir, [2, 3, 4], fsync="no")
    [segment] = segments(data_dir)
    data = bytearray(segment.read_bytes())
    start = frame_offsets(bytes(data))[2]
    data[-3] ^= 0x40  # whole, but its checksum fails: it may hold confirmed messages, never cut silently
    segment.write_bytes(data)
    with pytest.raises(LogCorrupt, match=f"bad frame at offset {start}.*--repair"):
        replay_all(data_dir)
    assert segment.stat().st_size == len(data)  # refusing changes nothing on disk
    records, _ = replay_all(data_dir, repair=True)
    assert records == flatten(frames[:2])


def test_flipped_byte_in_a_middle_frame_is_corruption_until_repair(tmp_path, caplog):
    data_dir = tmp_path / "log"
    frames = write_frames(data_dir, [3, 2, 4, 1, 3])
    [segment] = segments(data_dir)
    data = bytearray(segment.read_bytes())
    offsets = frame_offsets(bytes(data))
    data[offsets[2] + HEADER_BYTES + 1] ^= 0x01  # the third frame's payload
    segment.write_bytes(data)
    for _ in range(2):  # refusing changes nothing on disk
        with pytest.raises(LogCorrupt) as raised:
            replay_all(data_dir)
        assert str(raised.value) == (f"{segment}: bad frame at offset {offsets[2]}; "
                                     "start with --repair to truncate the log there")
        assert segment.stat().st_size == len(data)
    with caplog.at_level(logging.WARNING, logger="mqks.log"):
        records, stats = replay_all(data_dir, repair=True)
    assert records == flatten(frames[:2])
    assert stats["truncated_bytes"] == len(data) - offsets[2]
    assert segment.stat().st_size == offsets[2]
    assert any(f"{segment}: bad frame at offset {offsets[2]}" in r.getMessage() for r in caplog.records)
    again, stats = replay_all(data_dir)
    assert again == records and stats["truncated_bytes"] == 0


def test_repair_of_an_older_segment_deletes_the_later_ones(tmp_path):
    data_dir = tmp_path / "log"
    frames = write_frames(data_dir, [2, 2, 2, 2], segment_bytes=1)  # one frame per segment
    files = segments(data_dir)
    assert len(files) == 4
    data = bytearray(files[1].read_bytes())
    data[HEADER_BYTES] ^= 0x20
    files[1].write_bytes(data)
    with pytest.raises(LogCorrupt, match=f"{files[1]}: bad frame at offset 0;"):
        replay_all(data_dir)
    records, stats = replay_all(data_dir, repair=True)
    assert records == flatten(frames[:1])
    assert segments(data_dir) == files[:2] and files[1].stat().st_size == 0
    assert stats["segments"] == 2

    log = Log(str(data_dir))
    assert list(log.replay()) == records
    log.append(b"after repair")
    log.commit()
    log.close()
    assert replay_all(data_dir)[0] == [*records, b"after repair"]


def test_new_segment_frame_deletes_older_segments_once_durable(tmp_path):
    data_dir = tmp_path / "log"
    wake = threading.Event()
    log = Log(str(data_dir), segment_bytes=256, wake=wake.set)
    for frame in range(30):
        for record in frame_records(frame, 3):
            log.append(record)
        log.commit()
    wait_durable(log, wake, 30)
    older = segments(data_dir)
    assert len(older) > 3
    snapshot = [b"S", *frame_records(100, 5)]
    for record in snapshot:
        log.append(record)
    number = log.commit(new_segment=True)
    assert number == 31
    wait_durable(log, wake, number)
    remaining = segments(data_dir)
    assert len(remaining) == 1 and remaining[0] not in older
    stats = log.stats()
    assert stats["segments"] == 1 and stats["log_bytes"] == remaining[0].stat().st_size
    later = frame_records(101, 2)
    for record in later:
        log.append(record)
    log.commit()
    log.close()
    assert replay_all(data_dir)[0] == snapshot + later


def test_a_snapshot_in_several_frames_deletes_older_segments_only_once_its_last_is_durable(tmp_path):
    # issue 31.6: a snapshot now streams in chunks; until its last frame is on disk the older
    # segments are what a crash would replay from, so they must stay
    data_dir = tmp_path / "log"
    wake = threading.Event()
    log = Log(str(data_dir), segment_bytes=256, wake=wake.set)
    for frame in range(10):
        for record in frame_records(frame, 3):
            log.append(record)
        log.commit()
    wait_durable(log, wake, 10)
    older = segments(data_dir)
    chunks = [[b"SB", *frame_records(100, 5)], frame_records(101, 5), [*frame_records(102, 5), b"SE"]]
    for i, chunk in enumerate(chunks):
        for record in chunk:
            log.append(record)
        number = log.commit(new_segment=i == 0, completes=i == len(chunks) - 1)
        wait_durable(log, wake, number)
        if i < len(chunks) - 1:
            assert set(older) <= set(segments(data_dir)), f"older segments deleted after chunk {i}"
    remaining = segments(data_dir)
    assert not set(older) & set(remaining)  # all gone once the snapshot is whole
    log.close()
    assert replay_all(data_dir)[0] == [record for chunk in chunks for record in chunk]


def test_stats_counters_move(tmp_path):
    data_dir = tmp_path / "log"
    wake = threading.Event()
    log = Log(str(data_dir), segment_bytes=200, wake=wake.set)
    stats = log.stats()
    assert (stats["commits"], stats["fsyncs"], stats["log_bytes"], stats["segments"]) == (0, 0, 0, 0)
    for frame in range(10):
        for record in frame_records(frame, 4):
            log.append(record)
        log.commit()
    wait_durable(log, wake, 10)
    stats = log.stats()
    assert stats["commits"] == 10
    assert stats["fsyncs"] >= 1
    assert 0 <= stats["fsync_ms_p50"] <= stats["fsync_ms_p99"]
    assert stats["segments"] == len(segments(data_dir)) > 1
    assert stats["log_bytes"] == sum(path.stat().st_size for path in segments(data_dir))
    assert stats["unsynced_bytes"] == 0 and stats["disk_full"] is False
    log.close()
    replayed = Log(str(data_dir))
    list(replayed.replay())
    assert replayed.stats()["replayed_records"] == 40
    assert replayed.stats()["recovery_seconds"] > 0
    replayed.close()

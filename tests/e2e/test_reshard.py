"""Re-sharding the write-ahead log (server/edges/reshard.py) with a real `mqksd` and real files.

A 1-worker broker builds durable state and is killed with -9; `prepare(DIR, N)` then lays the
logs out for N workers. Every new worker log is replayed in-process and compared, queue by
queue, with what a plain restart of the original log gives; the last step serves it all again
from a real broker over the wire.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import BrokerProcess
from helpers import queue_row, unique_bytes

from mqks.server.core.messages import Message, Packed, unpack
from mqks.server.core.restore import rebuild
from mqks.server.dispatch.slots import SLOTS, owner_of
from mqks.server.edges import reshard
from mqks.server.edges.reshard import (
    DONE_DIR,
    LAYOUT_FILE,
    READY_DIR,
    TEMP_DIR,
    ReshardError,
    log_dir,
    placed_brokers,
    prepare,
)
from mqks.server.journal.log import Log
from mqks.server.journal.recovery import Recovery, recover
from mqks.server.wire.protocol import msg_id_of

pytestmark = pytest.mark.timeout(120)

QUEUES = 12
PER_QUEUE = 5


class Built:
    """The data dir a killed 1-worker broker left, and the names the test put in it."""

    def __init__(self, data_dir: str, queues: list[bytes], events: list[bytes], mask_event: bytes,
                 delayed_id: bytes, schedule: bytes) -> None:
        self.data_dir = data_dir
        self.queues = queues
        self.events = events
        self.mask_event = mask_event
        self.delayed_id = delayed_id
        self.schedule = schedule


def read_until(wire, line: bytes) -> list[bytes]:
    """Every line before `line` (which is read too)."""
    got = []
    while (next_line := wire.recv_line()) != line:
        got.append(next_line)
    return got


def build_state(server: BrokerProcess, data_dir: str) -> Built:
    """Queues with bindings (one by mask) and settings, waiting, held, rejected, parked and dead-lettered
    messages, a delayed publish and a schedule; everything on disk when this returns."""
    queues = [unique_bytes(f"rq{i}-") for i in range(QUEUES)]
    events = [unique_bytes(f"re{i}-") for i in range(QUEUES)]
    mask_event = unique_bytes("user")
    wire = server.wire()
    lines = []
    for i, (queue, event) in enumerate(zip(queues, events, strict=True)):
        settings = {1: b" --max-retries=0", 2: b" --max-length=100"}.get(i, b"")
        mask = b" %b.*.created" % mask_event if i == 0 else b""
        lines.append(b"rb%d rebind %b %b%b%b" % (i, queue, event, mask, settings))
    for i, event in enumerate(events):
        lines += [b"m%dx%d publish %b body %d %d" % (i, k, event, i, k) for k in range(PER_QUEUE)]
    lines.append(b"u1 publish %b.7.created hello" % mask_event)
    # q1 (--max-retries=0): m1x0 held at the crash comes back with retry 1, so a dead letter in q1.dead
    lines.append(b"c1 consume %b --manual-ack --prefetch=1" % queues[1])
    # q3: m3x0 rejected (retry 1) and delivered again, m3x1 held: both held at the crash
    lines.append(b"c3 consume %b --manual-ack --prefetch=2" % queues[3])
    lines.append(b"r3 reject c3 m3x0")
    # q4: m4x0 rejected with --delay for an hour (parked), m4x1 held
    lines.append(b"c4 consume %b --manual-ack --prefetch=1" % queues[4])
    lines.append(b"r4 reject c4 m4x0 --delay=3600")
    delayed_id, schedule = unique_bytes("later"), unique_bytes("every")
    lines.append(b"%b publish --delay=3600 %b later" % (delayed_id, events[5]))
    lines.append(b"s1 schedule %b --every=3600 %b tick" % (schedule, events[6]))
    # a confirm waits for everything recorded before it: acks, rejects and deliveries included
    lines.append(b"sync publish --confirm nobody.listens x")
    wire.send(*lines)
    read_until(wire, b"sync ok ")
    # the connection stays open until the kill: closing it would requeue what it holds (in delivery order)
    # before the crash, and the test means messages held at the crash
    server.held_open = wire  # type: ignore[attr-defined]
    return Built(data_dir, queues, events, mask_event, delayed_id, schedule)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Iterator[Built]:
    """One killed broker's data dir for the whole module; each test copies it."""
    data_dir = str(tmp_path_factory.mktemp("built") / "data")
    server = BrokerProcess("--data-dir", data_dir)
    try:
        state = build_state(server, data_dir)
    finally:
        server.kill()  # -9: nothing is flushed or snapshotted on the way out
        if hasattr(server, "held_open"):
            server.held_open.close()
    yield state


@pytest.fixture
def data_dir(built: Built, tmp_path) -> str:
    path = str(tmp_path / "data")
    shutil.copytree(built.data_dir, path)
    return path


def replay_dir(path: str) -> Recovery:
    log_ = Log(path)
    try:
        return recover(log_.replay())
    finally:
        log_.close()


def contents(queue: Any) -> list[tuple[bytes, int]]:
    """(msg id, retry) of every waiting message, front first."""
    found = []
    for item in queue.items():
        if isinstance(item, Message):
            found.append((msg_id_of(item.tail), item.retry))
        else:
            for tail in unpack(item) if type(item) is Packed else [item]:
                found.append((msg_id_of(tail), 0))
    return found


def restart_state(recovery: Recovery) -> dict[bytes, dict[str, Any]]:
    """Each queue as a restart from `recovery` rebuilds it: messages in order, parked ones, bindings, settings."""
    [broker] = placed_brokers(1)
    rebuild(recovery.queues, lambda name: broker)
    parked: dict[bytes, list[tuple[int, bytes, int]]] = {}
    for due_ms, entries in broker.parked.items():
        for queue, records in entries:
            parked.setdefault(queue.name, []).extend((due_ms, msg_id_of(r.tail), r.retry) for r in records)
    return {name: {"messages": contents(queue), "parked": sorted(parked.get(name, [])),
                   "events": sorted(queue.events), "seconds": queue.delete_when_unused_seconds,
                   "max_retries": queue.max_retries, "max_length": queue.max_length}
            for name, queue in broker.queues.items()}


def expected_state(built: Built, tmp_path) -> tuple[dict[bytes, dict[str, Any]], Recovery]:
    """What a plain 1-worker restart of the killed broker's log gives (from a copy: replay may cut a torn tail)."""
    copy = str(tmp_path / "reference")
    shutil.copytree(built.data_dir, copy)
    recovery = replay_dir(copy)
    return restart_state(recovery), recovery


def layout(data_dir: str) -> dict[str, int]:
    with open(os.path.join(data_dir, LAYOUT_FILE), encoding="utf-8") as f:
        return json.load(f)


def check_layout(data_dir: str, workers: int, expected: dict[bytes, dict[str, Any]], built: Built,
                 crashed: bool = False) -> None:
    """DIR is laid out for `workers`, each queue in its owner's log only, and the state is the restart's.

    crashed: a re-shard cut short may have left its incomplete temp dir beside the old layout, or
    the done dir beside the new one (the next prepare deletes them).
    """
    if crashed and not os.path.exists(os.path.join(data_dir, LAYOUT_FILE)):
        assert workers == 1  # an older version's 1-worker DIR, as the test built it
    else:
        assert layout(data_dir) == {"workers": workers, "slots": SLOTS}
    names = sorted(name for name in os.listdir(data_dir) if not (crashed and name in (TEMP_DIR, DONE_DIR)))
    assert TEMP_DIR not in names and READY_DIR not in names and DONE_DIR not in names
    root_segments = [name for name in names if name.endswith(".log")]
    worker_dirs = [name for name in names if name.startswith("worker-")]
    if workers == 1:
        assert root_segments and not worker_dirs, names
    else:
        assert not root_segments and worker_dirs == [f"worker-{i}" for i in range(workers)], names
    merged: dict[bytes, dict[str, Any]] = {}
    delayed: dict[int, list[bytes]] = {}
    schedules: dict[bytes, bytes] = {}
    for worker in range(workers):
        recovery = replay_dir(log_dir(data_dir, worker, workers))
        state = restart_state(recovery)
        for name in state:
            assert owner_of(name, workers) == worker, f"{name!r} is in worker {worker}'s log"
            assert name not in merged, f"{name!r} is in two logs"
        merged.update(state)
        for due_ms, tails in recovery.delayed.items():
            for tail in tails:
                assert owner_of(msg_id_of(tail), workers) == worker
            delayed.setdefault(due_ms, []).extend(tails)
        for name, record in recovery.schedules.items():
            assert owner_of(name, workers) == worker
            schedules[name] = record
    assert merged == expected
    assert [msg_id_of(tail) for tails in delayed.values() for tail in tails] == [built.delayed_id]
    assert list(schedules) == [built.schedule]


def test_the_built_state_is_what_the_test_means(built: Built, tmp_path) -> None:
    """The reference the other tests compare with holds every kind of state (else they prove little)."""
    expected, recovery = expected_state(built, tmp_path)
    q = built.queues
    assert set(expected) == {*q, q[1] + b".dead"}
    assert expected[q[0]]["messages"][-1] == (b"u1", 0) and len(expected[q[0]]["events"]) == 2
    assert expected[q[1]]["max_retries"] == 0 and expected[q[1] + b".dead"]["messages"] == [(b"m1x0", 1)]
    assert expected[q[2]]["max_length"] == 100
    assert expected[q[3]]["messages"][:3] == [(b"m3x0", 2), (b"m3x1", 1), (b"m3x2", 0)]  # held: retry raised
    assert [(msg_id, retry) for _, msg_id, retry in expected[q[4]]["parked"]] == [(b"m4x0", 1)]
    assert expected[q[4]]["messages"][0] == (b"m4x1", 1)
    assert expected[q[7]]["messages"] == [(b"m7x%d" % k, 0) for k in range(PER_QUEUE)]
    assert len(recovery.delayed) == 1 and list(recovery.schedules) == [built.schedule]


def consume_all(server: BrokerProcess, names: list[bytes]) -> dict[bytes, list[tuple[bytes, int]]]:
    """Every message each queue delivers to an auto-ack consumer, as (msg id, retry), in order."""
    wire = server.wire()
    got: dict[bytes, list[tuple[bytes, int]]] = {}
    for n, name in enumerate(names):
        wire.send(b"c%d consume --confirm %b" % (n, name))
        wire.expect(b"c%d ok " % n)
        found = []
        for line in wire.barrier(b"%d" % n):
            _, _, msg_id, meta, _ = line.split(b" ", 4)
            retry = int(meta.partition(b",retry=")[2] or 0)
            found.append((msg_id, retry))
        got[name] = found
    wire.close()
    return got


def test_one_worker_to_two_to_three_and_back_keeps_every_queue_message_and_setting(built: Built, data_dir: str,
                                                                                 tmp_path) -> None:
    expected, _ = expected_state(built, tmp_path)
    summary = prepare(data_dir, 2)
    assert summary is not None and f"{len(expected)} queues" in summary and "from 1 to 2 workers" in summary, summary
    check_layout(data_dir, 2, expected, built)
    assert prepare(data_dir, 2) is None  # laid out already: nothing to do
    summary = prepare(data_dir, 3)
    assert summary is not None and "from 2 to 3 workers" in summary, summary
    check_layout(data_dir, 3, expected, built)
    summary = prepare(data_dir, 1)
    assert summary is not None and "from 3 to 1 workers" in summary, summary
    check_layout(data_dir, 1, expected, built)

    # a real 1-worker broker serves it all again
    server = BrokerProcess("--eval", "--data-dir", data_dir)
    try:
        names = sorted(expected)
        assert consume_all(server, names) == {name: expected[name]["messages"] for name in names}
        q = built.queues
        assert "--max-retries=0" in queue_row(server, q[1])["flags"]
        assert "--max-length=100" in queue_row(server, q[2])["flags"]
        wire = server.wire()
        wire.send(b"st stats")
        line = wire.recv_line()
        assert line.startswith(b"st ok ") and json.loads(line[len(b"st ok "):])["delayed"] == 1, line
        wire.send(b"sc schedules")
        listed = read_until(wire, b"sc ok --end")
        assert [json.loads(line[len(b"sc ok "):])["name"] for line in listed] == [built.schedule.decode()]
        wire.close()
        # bindings came through too: exact and by mask
        wire = server.wire()
        wire.send(b"k0 consume --confirm %b" % q[0], b"k7 consume --confirm %b" % q[7])
        wire.expect(b"k0 ok ")
        wire.expect(b"k7 ok ")
        wire.send(b"n7 publish --confirm %b after" % built.events[7],
                  b"n0 publish --confirm %b.9.created masked" % built.mask_event)
        lines = wire.barrier()
        assert b"k7 ok n7 event=%b after" % built.events[7] in lines, lines
        assert b"k0 ok n0 event=%b.9.created masked" % built.mask_event in lines, lines
        wire.close()
    finally:
        server.kill()


def test_a_half_written_temp_dir_is_dropped_and_the_old_layout_stands(built: Built, data_dir: str, tmp_path) -> None:
    expected, _ = expected_state(built, tmp_path)
    temp = os.path.join(data_dir, TEMP_DIR, "worker-0")
    os.makedirs(temp)
    with open(os.path.join(temp, "000000000001.log"), "wb") as f:
        f.write(b"\x10\x00\x00\x00half a frame")  # a header promising more than was written
    assert prepare(data_dir, 1) is None  # the old layout (1 worker, no layout.json yet) is still whole
    assert not os.path.exists(os.path.join(data_dir, TEMP_DIR))
    check_layout(data_dir, 1, expected, built)
    os.makedirs(temp)
    with open(os.path.join(temp, "000000000001.log"), "wb") as f:
        f.write(b"garbage")
    assert prepare(data_dir, 2) is not None
    check_layout(data_dir, 2, expected, built)


class Crash(Exception):
    """Stands for the process dying at one step of a re-shard."""


def crash_at(monkeypatch, step: int) -> list[int]:
    """Make the `step`-th file-system change of a re-shard (rename, unlink, rmtree, layout write) raise Crash."""
    count = [0]

    def counted(fn):
        def wrapper(*args, **kwargs):
            count[0] += 1
            if count[0] == step:
                raise Crash(f"step {step}: {fn.__name__}{args}")
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(reshard.os, "rename", counted(os.rename))
    monkeypatch.setattr(reshard.os, "unlink", counted(os.unlink))
    monkeypatch.setattr(reshard.shutil, "rmtree", counted(shutil.rmtree))
    return count


@pytest.mark.parametrize("workers", [(1, 2), (2, 3), (3, 1)], ids=["1to2", "2to3", "3to1"])
def test_a_crash_at_any_step_leaves_the_old_or_the_new_layout_whole(built: Built, tmp_path, monkeypatch,
                                                                     workers: tuple[int, int]) -> None:
    """Cut the re-shard at each of its file-system changes in turn; the next prepare ends with all the state."""
    old, new = workers
    expected, _ = expected_state(built, tmp_path)
    base = str(tmp_path / "base")
    shutil.copytree(built.data_dir, base)
    if old != 1:
        prepare(base, old)  # (1: the DIR as the broker left it, with no layout.json, as older versions do)
    with monkeypatch.context() as m:
        probe = str(tmp_path / "probe")
        shutil.copytree(base, probe)
        steps = crash_at(m, 0)
        prepare(probe, new)
        total = steps[0]
    assert total >= 6  # rename into place, then the swap's deletes and renames: else the sweep proves little
    for step in range(1, total + 1):
        path = str(tmp_path / f"crash-{step}")
        shutil.copytree(base, path)
        with monkeypatch.context() as m:
            crash_at(m, step)
            with pytest.raises(Crash):
                prepare(path, new)
        # on disk now: the old layout whole, or the new one complete (half swapped in while
        # reshard.ready exists: only the next prepare reads that back)
        if not os.path.exists(os.path.join(path, READY_DIR)):
            standing = layout(path)["workers"] if os.path.exists(os.path.join(path, LAYOUT_FILE)) else 1
            assert standing in (old, new)
            check_layout(path, standing, expected, built, crashed=True)
        prepare(path, new)
        check_layout(path, new, expected, built)
        shutil.rmtree(path)


KILL_AT_STEP = """
import os, shutil, signal, sys
from mqks.server.edges.reshard import prepare
data_dir, workers, step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
count = 0
def counted(fn):
    def wrapper(*args, **kwargs):
        global count
        count += 1
        if count == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kwargs)
    return wrapper
os.rename, os.unlink, shutil.rmtree = counted(os.rename), counted(os.unlink), counted(shutil.rmtree)
prepare(data_dir, workers)
"""


def test_a_re_shard_killed_with_9_at_any_step_is_finished_by_the_next_prepare(built: Built, tmp_path,
                                                                                monkeypatch) -> None:
    """As the crash sweep above, but the process really dies: no finally, no writer thread closing its file."""
    expected, _ = expected_state(built, tmp_path)
    base = str(tmp_path / "base")
    shutil.copytree(built.data_dir, base)
    prepare(base, 2)
    probe = str(tmp_path / "probe")
    shutil.copytree(base, probe)
    with monkeypatch.context() as m:
        steps = crash_at(m, 0)
        prepare(probe, 3)
    for step in range(1, steps[0] + 1):
        path = str(tmp_path / f"killed-{step}")
        shutil.copytree(base, path)
        done = subprocess.run([sys.executable, "-c", KILL_AT_STEP, path, "3", str(step)], timeout=60,
                              capture_output=True)
        assert done.returncode == -signal.SIGKILL, done.stderr.decode()
        prepare(path, 3)
        check_layout(path, 3, expected, built)
        shutil.rmtree(path)


def test_logs_outside_the_layout_are_refused_not_merged_or_ignored(built: Built, data_dir: str) -> None:
    """An older mqksd run on a re-sharded DIR writes to DIR itself: its workers would never read that."""
    assert prepare(data_dir, 2) is not None
    stray = os.path.join(data_dir, "000000000001.log")
    shutil.copy(os.path.join(data_dir, "worker-0", "000000000001.log"), stray)
    for workers in (2, 3):
        with pytest.raises(ReshardError, match="own \\*\\.log segments"):
            prepare(data_dir, workers)
    os.unlink(stray)
    os.makedirs(os.path.join(data_dir, "worker-5"))  # a dir with no log in it is harmless
    assert prepare(data_dir, 2) is None
    shutil.copy(os.path.join(data_dir, "worker-0", "000000000001.log"), os.path.join(data_dir, "worker-5"))
    with pytest.raises(ReshardError, match="worker-5"):
        prepare(data_dir, 2)


def test_a_corrupt_log_is_refused_naming_its_dir_unless_repair(built: Built, data_dir: str) -> None:
    segment = sorted(name for name in os.listdir(data_dir) if name.endswith(".log"))[0]
    before = sorted(os.listdir(data_dir))
    path = os.path.join(data_dir, segment)
    with open(path, "r+b") as f:
        f.seek(8 + 2)  # inside the first frame's payload: a bad frame with good ones after it
        byte = f.read(1)
        f.seek(8 + 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ReshardError, match=data_dir):
        prepare(data_dir, 2)
    assert sorted(os.listdir(data_dir)) == before  # the old layout as it was, nothing of a new one
    summary = prepare(data_dir, 2, repair=True)
    assert summary is not None and "from 1 to 2 workers" in summary
    assert layout(data_dir) == {"workers": 2, "slots": SLOTS}


def test_a_new_dir_gets_a_layout_and_a_matching_one_is_left_alone(tmp_path) -> None:
    path = str(tmp_path / "new")
    assert prepare(path, 4) is None
    assert layout(path) == {"workers": 4, "slots": SLOTS}
    assert prepare(path, 4) is None
    assert sorted(os.listdir(path)) == [LAYOUT_FILE]
    assert log_dir(path, 0, 1) == path and log_dir(path, 3, 4) == os.path.join(path, "worker-3")
    # a layout for another count with no logs yet: re-sharding nothing still changes the layout
    summary = prepare(path, 2)
    assert summary is not None and "0 queues" in summary
    assert layout(path) == {"workers": 2, "slots": SLOTS}


def test_worker_logs_without_a_layout_are_refused(built: Built, tmp_path) -> None:
    """Without layout.json nothing says which worker count placed them: guessing could lose queues."""
    worker = tmp_path / "data" / "worker-0"
    shutil.copytree(built.data_dir, worker)
    with pytest.raises(ReshardError, match=r"layout\.json"):
        prepare(str(tmp_path / "data"), 2)
    assert sorted(os.listdir(tmp_path / "data")) == ["worker-0"]


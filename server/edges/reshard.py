"""The write-ahead log across a change of the number of worker processes (`mqksd --workers N --data-dir DIR`).

Layout: with 1 worker the log is DIR itself (as before workers were processes); with N >= 2,
worker i keeps its own log in DIR/worker-{i}. DIR/layout.json says which (`{"workers": N,
"slots": 16384}`); a DIR with segments and no layout.json is a 1-worker DIR of an older version.

`prepare(DIR, N)` runs in the supervisor before any worker starts. When the layout on disk is
for another N it replays every log there, rebuilds the queues in one process placed by
`slots.owner_of(queue, N)`, and writes one fresh log per new worker holding a snapshot of
exactly its state: what a restart would give (un-acked messages requeued with retry raised).
The process-level state goes to one worker each: a schedule to `owner_of(name, N)`, a delayed
publish to `owner_of(msg_id, N)`.

Crash safety, by directory renames:
    DIR/reshard.tmp     being written: incomplete, deleted by the next prepare (the old layout stands)
    DIR/reshard.ready   complete and synced (renamed from reshard.tmp): the new layout stands; the
                        next prepare finishes the swap (delete the old logs, mark `old-removed`
                        inside it, move the new ones into DIR, write layout.json, rename it to
                        reshard.done)
    DIR/reshard.done    swapped in: deleted by the next prepare if a crash left it
Until reshard.ready exists nothing old is touched (but a torn tail that replay cuts off, as any
start does); once it exists, the old logs are only ever deleted, never read again.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterator

from ..core.leases import Leases
from ..core.restore import rebuild
from ..core.snapshot import snapshot_lines
from ..core.state import Broker
from ..core.timers import Timers
from ..dispatch.slots import SLOTS, owner_of
from ..journal import records
from ..journal.journal import Journal
from ..journal.log import SEGMENT_NAME, Log, LogCorrupt, fsync_dir
from ..journal.recovery import Recovery, recover
from ..wire.protocol import msg_id_of

log = logging.getLogger("mqks.reshard")

LAYOUT_FILE = "layout.json"
TEMP_DIR = "reshard.tmp"
READY_DIR = "reshard.ready"
DONE_DIR = "reshard.done"  # reshard.ready once swapped in: only left to delete
OLD_REMOVED = "old-removed"  # inside READY_DIR: the old logs are gone, the worker dirs in DIR are new ones
WORKER_DIR = re.compile(r"^worker-(\d+)$")
DEFAULT_SEGMENT_BYTES = 64 << 20  # as Config.log_segment_bytes


class ReshardError(Exception):
    """The logs in a data dir cannot be re-sharded as they are; the message names the dir and what to do."""


def log_dir(data_dir: str, worker: int, workers: int) -> str:
    """Where worker `worker` of `workers` keeps its log."""
    return data_dir if workers == 1 else os.path.join(data_dir, f"worker-{worker}")


def prepare(data_dir: str, workers: int, fsync: str = "always", segment_bytes: int = DEFAULT_SEGMENT_BYTES,
            repair: bool = False) -> str | None:
    """Make DIR's logs laid out for `workers` workers; a one-line summary if it re-sharded, else None.

    Call it before any worker opens its log. Finishes a re-shard a crash interrupted first.
    Raises ReshardError on a corrupt log (unless repair=True: then the log is cut at the bad
    frame, as `mqksd --repair` does) or on logs that contradict each other.
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers}")
    os.makedirs(data_dir, exist_ok=True)
    _finish_interrupted(data_dir)
    layout = read_layout(data_dir)
    if layout is None:
        write_layout(data_dir, workers)
        return None
    old_workers, slots = layout
    _refuse_strays(data_dir, old_workers)
    if old_workers == workers and slots == SLOTS:
        if not os.path.exists(os.path.join(data_dir, LAYOUT_FILE)):
            write_layout(data_dir, workers)  # an older version's DIR: say what it is from now on
        return None
    return _reshard(data_dir, old_workers, workers, fsync, segment_bytes, repair)


def read_layout(data_dir: str) -> tuple[int, int] | None:
    """(workers, slots) DIR's logs are laid out for; None for a DIR without logs."""
    path = os.path.join(data_dir, LAYOUT_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        if _root_segments(data_dir):
            return 1, SLOTS
        if any(_root_segments(os.path.join(data_dir, name)) for name in _worker_dirs(data_dir)):
            raise ReshardError(f"{data_dir} holds worker-* logs but no {LAYOUT_FILE}: cannot tell how they "
                               f"are laid out; restore {path} ({{\"workers\": N, \"slots\": {SLOTS}}})") from None
        return None
    try:
        layout = json.loads(text)
        workers, slots = layout["workers"], layout["slots"]
        if not (type(workers) is int and workers >= 1 and type(slots) is int and slots >= 1):
            raise ValueError(f"workers and slots must be integers >= 1, got {workers!r} and {slots!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise ReshardError(f"{path} is not a layout ({e}); expected {{\"workers\": N, \"slots\": {SLOTS}}}") from None
    return workers, slots


def write_layout(data_dir: str, workers: int) -> None:
    """Write DIR/layout.json atomically: a temp file, fsync, rename over, fsync the dir."""
    _write_file_atomically(os.path.join(data_dir, LAYOUT_FILE),
                           json.dumps({"workers": workers, "slots": SLOTS}).encode() + b"\n")


def _reshard(data_dir: str, old_workers: int, workers: int, fsync: str, segment_bytes: int, repair: bool) -> str:
    """Replay every log in DIR, write the new layout beside it, then swap it in."""
    recovery = _replay_all(data_dir, old_workers, fsync, segment_bytes, repair)
    placed = placed_brokers(workers)
    rebuild(recovery.queues, lambda name: placed[owner_of(name, workers)])
    process_lines: list[list[bytes]] = [[] for _ in range(workers)]
    delayed = 0
    for due_ms, tails in sorted(recovery.delayed.items()):
        for tail in tails:
            process_lines[owner_of(msg_id_of(tail), workers)].append(records.delayed(due_ms, tail))
            delayed += 1
    for name, record in recovery.schedules.items():
        process_lines[owner_of(name, workers)].append(record)  # its last K record is its whole state
    temp = os.path.join(data_dir, TEMP_DIR)
    shutil.rmtree(temp, ignore_errors=True)
    os.mkdir(temp)
    for worker in range(workers):
        _write_snapshot(log_dir(temp, worker, workers), placed, worker, process_lines[worker], fsync, segment_bytes)
    with open(os.path.join(temp, LAYOUT_FILE), "wb") as f:
        f.write(json.dumps({"workers": workers, "slots": SLOTS}).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(temp)
    os.rename(temp, os.path.join(data_dir, READY_DIR))  # the mark: complete from here on
    fsync_dir(data_dir)
    _swap(data_dir)
    # counted as placed: a held copy past --max-retries has moved to a dead-letter queue rebuild made
    queues = sum(len(broker.queues) for broker in placed)
    messages = sum(queue.depth() for broker in placed for queue in broker.queues.values())
    messages += sum(len(parked) for broker in placed for _, entries in broker.parked.items() for _, parked in entries)
    return (f"re-sharded {queues} queues, {messages} messages, {delayed} delayed publishes and "
            f"{len(recovery.schedules)} schedules in {data_dir} from {old_workers} to {workers} workers")


def placed_brokers(workers: int) -> list[Broker]:
    """A broker for each of `workers` new workers, each queue name owned by `owner_of(name, workers)`'s.

    Records appended while rebuilding (a held copy past --max-retries becomes a dead letter) go to
    a NullLog: the snapshots written from these brokers hold their outcome.
    """
    timers = Timers()
    journal = Journal(NullLog(), lambda rid, reason: b"")
    brokers = [Broker(timers.call_later, clock=timers.clock) for _ in range(workers)]
    for broker in brokers:
        broker.record = journal.append
        broker.leases = Leases(broker)
        broker.broker_for = lambda name: brokers[owner_of(name, workers)]
    return brokers


def _replay_all(data_dir: str, old_workers: int, fsync: str, segment_bytes: int, repair: bool) -> Recovery:
    """Every log of DIR's layout replayed into one state; each queue in one log only."""
    merged = Recovery()
    queue_origin: dict[bytes, str] = {}
    schedule_origin: dict[bytes, str] = {}
    def claim(origin: dict[bytes, str], what: str, name: bytes, path: str) -> None:
        """Each queue and schedule lives in one log of a layout: a second one means two layouts mixed."""
        if name in origin:
            raise ReshardError(f"{what} {name!r} is in both {origin[name]} and {path}: these logs are not one "
                               f"layout (was an older mqksd run on {data_dir}?); move one of them away")
        origin[name] = path

    for path in _log_dirs(data_dir, old_workers):
        one = _replay(path, fsync, segment_bytes, repair)
        for name, state in one.queues.items():
            claim(queue_origin, "queue", name, path)
            merged.queues[name] = state
        for due_ms, tails in one.delayed.items():
            merged.delayed.setdefault(due_ms, []).extend(tails)
        for name, record in one.schedules.items():
            claim(schedule_origin, "schedule", name, path)
            merged.schedules[name] = record
    return merged


def _replay(path: str, fsync: str, segment_bytes: int, repair: bool) -> Recovery:
    """One log dir's state, as a start would recover it (a torn tail is cut off)."""
    fatal: list[str] = []
    log_ = Log(path, fsync, segment_bytes, on_fatal=fatal.append)
    try:
        recovery = recover(log_.replay(repair=repair))
    except (LogCorrupt, ValueError) as e:  # ValueError: a record this version did not write
        raise ReshardError(f"cannot re-shard {path}: {e}") from None
    finally:
        log_.close()
    if fatal:
        raise ReshardError(f"cannot re-shard {path}: {fatal[0]}")
    return recovery


def _write_snapshot(path: str, placed: list[Broker], worker: int, process_lines: list[bytes], fsync: str,
                    segment_bytes: int) -> None:
    """A fresh log in `path` holding one snapshot frame: worker `worker`'s queues and its process-level lines."""
    fatal: list[str] = []
    log_ = Log(path, fsync, segment_bytes, on_fatal=fatal.append)
    Journal(log_, lambda rid, reason: b"").snapshot(snapshot_lines([placed[worker]], process_lines))
    log_.close()  # writes and fsyncs the frame on every policy; waits out a full disk
    if fatal:
        raise ReshardError(f"cannot write the re-sharded log {path}: {fatal[0]}")
    fsync_dir(path)


def _finish_interrupted(data_dir: str) -> None:
    """Undo a re-shard that was cut short before it was complete, or finish one that was."""
    temp = os.path.join(data_dir, TEMP_DIR)
    if os.path.isdir(temp):
        log.warning("%s: an interrupted re-shard left it incomplete; deleting it (the old logs stand)", temp)
        shutil.rmtree(temp)
        fsync_dir(data_dir)
    if os.path.isdir(os.path.join(data_dir, READY_DIR)):
        log.warning("%s: a re-shard was interrupted after its new logs were complete; finishing it", data_dir)
        _swap(data_dir)
    shutil.rmtree(os.path.join(data_dir, DONE_DIR), ignore_errors=True)
    try:
        os.unlink(os.path.join(data_dir, LAYOUT_FILE + ".tmp"))  # a write_layout cut short
    except FileNotFoundError:
        pass


def _swap(data_dir: str) -> None:
    """Replace the old logs by those in reshard.ready; safe to run again from any point it stopped at."""
    ready = os.path.join(data_dir, READY_DIR)
    marker = os.path.join(ready, OLD_REMOVED)
    if not os.path.exists(marker):
        for name in _root_segments(data_dir):
            os.unlink(os.path.join(data_dir, name))
        for name in _worker_dirs(data_dir):
            shutil.rmtree(os.path.join(data_dir, name))
        try:
            os.unlink(os.path.join(data_dir, LAYOUT_FILE))
        except FileNotFoundError:
            pass
        fsync_dir(data_dir)
        with open(marker, "wb") as f:
            os.fsync(f.fileno())
        fsync_dir(ready)
    # from here every segment and worker-* dir in DIR is a new one already moved
    for name in sorted(os.listdir(ready)):
        if SEGMENT_NAME.match(name) or WORKER_DIR.match(name):
            os.rename(os.path.join(ready, name), os.path.join(data_dir, name))
    fsync_dir(data_dir)
    fsync_dir(ready)
    layout = read_layout(ready)
    if layout is None:
        raise ReshardError(f"{ready} has no {LAYOUT_FILE}: it was not written by prepare(); move it away")
    write_layout(data_dir, layout[0])
    # one rename ends it: deleting reshard.ready file by file could leave it without its marker,
    # and the next prepare would take the new worker dirs for old ones
    done = os.path.join(data_dir, DONE_DIR)
    os.rename(ready, done)
    fsync_dir(data_dir)
    shutil.rmtree(done)


def _log_dirs(data_dir: str, workers: int) -> Iterator[str]:
    """The log dirs of a layout for `workers` that exist (a worker that never wrote may have none)."""
    for worker in range(workers):
        path = log_dir(data_dir, worker, workers)
        if os.path.isdir(path):
            yield path


def _refuse_strays(data_dir: str, workers: int) -> None:
    """Raise if DIR holds a log its layout does not name: its workers would never read it.

    (An older mqksd run on a re-sharded DIR writes to DIR itself, for one.) Merging it could
    bring back deleted queues or put one queue twice; the operator has to say which is right.
    """
    strays = [name for name in _worker_dirs(data_dir)
              if (workers == 1 or int(name[len("worker-"):]) >= workers)
              and _root_segments(os.path.join(data_dir, name))]
    if workers > 1 and _root_segments(data_dir):
        strays.insert(0, "its own *.log segments")
    if strays:
        raise ReshardError(f"{data_dir} is laid out for {workers} workers ({LAYOUT_FILE}) but also holds logs that "
                           f"layout does not use: {', '.join(strays)}; move them away (or merge them by hand) "
                           f"before starting")


def _root_segments(data_dir: str) -> list[str]:
    return sorted(name for name in os.listdir(data_dir) if SEGMENT_NAME.match(name))


def _worker_dirs(data_dir: str) -> list[str]:
    found = [(int(m.group(1)), name) for name in os.listdir(data_dir)
             if (m := WORKER_DIR.match(name)) and os.path.isdir(os.path.join(data_dir, name))]
    return [name for _, name in sorted(found)]


def _write_file_atomically(path: str, data: bytes) -> None:
    temp = path + ".tmp"
    with open(temp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(temp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))




class NullLog:
    """A log that keeps nothing: the journal of the in-process placement, whose state goes out as snapshots."""

    unsynced_bytes = 0
    disk_full = False
    blocked: str | None = None
    fenced_by: str | None = None
    where = "on disk"
    handed_bytes = 0
    frames_waiting = False

    def append(self, record: bytes) -> None:
        pass

    def commit(self, new_segment: bool = False, completes: bool | None = None) -> int | None:
        return None

    def poll(self) -> tuple[int, list[int]]:
        return 0, []

    def stats(self) -> dict[str, int]:
        return {}

    def close(self, timeout_seconds: float | None = None) -> None:
        pass

    def replay(self, repair: bool = False) -> Iterator[bytes]:
        return iter(())

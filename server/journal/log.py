"""The write-ahead log's storage on the local disk: records in on the loop, frames out on one writer thread.

Invariants: a frame is one commit and never spans two files (segments.py lays out the files);
frames reach the disk in commit order, and a commit is reported durable only once the policy
says so. Only the writer thread touches the files after `replay()`: the event loop appends
records to a list and hands frames over, so it never waits on the disk. Nothing handed over is
dropped: frames that hit a full disk, or a process out of file descriptors when a segment is
created, are kept and written, in order, once space or a descriptor returns. A failed fsync is
fatal.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from .journal import p50_p99, take_failed
from .segments import (
    EVERYSEC_SECONDS,
    FSYNC_POLICIES,
    HEADER,
    HEADER_BYTES,
    SEGMENT_NAME,
    Fatal,
    Frame,
    LogCorrupt,
    Segments,
    fsync_dir,
)

__all__ = ["FATAL_EXIT_CODE", "FSYNC_POLICIES", "HEADER_BYTES", "SEGMENT_NAME", "Log", "LogCorrupt", "fsync_dir"]

log = logging.getLogger("mqks.log")

MAX_PAYLOAD_BYTES = 0xFFFFFFFF
DISK_FULL_RETRY_SECONDS = 0.5
FATAL_EXIT_CODE = 70  # EX_SOFTWARE: a supervisor should not restart into the same disk error blindly


def _exit_on_fatal(message: str) -> None:
    """The default: a log that cannot promise durability any more must not keep answering ok."""
    log.critical("%s; exiting", message)
    os._exit(FATAL_EXIT_CODE)


class Log:
    """A write-ahead log in `data_dir`: records in on the loop, frames out on one writer thread.

    Call `replay()` to the end before the first `commit()` when the directory holds a log.
    `append` is the open batch's own `list.append` (no Python frame per record), so a caller
    may bind it once.
    """

    append: Callable[[bytes], None]  # one record line (no newline inside) into the open batch
    unsynced_bytes: int  # handed over but not yet durable under the policy: read it without a lock
    disk_full: bool  # writes fail for lack of space; cleared once one succeeds again
    blocked: str | None  # why writes wait ("disk full", "out of file descriptors"); None while they succeed
    fenced_by: str | None = None  # a local log has one writer: never taken over
    where = "on disk"

    def __init__(self, data_dir: str, fsync: str = "always", segment_bytes: int = 64 << 20,
                 wake: Callable[[], None] = lambda: None,
                 on_fatal: Callable[[str], None] = _exit_on_fatal) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_POLICIES)}, not {fsync!r}")
        self.data_dir = data_dir
        self.fsync = fsync
        self.wake = wake
        self._files = Segments(data_dir, fsync, segment_bytes, on_fatal)
        # loop side: only the loop writes these
        self._records: list[bytes] = []
        self.append = self._records.append  # cleared, never replaced: a bound copy stays valid
        self._commits = 0
        self._handed_bytes = 0
        self.unsynced_bytes = 0
        self._closed = False
        # handed over under the condition; the thread swaps the list out
        self._cond = threading.Condition(threading.Lock())
        self._handed: list[Frame] = []
        self._stopping = False
        # thread side: only the writer thread writes these once frames flow (replay sets them before)
        self._durable = 0
        self._durable_bytes = 0
        self._failed: deque[int] = deque()  # appends and poplefts are atomic: poll takes no lock
        self.disk_full = False
        self.blocked = None
        self._stuck: list[Frame] = []  # frames a full disk refused, oldest first, retried before any newer
        self._retry_at = 0.0
        self._recovery_seconds = 0.0
        # appending after an unverified tail could bury a torn frame in the middle of the log
        self._refuse: str | None = (f"{data_dir} holds a log: replay() it to the end before the first commit"
                                    if self._files.scan() else None)
        self._thread = threading.Thread(target=self._run, name="mqks-log-writer", daemon=True)
        self._thread.start()

    def commit(self, new_segment: bool = False, completes: bool | None = None) -> int | None:
        """Close the open batch into one frame for the writer; its commit number, or None when empty.

        new_segment=True starts a new segment with this frame, for a snapshot of the whole live
        state; every older segment is deleted once the frame with completes=True (by default the
        same one) is durable, so a snapshot written in several frames replaces the log only whole.
        """
        if completes is None:
            completes = new_segment
        records = self._records
        if not records:
            return None
        if self._refuse is not None:
            raise RuntimeError(self._refuse)
        payload = b"\n".join(records)
        records.clear()
        size = len(payload)
        if not 0 < size <= MAX_PAYLOAD_BYTES:
            # an empty frame would read like a zero-filled tail
            raise ValueError(f"a frame's payload must be 1 to {MAX_PAYLOAD_BYTES} bytes, not {size}")
        self._commits = number = self._commits + 1
        frame = Frame(number, HEADER.pack(size, zlib.crc32(payload)), payload, new_segment, completes)
        self._handed_bytes += HEADER_BYTES + size
        # both threads only ever store handed - durable, each counter having one writer; the
        # loop stores before the hand-over, so the thread's store for this frame comes later
        self.unsynced_bytes = self._handed_bytes - self._durable_bytes
        with self._cond:
            self._handed.append(frame)
            self._cond.notify()
        return number

    @property
    def frames_waiting(self) -> bool:
        """True while frames wait for the writer thread to take them (it holds one batch at a time)."""
        return bool(self._handed)

    @property
    def handed_bytes(self) -> int:
        """Bytes handed to the writer since this Log was opened (headers included)."""
        return self._handed_bytes

    def poll(self) -> tuple[int, list[int]]:
        """The highest durable commit number, and the commits whose write failed since the last poll."""
        return take_failed(self._durable, self._failed)

    def stats(self) -> dict[str, Any]:
        """Counters for stats and monitoring; fsync latencies over the last 1024 fsyncs."""
        files = self._files
        fsync_ms_p50, fsync_ms_p99 = p50_p99(files.fsync_ms)
        return {
            "log_bytes": files.log_bytes,
            "segments": files.count,
            "commits": self._commits,
            "fsyncs": files.fsyncs,
            "fsync_ms_p50": fsync_ms_p50,
            "fsync_ms_p99": fsync_ms_p99,
            "unsynced_bytes": self.unsynced_bytes,
            "disk_full": self.disk_full,
            "blocked": self.blocked is not None,
            "replayed_records": files.replayed_records,
            "truncated_bytes": files.truncated_bytes,
            "recovery_seconds": self._recovery_seconds,
        }

    def close(self, timeout_seconds: float | None = None) -> None:
        """Write and fsync everything handed over, then stop the writer (the SIGTERM path).

        On a full disk this waits for space (None: for ever); after `timeout_seconds` it logs
        what is not on disk and returns, the thread still retrying until the process exits.
        """
        if self._closed:
            return
        if self._refuse is None:
            self.commit()  # the open batch too: nothing appended is left behind
        self._closed = True
        self._refuse = "the log is closed"
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_seconds)
        if self._thread.is_alive():
            # never confirmed: a confirm waits for its frame to be durable
            log.error("closing %s after %g s: %d bytes of unconfirmed records are not on disk (%s); stopping "
                      "without them", self.data_dir, timeout_seconds, self.unsynced_bytes,
                      self.blocked or "the disk does not answer")

    def replay(self, repair: bool = False) -> Iterator[bytes]:
        """Every record of every durable frame, oldest segment first; a torn tail is cut off and logged.

        A bad frame anywhere but at the very end of the last segment raises LogCorrupt, or with
        repair=True cuts the log there (deleting later segments) and says what it dropped.
        """
        if self._commits:
            raise RuntimeError("replay() runs before the first commit")
        started = time.perf_counter()
        yield from self._files.replay(repair)
        self._refuse = None
        self._recovery_seconds = time.perf_counter() - started

    def _run(self) -> None:
        try:
            self._write_until_closed()
        except Fatal:
            pass
        except BaseException as e:  # a bug: never leave the broker waiting on a dead thread in silence
            self._files.die(f"log writer of {self.data_dir} failed: {e!r}")

    def _write_until_closed(self) -> None:
        cond, files = self._cond, self._files
        while True:
            with cond:
                while not self._handed:
                    if self._stopping and not self._stuck:
                        break
                    timeout = self._wait_seconds()
                    if timeout is not None and timeout <= 0:
                        break
                    cond.wait(timeout)
                frames, self._handed = self._handed, []
                stopping = self._stopping
            if frames or (self._stuck and time.monotonic() >= self._retry_at):
                self._write_batch(frames)
            # checked after every batch too: a steady load never lets the thread go idle
            if files.dirty and self.fsync == "everysec" and time.monotonic() - files.last_sync >= EVERYSEC_SECONDS:
                files.sync()
            if stopping and not self._stuck:
                files.close()
                return

    def _wait_seconds(self) -> float | None:
        """How long the idle thread may sleep: until a disk-full retry or the everysec sync is due."""
        now = time.monotonic()
        waits = []
        if self._stuck:
            waits.append(self._retry_at - now)
        due = self._files.sync_due_in(now)
        if due is not None:
            waits.append(due)
        return min(waits) if waits else None

    def _write_batch(self, frames: list[Frame]) -> None:
        """Write the stuck frames then the new ones, apply the policy, publish durability, wake the loop."""
        files = self._files
        todo = self._stuck + frames if self._stuck else frames
        written = files.write(todo)
        failed = []
        if written < len(todo):
            self._stuck = todo[written:]
            self._retry_at = time.monotonic() + DISK_FULL_RETRY_SECONDS
            for frame in self._stuck:
                if not frame.failed:
                    frame.failed = True
                    failed.append(frame.number)
            if self.blocked is None:
                self.blocked = files.blocked_by
                self.disk_full = files.blocked_by == "disk full"
                log.error("%s: %s; %d frames wait in memory and are retried every %g s",
                          files.path(files.segment), self.blocked, len(self._stuck), DISK_FULL_RETRY_SECONDS)
        else:
            self._stuck = []
            if self.blocked is not None:
                log.warning("%s: written again after %s", files.path(files.segment), self.blocked)
                self.blocked = None
                self.disk_full = False
        if written:
            files.written()
            self._durable_bytes += sum(HEADER_BYTES + len(f.payload) for f in todo[:written])
            self.unsynced_bytes = self._handed_bytes - self._durable_bytes
            self._durable = todo[written - 1].number
        if failed:
            self._failed.extend(failed)
        if written or failed:
            try:
                self.wake()
            except Exception:  # a loop already torn down at exit must not turn a clean stop into a fatal one
                log.exception("waking the loop after a write to %s failed", self.data_dir)

"""The write-ahead log's storage, one segment file after another.

Invariants: a frame is one commit (8-byte header `<II` payload length, crc32 of the payload;
then the records joined with newlines) and never spans two files; frames reach the disk in
commit order, and a commit is reported durable only once the policy says so. Only the writer
thread touches the files after `replay()`: the event loop appends records to a list and hands
frames over, so it never waits on the disk. Nothing handed over is dropped: frames that hit a
full disk, or a process out of file descriptors when a segment is created, are kept and written,
in order, once space or a descriptor returns. A failed fsync is fatal.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import Any, BinaryIO

from .journal import p50_p99, take_failed

log = logging.getLogger("mqks.log")

HEADER = struct.Struct("<II")  # payload length, crc32 of the payload
HEADER_BYTES = HEADER.size
ZERO_RUN = bytes(512)  # a disk sector that was never written: the mark of a torn write
MAX_PAYLOAD_BYTES = 0xFFFFFFFF
FSYNC_POLICIES = ("always", "everysec", "no")
EVERYSEC_SECONDS = 1.0
DISK_FULL_RETRY_SECONDS = 0.5
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})  # EFBIG: RLIMIT_FSIZE or the fs limit
# a process out of descriptors (clients hold them all) is no disk error: wait for one, as for space
NO_DESCRIPTOR_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE})
FSYNC_SAMPLES = 1024
IOV_FRAMES = os.sysconf("SC_IOV_MAX") // 2  # a header and a payload buffer per frame
FATAL_EXIT_CODE = 70  # EX_SOFTWARE: a supervisor should not restart into the same disk error blindly
SEGMENT_NAME = re.compile(r"^(\d{12})\.log$")


class LogCorrupt(Exception):
    """A bad frame before the tail: names the file and offset and says to start with --repair."""


class _Fatal(Exception):
    """Unwinds the writer thread after on_fatal was called."""


class _Frame:
    """One commit handed to the writer thread."""

    __slots__ = ("number", "header", "payload", "new_segment", "completes", "failed")

    def __init__(self, number: int, header: bytes, payload: bytes, new_segment: bool, completes: bool) -> None:
        self.number = number
        self.header = header
        self.payload = payload
        self.new_segment = new_segment
        self.completes = completes  # the last frame of a snapshot begun by a new_segment frame
        self.failed = False  # reported through poll() once; its bytes are still written later


def _exit_on_fatal(message: str) -> None:
    """The default: a log that cannot promise durability any more must not keep answering ok."""
    log.critical("%s; exiting", message)
    os._exit(FATAL_EXIT_CODE)


def _segment_name(number: int) -> str:
    return f"{number:012d}.log"


def _spare_descriptor() -> int:
    """A descriptor held in reserve (on /dev/null), or -1 when the process has none to spare."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        if e.errno not in NO_DESCRIPTOR_ERRNOS:
            raise
        return -1


def fsync_dir(path: str) -> None:
    """Make a created, truncated or deleted segment's directory entry durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _writev_all(fd: int, bufs: list[Any]) -> tuple[int, OSError | None]:
    """Write every buffer, resuming after short writes; return the bytes written and the error that stopped it."""
    done = 0
    while bufs:
        try:
            n = os.writev(fd, bufs)
        except OSError as e:
            return done, e
        if n == 0:  # a regular file never does this but a full one; do not spin
            return done, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n
        k = 0
        while k < len(bufs) and n >= len(bufs[k]):
            n -= len(bufs[k])
            k += 1
        bufs = bufs[k:]
        if n:
            bufs[0] = memoryview(bufs[0])[n:]
    return done, None


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
        self.segment_bytes = segment_bytes
        self.wake = wake
        self.on_fatal = on_fatal
        if not os.path.isdir(data_dir):
            os.makedirs(data_dir, exist_ok=True)
            fsync_dir(os.path.dirname(os.path.abspath(data_dir)))
        # held for the log's life, so neither a directory fsync nor a new segment needs a descriptor
        # that clients may have taken: the directory's own, and one spare given up to create a segment
        self._dir_fd = os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._spare_fd = _spare_descriptor()
        # loop side: only the loop writes these
        self._records: list[bytes] = []
        self.append = self._records.append  # cleared, never replaced: a bound copy stays valid
        self._commits = 0
        self._handed_bytes = 0
        self.unsynced_bytes = 0
        self._closed = False
        # handed over under the condition; the thread swaps the list out
        self._cond = threading.Condition(threading.Lock())
        self._handed: list[_Frame] = []
        self._stopping = False
        # thread side: only the writer thread writes these once frames flow (replay sets them before)
        self._durable = 0
        self._durable_bytes = 0
        self._failed: deque[int] = deque()  # appends and poplefts are atomic: poll takes no lock
        self.disk_full = False
        self.blocked = None
        self._blocked_by = "disk full"  # set by the failed step, read when the frames it left are stuck
        self._stuck: list[_Frame] = []  # frames a full disk refused, oldest first, retried before any newer
        self._retry_at = 0.0
        self._fd = -1  # the open segment, or -1 before the first write
        self._segment = 0  # the open segment's number
        self._size = 0  # the open segment's size: the end of its last complete frame
        self._dirty = False  # written since the last fdatasync
        self._last_sync = time.monotonic()
        self._snapshot_started: int | None = None  # the segment of a snapshot begun and not yet complete
        self._snapshot_segment: int | None = None  # older segments go once this one is synced
        self._sizes: dict[int, int] = {}  # closed segments' sizes, by number
        self._log_bytes = 0
        self._segments = 0
        self._next_segment = 1
        self._fsyncs = 0
        self._fsync_ms: deque[float] = deque(maxlen=FSYNC_SAMPLES)
        self._replayed_records = 0
        self._truncated_bytes = 0
        self._recovery_seconds = 0.0
        self._resume: int | None = None  # the segment replay verified: appends go to its end
        numbers = self._scan()
        # appending after an unverified tail could bury a torn frame in the middle of the log
        self._refuse: str | None = (f"{data_dir} holds a log: replay() it to the end before the first commit"
                                    if numbers else None)
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
        frame = _Frame(number, HEADER.pack(size, zlib.crc32(payload)), payload, new_segment, completes)
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
        fsync_ms_p50, fsync_ms_p99 = p50_p99(self._fsync_ms)
        return {
            "log_bytes": self._log_bytes,
            "segments": self._segments,
            "commits": self._commits,
            "fsyncs": self._fsyncs,
            "fsync_ms_p50": fsync_ms_p50,
            "fsync_ms_p99": fsync_ms_p99,
            "unsynced_bytes": self.unsynced_bytes,
            "disk_full": self.disk_full,
            "blocked": self.blocked is not None,
            "replayed_records": self._replayed_records,
            "truncated_bytes": self._truncated_bytes,
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
        self._replayed_records = self._truncated_bytes = 0
        numbers = self._scan()
        for i, number in enumerate(numbers):
            last = i == len(numbers) - 1
            path = self._path(number)
            with open(path, "rb") as f:
                offset, bad = yield from self._replay_segment(f)
                if bad is None:
                    continue
                file_size = os.fstat(f.fileno()).st_size
                torn = last and (bad[1] or self._zeros_from(f, offset, file_size))
            dropped = file_size - offset
            if torn:
                log.warning("%s: torn frame at offset %d (%s); truncated %d bytes, the tail of a write "
                            "cut short", path, offset, bad[0], dropped)
            elif repair:
                later = numbers[i + 1:]
                later_bytes = sum(self._sizes.pop(n, 0) for n in later)
                log.error("%s: bad frame at offset %d (%s); --repair truncated %d bytes there and deleted %d "
                          "later segments (%d bytes): %s", path, offset, bad[0], dropped, len(later),
                          later_bytes, ", ".join(_segment_name(n) for n in later) or "none")
                for n in later:
                    os.unlink(self._path(n))
                if later:
                    fsync_dir(self.data_dir)
                self._log_bytes -= later_bytes
                self._segments -= len(later)
                dropped += later_bytes
                numbers = numbers[:i + 1]
                self._next_segment = number + 1
            else:
                raise LogCorrupt(f"{path}: bad frame at offset {offset}; "
                                 "start with --repair to truncate the log there")
            self._truncate(path, offset)
            self._sizes[number] = offset
            self._log_bytes -= file_size - offset
            self._truncated_bytes += dropped
            break
        if numbers:
            self._resume = numbers[-1]
            self._log_bytes -= self._sizes.pop(numbers[-1], 0)  # counted again as the open segment
            self._size = os.path.getsize(self._path(numbers[-1]))
            self._log_bytes += self._size
        self._refuse = None
        self._recovery_seconds = time.perf_counter() - started

    def _replay_segment(self, f: BinaryIO) -> Generator[bytes, None, tuple[int, tuple[str, bool] | None]]:
        """Yield one segment's records; return (offset of the first bad frame, (why, reaches the end)) or None."""
        file_size = os.fstat(f.fileno()).st_size
        offset = 0
        crc32, unpack = zlib.crc32, HEADER.unpack
        while True:
            head = f.read(HEADER_BYTES)
            if not head:
                return offset, None
            if len(head) < HEADER_BYTES:
                return offset, ("short header", True)
            size, crc = unpack(head)
            end = offset + HEADER_BYTES + size
            if size == 0:
                return offset, ("empty frame", end >= file_size)
            if end > file_size:  # checked before reading: a bad length must not allocate gigabytes
                return offset, ("short payload", True)
            payload = f.read(size)
            if crc32(payload) != crc:
                # a write cut short by a crash leaves zeros where its pages never reached the disk;
                # a complete last frame whose checksum fails with no such trace is damage, not a torn
                # write: refuse to start rather than drop it (it may hold confirmed messages)
                torn_trace = payload.endswith(b"\0") or ZERO_RUN in payload
                return offset, ("checksum mismatch", end == file_size and torn_trace)
            lines = payload.split(b"\n")
            self._replayed_records += len(lines)
            yield from lines
            offset = end

    @staticmethod
    def _zeros_from(f: BinaryIO, offset: int, file_size: int) -> bool:
        """Whether the file holds only zero bytes from offset on: a tail some filesystems leave after a crash."""
        f.seek(offset)
        while chunk := f.read(1 << 20):
            if chunk.count(0) != len(chunk):
                return False
        return file_size > offset

    def _truncate(self, path: str, offset: int) -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, offset)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _scan(self) -> list[int]:
        """The segments on disk, oldest first; resets the size counters to them."""
        numbers = sorted(int(m.group(1)) for m in map(SEGMENT_NAME.match, os.listdir(self.data_dir)) if m)
        self._sizes = {number: os.path.getsize(self._path(number)) for number in numbers}
        self._log_bytes = sum(self._sizes.values())
        self._segments = len(numbers)
        self._next_segment = numbers[-1] + 1 if numbers else 1
        self._resume = None
        self._size = 0
        return numbers

    def _path(self, number: int) -> str:
        return os.path.join(self.data_dir, _segment_name(number))

    def _run(self) -> None:
        try:
            self._write_until_closed()
        except _Fatal:
            pass
        except BaseException as e:  # a bug: never leave the broker waiting on a dead thread in silence
            self._die(f"log writer of {self.data_dir} failed: {e!r}")

    def _write_until_closed(self) -> None:
        cond = self._cond
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
            if self._dirty and self.fsync == "everysec" and time.monotonic() - self._last_sync >= EVERYSEC_SECONDS:
                self._sync()
            if stopping and not self._stuck:
                if self._dirty:
                    self._sync()  # every policy: a clean stop leaves nothing to the OS
                if self._fd >= 0:
                    os.close(self._fd)
                    self._fd = -1
                for fd in (self._dir_fd, self._spare_fd):
                    if fd >= 0:
                        os.close(fd)
                self._dir_fd = self._spare_fd = -1
                return

    def _wait_seconds(self) -> float | None:
        """How long the idle thread may sleep: until a disk-full retry or the everysec sync is due."""
        now = time.monotonic()
        waits = []
        if self._stuck:
            waits.append(self._retry_at - now)
        if self._dirty and self.fsync == "everysec":
            waits.append(self._last_sync + EVERYSEC_SECONDS - now)
        return min(waits) if waits else None

    def _write_batch(self, frames: list[_Frame]) -> None:
        """Write the stuck frames then the new ones, apply the policy, publish durability, wake the loop."""
        todo = self._stuck + frames if self._stuck else frames
        written = self._write_frames(todo)
        failed = []
        if written < len(todo):
            self._stuck = todo[written:]
            self._retry_at = time.monotonic() + DISK_FULL_RETRY_SECONDS
            for frame in self._stuck:
                if not frame.failed:
                    frame.failed = True
                    failed.append(frame.number)
            if self.blocked is None:
                self.blocked = self._blocked_by
                self.disk_full = self._blocked_by == "disk full"
                log.error("%s: %s; %d frames wait in memory and are retried every %g s",
                          self._path(self._segment), self.blocked, len(self._stuck), DISK_FULL_RETRY_SECONDS)
        else:
            self._stuck = []
            if self.blocked is not None:
                log.warning("%s: written again after %s", self._path(self._segment), self.blocked)
                self.blocked = None
                self.disk_full = False
        if written:
            if self.fsync == "always" and self._dirty:
                self._sync()
            if self._snapshot_segment is not None:
                self._drop_before_snapshot()
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

    def _write_frames(self, frames: list[_Frame]) -> int:
        """Write frames in order, one writev per run in one file; how many were written whole."""
        i, n = 0, len(frames)
        while i < n:
            first = frames[i]
            rotate = self._fd < 0 or (first.new_segment and self._size > 0) or self._size >= self.segment_bytes
            if rotate and not self._open_segment(first.new_segment):
                return i
            # a run: frames that go to this file, up to IOV_MAX buffers
            j, run_bytes = i + 1, HEADER_BYTES + len(first.payload)
            while (j < n and j - i < IOV_FRAMES and not frames[j].new_segment
                   and self._size + run_bytes < self.segment_bytes):
                run_bytes += HEADER_BYTES + len(frames[j].payload)
                j += 1
            bufs: list[Any] = []
            for frame in frames[i:j]:
                bufs.append(frame.header)
                bufs.append(frame.payload)
            done, error = _writev_all(self._fd, bufs)
            if done:
                self._dirty = True
            if error is None:
                self._size += run_bytes
                self._log_bytes += run_bytes
                self._note_snapshot(frames[i:j])
                i = j
                continue
            whole, whole_bytes = 0, 0
            for frame in frames[i:j]:
                if whole_bytes + HEADER_BYTES + len(frame.payload) > done:
                    break
                whole_bytes += HEADER_BYTES + len(frame.payload)
                whole += 1
            self._disk_error(error, self._size + whole_bytes)
            self._size += whole_bytes
            self._log_bytes += whole_bytes
            self._note_snapshot(frames[i : i + whole])
            return i + whole
        return n

    def _note_snapshot(self, written: list[_Frame]) -> None:
        """A snapshot's first frame opened this segment; its last one lets the older segments go."""
        for frame in written:
            if frame.new_segment:
                self._snapshot_started = self._segment
            if frame.completes and self._snapshot_started is not None:
                self._snapshot_segment, self._snapshot_started = self._snapshot_started, None

    def _disk_error(self, error: OSError, size: int) -> None:
        """After a failed write: cut the file back to its last whole frame, or die if the disk is not just full."""
        path = self._path(self._segment)
        if error.errno not in DISK_FULL_ERRNOS:
            self._die(f"write of {path} failed: {error}")
        self._blocked_by = "disk full"
        try:
            os.ftruncate(self._fd, size)
        except OSError as e:
            # a partial frame left in place would be a bad frame in the middle once later frames follow
            self._die(f"truncating {path} to {size} after a failed write ({error}) failed: {e}")

    def _open_segment(self, snapshot: bool) -> bool:
        """Make the segment the next frame goes to current; False when the disk is too full to create it."""
        if self._fd < 0 and self._resume is not None:
            number, self._resume = self._resume, None
            self._fd = os.open(self._path(number), os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            self._segment = number
            if not ((snapshot and self._size > 0) or self._size >= self.segment_bytes):
                return True
        if self._fd >= 0:
            # sync before leaving it: a torn frame may only ever sit at the end of the last segment
            if self._dirty and (self.fsync != "no" or self._snapshot_started is not None
                                or self._snapshot_segment == self._segment):
                self._sync()
            os.close(self._fd)
            self._fd = -1
            self._sizes[self._segment] = self._size
        number = self._next_segment
        path = self._path(number)
        try:
            fd = self._create(path)
        except OSError as e:
            if e.errno in NO_DESCRIPTOR_ERRNOS:
                self._blocked_by = "out of file descriptors"
                return False
            if e.errno not in DISK_FULL_ERRNOS:
                self._die(f"creating {path} failed: {e}")
            self._blocked_by = "disk full"
            return False
        self._fd, self._segment, self._size, self._dirty = fd, number, 0, False
        self._next_segment = number + 1
        self._segments += 1
        self._sync_dir()
        return True

    def _create(self, path: str) -> int:
        """Create a segment; out of descriptors, give up the spare for it and take a new spare after."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            if e.errno not in NO_DESCRIPTOR_ERRNOS or self._spare_fd < 0:
                raise
            os.close(self._spare_fd)
            self._spare_fd = -1
            fd = os.open(path, flags, 0o644)  # the loop's thread may take the spare first: then retried later
        if self._spare_fd < 0:
            self._spare_fd = _spare_descriptor()
            if self._spare_fd < 0:
                log.warning("%s: no spare descriptor left for the next segment", self.data_dir)
        return fd

    def _drop_before_snapshot(self) -> None:
        """Once the snapshot's segment is synced (on any policy), delete every older segment, oldest first.

        A crash part way leaves a suffix of them: replay yields those before the snapshot frame,
        which therefore has to start by resetting the state it rebuilds.
        """
        snapshot = self._snapshot_segment
        assert snapshot is not None
        if snapshot == self._segment and self._dirty:
            self._sync()
        self._snapshot_segment = None
        dropped = sorted(n for n in self._sizes if n < snapshot)
        for number in dropped:
            try:
                os.unlink(self._path(number))
            except FileNotFoundError:
                pass
            except OSError as e:
                log.error("%s: not deleted after a snapshot: %s", self._path(number), e)
                continue
            self._log_bytes -= self._sizes.pop(number)
            self._segments -= 1
        if dropped:
            self._sync_dir()

    def _sync(self) -> None:
        """fdatasync the open segment; a failure is fatal, never retried (fsyncgate)."""
        started = time.perf_counter()
        try:
            os.fdatasync(self._fd)
        except OSError as e:
            self._die(f"fsync of {self._path(self._segment)} failed: {e}")
        self._fsync_ms.append((time.perf_counter() - started) * 1000.0)
        self._fsyncs += 1
        self._dirty = False
        self._last_sync = time.monotonic()

    def _sync_dir(self) -> None:
        try:
            os.fsync(self._dir_fd)
        except OSError as e:
            self._die(f"fsync of {self.data_dir} failed: {e}")

    def _die(self, message: str) -> None:
        """Report a fatal disk error once and stop the writer thread."""
        self.on_fatal(message)
        raise _Fatal(message)

"""The disk log's files (log.py's `Log` drives them): one segment file after another in a data dir.

Invariants: a frame is one commit (8-byte header `<II` payload length, crc32 of the payload;
then the records joined with newlines) and never spans two files; a torn frame may only ever
sit at the end of the last segment (a segment is synced before the next one opens, unless the
policy is `no`); the segments a snapshot replaced go only once the snapshot's last frame is on
disk. `scan` and `replay` run before the first frame; after that only the writer thread touches
the files. A failed fsync, or a disk error other than a full disk, is fatal.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import struct
import time
import zlib
from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import Any, BinaryIO

log = logging.getLogger("mqks.log")

HEADER = struct.Struct("<II")  # payload length, crc32 of the payload
HEADER_BYTES = HEADER.size
ZERO_RUN = bytes(512)  # a disk sector that was never written: the mark of a torn write
FSYNC_POLICIES = ("always", "everysec", "no")
EVERYSEC_SECONDS = 1.0
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})  # EFBIG: RLIMIT_FSIZE or the fs limit
# a process out of descriptors (clients hold them all) is no disk error: wait for one, as for space
NO_DESCRIPTOR_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE})
FSYNC_SAMPLES = 1024
IOV_FRAMES = os.sysconf("SC_IOV_MAX") // 2  # a header and a payload buffer per frame
SEGMENT_NAME = re.compile(r"^(\d{12})\.log$")


class LogCorrupt(Exception):
    """A bad frame before the tail: names the file and offset and says to start with --repair."""


class Fatal(Exception):
    """Unwinds the writer thread after on_fatal was called."""


class Frame:
    """One commit handed to the writer thread."""

    __slots__ = ("number", "header", "payload", "new_segment", "completes", "failed")

    def __init__(self, number: int, header: bytes, payload: bytes, new_segment: bool, completes: bool) -> None:
        self.number = number
        self.header = header
        self.payload = payload
        self.new_segment = new_segment
        self.completes = completes  # the last frame of a snapshot begun by a new_segment frame
        self.failed = False  # reported through poll() once; its bytes are still written later


def segment_name(number: int) -> str:
    return f"{number:012d}.log"


def spare_descriptor() -> int:
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


def writev_all(fd: int, bufs: list[Any]) -> tuple[int, OSError | None]:
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


def zeros_from(f: BinaryIO, offset: int, file_size: int) -> bool:
    """Whether the file holds only zero bytes from offset on: a tail some filesystems leave after a crash."""
    f.seek(offset)
    while chunk := f.read(1 << 20):
        if chunk.count(0) != len(chunk):
            return False
    return file_size > offset


def truncate(path: str, offset: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


class Segments:
    """The segment files of `data_dir`: read back by `replay`, then written in runs of frames, synced and rotated.

    The counters (`log_bytes`, `count`, `fsyncs`, ...) have one writer each: replay before the
    first frame, the writer thread after; the loop only reads them for stats.
    """

    def __init__(self, data_dir: str, fsync: str, segment_bytes: int, on_fatal: Callable[[str], None]) -> None:
        self.data_dir = data_dir
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        self.on_fatal = on_fatal
        if not os.path.isdir(data_dir):
            os.makedirs(data_dir, exist_ok=True)
            fsync_dir(os.path.dirname(os.path.abspath(data_dir)))
        # held for the log's life, so neither a directory fsync nor a new segment needs a descriptor
        # that clients may have taken: the directory's own, and one spare given up to create a segment
        self._dir_fd = os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._spare_fd = spare_descriptor()
        self.blocked_by = "disk full"  # set by the failed step, read when the frames it left are stuck
        self._fd = -1  # the open segment, or -1 before the first write
        self.segment = 0  # the open segment's number
        self._size = 0  # the open segment's size: the end of its last complete frame
        self.dirty = False  # written since the last fdatasync
        self.last_sync = time.monotonic()
        self._snapshot_started: int | None = None  # the segment of a snapshot begun and not yet complete
        self._snapshot_segment: int | None = None  # older segments go once this one is synced
        self._sizes: dict[int, int] = {}  # closed segments' sizes, by number
        self.log_bytes = 0
        self.count = 0  # segments on disk
        self._next_segment = 1
        self.fsyncs = 0
        self.fsync_ms: deque[float] = deque(maxlen=FSYNC_SAMPLES)
        self.replayed_records = 0
        self.truncated_bytes = 0
        self._resume: int | None = None  # the segment replay verified: appends go to its end

    def path(self, number: int) -> str:
        return os.path.join(self.data_dir, segment_name(number))

    def scan(self) -> list[int]:
        """The segments on disk, oldest first; resets the size counters to them."""
        numbers = sorted(int(m.group(1)) for m in map(SEGMENT_NAME.match, os.listdir(self.data_dir)) if m)
        self._sizes = {number: os.path.getsize(self.path(number)) for number in numbers}
        self.log_bytes = sum(self._sizes.values())
        self.count = len(numbers)
        self._next_segment = numbers[-1] + 1 if numbers else 1
        self._resume = None
        self._size = 0
        return numbers

    def replay(self, repair: bool) -> Iterator[bytes]:
        """Every record of every durable frame, oldest segment first; a torn tail is cut off and logged.

        A bad frame anywhere but at the very end of the last segment raises LogCorrupt, or with
        repair=True cuts the log there (deleting later segments) and says what it dropped.
        """
        self.replayed_records = self.truncated_bytes = 0
        numbers = self.scan()
        for i, number in enumerate(numbers):
            last = i == len(numbers) - 1
            path = self.path(number)
            with open(path, "rb") as f:
                offset, bad = yield from self._replay_segment(f)
                if bad is None:
                    continue
                file_size = os.fstat(f.fileno()).st_size
                torn = last and (bad[1] or zeros_from(f, offset, file_size))
            dropped = file_size - offset
            if torn:
                log.warning("%s: torn frame at offset %d (%s); truncated %d bytes, the tail of a write "
                            "cut short", path, offset, bad[0], dropped)
            elif repair:
                later = numbers[i + 1:]
                later_bytes = sum(self._sizes.pop(n, 0) for n in later)
                log.error("%s: bad frame at offset %d (%s); --repair truncated %d bytes there and deleted %d "
                          "later segments (%d bytes): %s", path, offset, bad[0], dropped, len(later),
                          later_bytes, ", ".join(segment_name(n) for n in later) or "none")
                for n in later:
                    os.unlink(self.path(n))
                if later:
                    fsync_dir(self.data_dir)
                self.log_bytes -= later_bytes
                self.count -= len(later)
                dropped += later_bytes
                numbers = numbers[:i + 1]
                self._next_segment = number + 1
            else:
                raise LogCorrupt(f"{path}: bad frame at offset {offset}; "
                                 "start with --repair to truncate the log there")
            truncate(path, offset)
            self._sizes[number] = offset
            self.log_bytes -= file_size - offset
            self.truncated_bytes += dropped
            break
        if numbers:
            self._resume = numbers[-1]
            self.log_bytes -= self._sizes.pop(numbers[-1], 0)  # counted again as the open segment
            self._size = os.path.getsize(self.path(numbers[-1]))
            self.log_bytes += self._size

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
            self.replayed_records += len(lines)
            yield from lines
            offset = end

    def write(self, frames: list[Frame]) -> int:
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
            done, error = writev_all(self._fd, bufs)
            if done:
                self.dirty = True
            if error is None:
                self._size += run_bytes
                self.log_bytes += run_bytes
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
            self.log_bytes += whole_bytes
            self._note_snapshot(frames[i : i + whole])
            return i + whole
        return n

    def written(self) -> None:
        """After frames were written: sync under `always`, and let go of what a completed snapshot replaced."""
        if self.fsync == "always" and self.dirty:
            self.sync()
        if self._snapshot_segment is not None:
            self._drop_before_snapshot()

    def sync_due_in(self, now: float) -> float | None:
        """Seconds until `everysec` owes a sync (0 or less: now), or None when none is owed."""
        if self.dirty and self.fsync == "everysec":
            return self.last_sync + EVERYSEC_SECONDS - now
        return None

    def close(self) -> None:
        """The writer stops: sync on every policy (a clean stop leaves nothing to the OS) and close the files."""
        if self.dirty:
            self.sync()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        for fd in (self._dir_fd, self._spare_fd):
            if fd >= 0:
                os.close(fd)
        self._dir_fd = self._spare_fd = -1

    def _note_snapshot(self, written: list[Frame]) -> None:
        """A snapshot's first frame opened this segment; its last one lets the older segments go."""
        for frame in written:
            if frame.new_segment:
                self._snapshot_started = self.segment
            if frame.completes and self._snapshot_started is not None:
                self._snapshot_segment, self._snapshot_started = self._snapshot_started, None

    def _disk_error(self, error: OSError, size: int) -> None:
        """After a failed write: cut the file back to its last whole frame, or die if the disk is not just full."""
        path = self.path(self.segment)
        if error.errno not in DISK_FULL_ERRNOS:
            self.die(f"write of {path} failed: {error}")
        self.blocked_by = "disk full"
        try:
            os.ftruncate(self._fd, size)
        except OSError as e:
            # a partial frame left in place would be a bad frame in the middle once later frames follow
            self.die(f"truncating {path} to {size} after a failed write ({error}) failed: {e}")

    def _open_segment(self, snapshot: bool) -> bool:
        """Make the segment the next frame goes to current; False when the disk is too full to create it."""
        if self._fd < 0 and self._resume is not None:
            number, self._resume = self._resume, None
            self._fd = os.open(self.path(number), os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            self.segment = number
            if not ((snapshot and self._size > 0) or self._size >= self.segment_bytes):
                return True
        if self._fd >= 0:
            # sync before leaving it: a torn frame may only ever sit at the end of the last segment
            if self.dirty and (self.fsync != "no" or self._snapshot_started is not None
                               or self._snapshot_segment == self.segment):
                self.sync()
            os.close(self._fd)
            self._fd = -1
            self._sizes[self.segment] = self._size
        number = self._next_segment
        path = self.path(number)
        try:
            fd = self._create(path)
        except OSError as e:
            if e.errno in NO_DESCRIPTOR_ERRNOS:
                self.blocked_by = "out of file descriptors"
                return False
            if e.errno not in DISK_FULL_ERRNOS:
                self.die(f"creating {path} failed: {e}")
            self.blocked_by = "disk full"
            return False
        self._fd, self.segment, self._size, self.dirty = fd, number, 0, False
        self._next_segment = number + 1
        self.count += 1
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
            self._spare_fd = spare_descriptor()
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
        if snapshot == self.segment and self.dirty:
            self.sync()
        self._snapshot_segment = None
        dropped = sorted(n for n in self._sizes if n < snapshot)
        for number in dropped:
            try:
                os.unlink(self.path(number))
            except FileNotFoundError:
                pass
            except OSError as e:
                log.error("%s: not deleted after a snapshot: %s", self.path(number), e)
                continue
            self.log_bytes -= self._sizes.pop(number)
            self.count -= 1
        if dropped:
            self._sync_dir()

    def sync(self) -> None:
        """fdatasync the open segment; a failure is fatal, never retried (fsyncgate)."""
        started = time.perf_counter()
        try:
            os.fdatasync(self._fd)
        except OSError as e:
            self.die(f"fsync of {self.path(self.segment)} failed: {e}")
        self.fsync_ms.append((time.perf_counter() - started) * 1000.0)
        self.fsyncs += 1
        self.dirty = False
        self.last_sync = time.monotonic()

    def _sync_dir(self) -> None:
        try:
            os.fsync(self._dir_fd)
        except OSError as e:
            self.die(f"fsync of {self.data_dir} failed: {e}")

    def die(self, message: str) -> None:
        """Report a fatal disk error once and stop the writer thread."""
        self.on_fatal(message)
        raise Fatal(message)

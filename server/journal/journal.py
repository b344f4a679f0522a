"""The records of each batch, committed as one frame, and the confirms that wait
for them to be durable.

With `mqksd --data-dir` the brokers call their record hook (`Broker.record`, the journal's
`append`) with each change of durable state, as a record of records.py. After the batch,
`Journal.commit` closes what was appended into one frame of the log; a confirm is answered
once the log reports that frame durable. A snapshot rewrites the live state so older
segments can go.

The log is an interface (`Log`): server/journal/log.py, segment files on the local disk, is its
first implementation; another (a replicated stream) is one more module with the same five
calls, and nothing but app.py's choice of it has to know.

A copy delivered at once to an auto-ack consumer is never written. Acks do not wait for the
disk: a lost ack is one redelivery.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import groupby
from typing import Any, Protocol

from . import records

log = logging.getLogger("mqks.durable")

SNAPSHOT_MIN_GROWTH_BYTES = 128 << 20  # never rewrite the live state for less churn than this
SNAPSHOT_GROWTH = 0.5  # rewrite once the log grew by half the last snapshot: disk <= ~1.5x live + slack
MAX_UNSYNCED_BYTES = 64 << 20  # past this, publishers stop being read until the disk catches up
# a snapshot goes out in frames of this size, each written before the next is built, so it never
# holds a second copy of the live state (one frame of 1.2M messages doubled the peak: 264 -> 535 MiB)
SNAPSHOT_CHUNK_BYTES = 4 << 20
SNAPSHOT_WAIT_SECONDS = 0.001  # how often a snapshot looks whether the writer took its last frame
OK_AFTER_RID = b" ok \n"  # `{rid} ok` as a confirm answers (wire.protocol.format_ok)


class Log(Protocol):
    """What the journal needs of `server.log.Log` (the storage layer)."""

    unsynced_bytes: int
    disk_full: bool
    blocked: str | None
    fenced_by: str | None  # set once another writer took the log over: stop
    where: str  # where a durable record is, for an error: "on disk"

    @property
    def handed_bytes(self) -> int: ...

    @property
    def frames_waiting(self) -> bool: ...

    def append(self, record: bytes) -> None: ...

    def commit(self, new_segment: bool = False, completes: bool | None = None) -> int | None: ...

    def poll(self) -> tuple[int, list[int]]: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self, timeout_seconds: float | None = None) -> None: ...

    def replay(self, repair: bool = False) -> Iterator[bytes]: ...


def take_failed(durable: int, failed: deque[int]) -> tuple[int, list[int]]:
    """A Log's `poll` answer: its highest durable commit, and the failed commits taken out of `failed` (one at a
    time: a writer thread may append meanwhile, and a deque's append and popleft are atomic)."""
    if not failed:
        return durable, []
    numbers = []
    while failed:
        numbers.append(failed.popleft())
    return durable, numbers


def p50_p99(samples_ms: deque[float]) -> tuple[float, float]:
    """The median and the 99th percentile of a Log's latest write latencies (0.0 before the first)."""
    ordered = sorted(tuple(samples_ms))  # a copy first: the writer may append while this sorts
    n = len(ordered)
    return (ordered[n // 2], ordered[min(n - 1, n * 99 // 100)]) if n else (0.0, 0.0)



def answers_into(target: Any) -> Any:
    """The outbox a confirm's answers reach: the target itself, or the one a wrapper (a quiet publish's) writes to."""
    return getattr(target, "outbox", target)

class Journal:
    """The process's records and the confirms that wait for them to be durable."""

    def __init__(self, log_: Log, error_line: Callable[[bytes, str], bytes],
                 snapshot_min_growth_bytes: int = SNAPSHOT_MIN_GROWTH_BYTES) -> None:
        self.log = log_
        self.append = log_.append
        # what holds the log's `blocked`, read once a confirmed publish: a replicated log's writer, whose
        # JetStreamLog.blocked is a property over it (two property calls a publish: 55 -> 28 ns), else the log
        self.blocked_in = getattr(log_, "blocked_in", log_)
        self.error_line = error_line  # (rid, reason) -> the error line, with a fresh error id
        self.last_commit = 0  # the newest commit handed to the log
        self.durable = 0  # the newest commit the log reported durable
        self.waiting: deque[tuple[int, list[Any]]] = deque()  # (commit, its confirms)
        # confirms of the batch not yet committed: a handler appends an outbox and a rid, and the
        # client gets `{rid} ok` once everything recorded so far is durable under the policy
        # flat (outbox, rid, outbox, rid...), not a tuple a confirm: each tuple lived until its commit was durable,
        # and the garbage collector ran every 700 of them (py-spy of a cluster's 3-client cell: the collector 2.9 %
        # of the samples, the part with a stack under confirm_later; 70 -> 59 ns a confirm and answer without it)
        self.unconfirmed: list[Any] = []
        self.snapshot_mark = 0  # the log's handed_bytes when the last snapshot was committed
        self.last_snapshot_bytes = 0
        self.snapshot_min_growth_bytes = snapshot_min_growth_bytes
        self.snapshots = 0

    @property
    def backlogged(self) -> bool:
        return self.log.unsynced_bytes > MAX_UNSYNCED_BYTES

    @property
    def disk_full(self) -> bool:
        return self.log.disk_full

    @property
    def fenced_by(self) -> str | None:
        """Why this broker must stop (its replicated log was taken over), or None."""
        return self.log.fenced_by

    @property
    def blocked(self) -> str | None:
        """Why the log cannot write now (confirmed publishes are refused), or None."""
        return self.blocked_in.blocked

    def confirm_later(self, outbox: Any, rid: bytes) -> None:
        """Answer `{rid} ok` into `outbox` once everything recorded so far is durable (a commit or two from now)."""
        unconfirmed = self.unconfirmed
        unconfirmed.append(outbox)
        unconfirmed.append(rid)

    def owes(self, outbox: Any) -> bool:
        """True while a confirm owed to `outbox` waits for the log: its own, or one a target writing into it holds (a
        quiet publish's, whose error, if its commit fails, is still the client's)."""
        return any(answers_into(owed) is outbox for owed in self.unconfirmed[::2]) or any(
            answers_into(owed) is outbox for _, confirms in self.waiting for owed in confirms[::2])

    def refusal(self) -> str:
        """Why a confirmed publish is refused while the log cannot write."""
        if self.log.disk_full:
            return "disk full: confirmed publishes are refused until the data dir has room again"
        return f"{self.log.blocked}: confirmed publishes are refused until the log can write again"

    def commit(self) -> None:
        """Close the batch into one frame (a no-op without records) and queue its confirms."""
        number = self.log.commit()
        if number is not None:
            self.last_commit = number
        if self.unconfirmed:
            # a confirm whose publish wrote nothing (every copy went to auto-ack consumers at
            # once) still waits for what came before it: confirms keep their order
            if self.last_commit <= self.durable:
                answer_ok(self.unconfirmed)
            else:
                self.waiting.append((self.last_commit, self.unconfirmed))
            self.unconfirmed = []

    def settle(self) -> None:
        """After the log woke us: answer the confirms that became durable, or failed."""
        durable, failed = self.log.poll()
        self.durable = max(self.durable, durable)
        waiting = self.waiting
        if failed:
            # in the order they were owed: a durable commit before a failed one is answered first
            failed_commits = set(failed)
            kept: deque[tuple[int, list[Any]]] = deque()
            for commit, confirms in waiting:
                if commit in failed_commits:
                    reason = (f"{self.log.blocked or 'disk full'}: the message is kept in memory but is not "
                              f"{self.log.where}")
                    for outbox, rid in zip(confirms[::2], confirms[1::2], strict=True):
                        outbox.write(self.error_line(rid, reason))
                elif commit <= self.durable and not kept:
                    answer_ok(confirms)
                else:
                    kept.append((commit, confirms))
            self.waiting = waiting = kept
        while waiting and waiting[0][0] <= self.durable:
            answer_ok(waiting.popleft()[1])

    def count_as_churn(self, size: int) -> None:
        """Count `size` bytes (a log replayed at start) as written since the last snapshot."""
        self.snapshot_mark -= size

    def wants_snapshot(self) -> bool:
        growth = max(self.snapshot_min_growth_bytes, int(self.last_snapshot_bytes * SNAPSHOT_GROWTH))
        return self.log.handed_bytes - self.snapshot_mark > growth

    def snapshot(self, lines: Iterable[bytes]) -> None:
        """Write the whole live state (`lines`, snapshot.py's records) in frames from a new segment on; the log
        drops older segments once the last of them is durable."""
        self.commit()  # what came before stays before
        started = time.monotonic()
        size = chunk = 0
        log_ = self.log
        append = log_.append
        append(records.SNAPSHOT_BEGIN)
        first = True
        for line in lines:
            size += len(line) + 1
            chunk += len(line) + 1
            append(line)
            if chunk >= SNAPSHOT_CHUNK_BYTES:
                # no other greenlet runs until the snapshot ends (nothing yields here): the frames
                # hold one point in time, and no record of a later change comes between them
                self.last_commit = log_.commit(new_segment=first, completes=False) or self.last_commit
                first, chunk = False, 0
                self._wait_for_the_writer()
        append(records.SNAPSHOT_END)
        number = log_.commit(new_segment=first, completes=True)
        if number is not None:
            self.last_commit = number
        self.last_snapshot_bytes = size
        self.snapshot_mark = self.log.handed_bytes
        self.snapshots += 1
        log.info("snapshot of the live state: %d bytes in %.3f s", size, time.monotonic() - started)

    def _wait_for_the_writer(self) -> None:
        """Block (the whole loop) until the writer thread has taken the last chunk, so at most two exist:
        the one it writes and the one being built. Not on a log that cannot write: then the chunks wait
        in memory, as any commit's do on a full disk; nor on a log whose writer runs in this loop (the
        replicated log's frames_waiting is never true)."""
        log_ = self.log
        while log_.frames_waiting and not log_.blocked:
            time.sleep(SNAPSHOT_WAIT_SECONDS)

    def close(self, timeout_seconds: float | None = None) -> None:
        self.commit()
        self.log.close(timeout_seconds)
        self.settle()

    def stats(self) -> dict[str, Any]:
        waiting = sum(len(confirms) // 2 for _, confirms in self.waiting)
        return {**self.log.stats(), "snapshots": self.snapshots, "confirms_waiting": waiting}


def answer_ok(confirms: list[Any]) -> None:
    """`{rid} ok` to each of `confirms` (outbox, rid, outbox, rid...), one write per run owed to the same client."""
    rids = confirms[1::2]
    start = 0
    for outbox, run in groupby(confirms[::2]):
        end = start + len(list(run))
        # joined on the answer's middle: 48 -> 22 ns a confirm against a format each (2,000 in two runs)
        outbox.write(OK_AFTER_RID.join(rids[start:end]) + OK_AFTER_RID)
        start = end

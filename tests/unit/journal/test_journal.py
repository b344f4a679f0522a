"""The journal (server/journal/journal.py) over a fake Log: a confirm is answered only once its commit and every
earlier one are durable, in the order they were owed; a commit that fails answers its confirms with the log's
reason; a publish that wrote nothing still waits for what came before it; a snapshot goes out in frames from a
new segment. In process: the Log is this file's, the outboxes are real."""

from __future__ import annotations

import gc
from collections import deque
from typing import Any

import pytest

from mqks.server.dispatch.actions import QuietAnswers
from mqks.server.journal import records
from mqks.server.journal.jetstream_log import JetStreamLog
from mqks.server.journal.journal import Journal, p50_p99, take_failed
from mqks.server.wire.outbox import Outbox

pytestmark = pytest.mark.timeout(10)


class FakeLog:
    """A Log whose durability the test decides: `durable` and `failed` are what `poll` reports."""

    where = "in the test's log"

    def __init__(self) -> None:
        self.unsynced_bytes = 0
        self.disk_full = False
        self.blocked: str | None = None
        self.fenced_by: str | None = None
        self.frames: list[tuple[int, list[bytes], bool, bool]] = []  # (number, records, new_segment, completes)
        self.open: list[bytes] = []
        self.durable = 0
        self.failed: list[int] = []
        self.closed = False

    @property
    def handed_bytes(self) -> int:
        return sum(len(record) + 1 for _, frame, _, _ in self.frames for record in frame)

    @property
    def frames_waiting(self) -> bool:
        return False

    def append(self, record: bytes) -> None:
        self.open.append(record)

    def commit(self, new_segment: bool = False, completes: bool | None = None) -> int | None:
        if not self.open:
            return None
        number = len(self.frames) + 1
        self.frames.append((number, self.open, new_segment, new_segment if completes is None else completes))
        self.open = []
        return number

    def poll(self) -> tuple[int, list[int]]:
        failed, self.failed = self.failed, []
        return self.durable, failed

    def stats(self) -> dict[str, Any]:
        return {"commits": len(self.frames)}

    def close(self, timeout_seconds: float | None = None) -> None:
        self.closed = True

    def replay(self, repair: bool = False) -> Any:
        return iter(())


def new_journal() -> tuple[Journal, FakeLog, Outbox, list[Outbox]]:
    log = FakeLog()
    pending: list[Outbox] = []
    journal = Journal(log, lambda rid, reason: b"%b error e1 %b\n" % (rid, reason.encode()))
    return journal, log, Outbox(pending), pending


def written(outbox: Outbox) -> bytes:
    return b"".join(bytes(piece) for piece in outbox.pieces())


def test_a_confirm_waits_for_its_commit_to_be_durable_and_confirms_keep_their_order():
    journal, log, outbox, _ = new_journal()
    journal.append(b"P 1 q 1 x")
    journal.confirm_later(outbox, b"m1")
    journal.commit()
    journal.append(b"P 1 q 2 x")
    journal.confirm_later(outbox, b"m2")
    journal.commit()
    assert [number for number, *_ in log.frames] == [1, 2]
    journal.settle()
    assert outbox.out_bytes == 0 and journal.owes(outbox)
    log.durable = 1
    journal.settle()
    assert written(outbox) == b"m1 ok \n"
    log.durable = 2
    journal.settle()
    assert written(outbox) == b"m1 ok \nm2 ok \n" and not journal.owes(outbox)
    assert journal.stats()["confirms_waiting"] == 0


def test_a_quiet_publishs_confirm_is_owed_to_its_clients_outbox_until_durable():
    """A client that half-closes is written what it is owed first (edges/connection.py `owes_answers_or_bytes`): a
    quiet publish's confirm waits in a wrapper that drops its ok and passes its error, and counted as owed to nobody
    the connection closed before a failed commit's error reached it."""
    journal, log, outbox, _ = new_journal()
    journal.append(b"P 1 q 1 x")
    journal.confirm_later(QuietAnswers(outbox), b"m1")
    journal.commit()
    journal.settle()
    assert journal.owes(outbox) and not journal.owes(Outbox([]))
    log.durable = 1
    journal.settle()
    assert not journal.owes(outbox) and written(outbox) == b""  # its ok is dropped


def test_a_confirm_that_wrote_nothing_still_waits_for_what_came_before():
    journal, log, outbox, _ = new_journal()
    journal.append(b"P 1 q 1 x")
    journal.confirm_later(outbox, b"m1")
    journal.commit()
    journal.confirm_later(outbox, b"m2")  # every copy went to an auto-ack consumer: no record
    journal.commit()
    assert len(log.frames) == 1 and journal.stats()["confirms_waiting"] == 2
    log.durable = 1
    journal.settle()
    assert written(outbox) == b"m1 ok \nm2 ok \n"


def test_a_failed_commit_answers_its_confirms_with_the_logs_reason_and_the_rest_go_on():
    journal, log, outbox, _ = new_journal()
    for rid in (b"m1", b"m2", b"m3"):
        journal.append(b"P 1 q 1 " + rid)
        journal.confirm_later(outbox, rid)
        journal.commit()
    log.blocked = "the replicated log cannot write"
    log.failed = [2]
    log.durable = 1
    journal.settle()
    assert written(outbox) == (b"m1 ok \nm2 error e1 the replicated log cannot write: the message is kept in "
                               b"memory but is not in the test's log\n")
    log.blocked = None
    log.durable = 3
    journal.settle()
    assert written(outbox).endswith(b"m3 ok \n")


def test_blocked_and_fenced_are_the_logs():
    journal, log, _, _ = new_journal()
    assert journal.blocked is None and journal.fenced_by is None
    log.blocked = "NATS out of reach"
    assert journal.refusal() == "NATS out of reach: confirmed publishes are refused until the log can write again"
    log.disk_full = True
    assert journal.refusal().startswith("disk full")
    log.fenced_by = "node b"
    assert journal.fenced_by == "node b"


def test_over_a_replicated_log_blocked_is_its_writers_whoever_sets_it():
    """The journal reads `blocked` where a JetStreamLog keeps it (its writer), not through the log's property: both
    a writer's own stall and the cluster layer's write through the log's setter refuse confirmed publishes."""
    stream_log = JetStreamLog(["nats://127.0.0.1:1"], "s", "test")  # not connected: nothing here talks to NATS
    journal = Journal(stream_log, lambda rid, reason: b"%b error %b\n" % (rid, reason.encode()))
    assert journal.blocked is None
    stream_log.writer.blocked = "the replicated log does not answer"
    assert journal.blocked == "the replicated log does not answer"
    assert journal.refusal().startswith("the replicated log does not answer: confirmed publishes are refused")
    stream_log.blocked = None
    assert journal.blocked is None
    stream_log.blocked = "this node no longer serves the group"
    assert journal.blocked == "this node no longer serves the group"


def test_confirms_waiting_for_their_commit_leave_the_garbage_collector_nothing_to_count():
    """A confirm waits as two list items, not a tuple: a tuple a confirm outlived its batch, and every 700 of them
    ran the collector on the owner (py-spy of the cluster's 3-client cell)."""
    journal, log, outbox, _ = new_journal()
    journal.append(b"P 1 q 1 x")
    gc.disable()
    try:
        gc.collect()
        before = gc.get_count()[0]
        for i in range(1000):
            journal.confirm_later(outbox, b"m%d" % i)
        journal.commit()
        counted = gc.get_count()[0] - before
    finally:
        gc.enable()
    assert counted < 100, f"{counted} containers for 1,000 confirms"
    log.durable = journal.last_commit
    journal.settle()
    assert written(outbox) == b"".join(b"m%d ok \n" % i for i in range(1000))


def test_a_snapshot_is_framed_from_a_new_segment_between_its_begin_and_end_records():
    journal, log, _, _ = new_journal()
    journal.append(b"P 1 q 1 before")
    journal.snapshot([b"N q 2", b"M q 1 0 0 x"])
    (_, before, _, _), (_, snapshot, new_segment, completes) = log.frames
    assert before == [b"P 1 q 1 before"]
    assert snapshot == [records.SNAPSHOT_BEGIN, b"N q 2", b"M q 1 0 0 x", records.SNAPSHOT_END]
    assert new_segment and completes and journal.snapshots == 1
    assert not journal.wants_snapshot()


def test_close_commits_what_is_open_and_answers_what_became_durable():
    journal, log, outbox, _ = new_journal()
    journal.append(b"P 1 q 1 x")
    journal.confirm_later(outbox, b"m1")
    log.durable = 1  # the log makes it durable as it closes
    journal.close()
    assert log.closed and written(outbox) == b"m1 ok \n"


def test_a_logs_poll_takes_each_failed_commit_once():
    """Both logs answer `poll` through journal.take_failed: a failed commit is reported once, then forgotten."""
    failed = deque([3, 5])
    assert take_failed(7, failed) == (7, [3, 5]) and not failed
    assert take_failed(8, failed) == (8, [])


def test_a_logs_latency_percentiles_read_0_before_the_first_sample():
    assert p50_p99(deque()) == (0.0, 0.0)
    assert p50_p99(deque(float(ms) for ms in range(100, 0, -1))) == (51.0, 100.0)
    assert p50_p99(deque([4.0])) == (4.0, 4.0)

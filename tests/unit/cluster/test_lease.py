"""A leased group's owner (server/cluster/lease.py) in its log's writer: idle, it sends its standbys a heartbeat
naming the last sequence it stored (nothing stored, nothing read); it steps down once the log has stored nothing for
the whole lease; a planned move ends with a hand-off frame, after which the node it goes to is no rival and the old
owner answers no owner ping. In process, the writer a greenlet over the fake hub connection and bridge of
tests/unit/journal/test_stream_writer.py."""

from __future__ import annotations

from types import SimpleNamespace

import gevent
import pytest

pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")

from mqks.server.cluster.lease import Lease
from mqks.server.journal.jetstream_log import EPOCH, HANDOFF, LAST, OWNER, JetStreamLog

from ..journal.test_stream_writer import FakeBridge, FakeHub, patch_seconds, stop, until

pytestmark = pytest.mark.timeout(10)

SUBJECT = "mqks.log.s-0-of-2"


def leased_log(lease_seconds: float = 12.0) -> tuple[JetStreamLog, Lease]:
    """A group's log as its owner has it once its takeover (epoch 3) is stored at sequence 7."""
    lease = Lease(lease_seconds)
    stream_log = JetStreamLog(["nats://127.0.0.1:1"], "s-g2-s0-of-1", "node a", group="s-0-of-2",
                              stream_subjects=[SUBJECT, "mqks.log.s-1-of-2"], lease=lease, node="a")
    stream_log.writer._refuse = None  # as after its takeover
    stream_log.writer.epoch, stream_log.writer.tail_seq = 3, 7
    return stream_log, lease


def test_an_idle_owner_beats_with_the_last_sequence_it_stored_and_reads_nothing_for_it() -> None:
    stream_log, lease = leased_log()
    lease.heartbeat_seconds = 0.02
    hub = FakeHub()
    bridge = stream_log.nats.bridge = FakeBridge(last_seq=7)  # type: ignore[assignment]
    writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
    until(lambda: len(hub.published) >= 3)
    stop(stream_log, writer)
    for beat in hub.published:  # core NATS messages: no reply inbox, so no PubAck, nothing stored
        assert (beat.subject, beat.payload, beat.reply) == ("mqks.beat.s-0-of-2", b"", "")
        assert beat.headers == {EPOCH: "3", LAST: "7"}
    assert bridge.calls == 0  # a JetStream API call per heartbeat per group was most of an idle NATS's load


def test_a_log_with_no_lease_sends_no_heartbeat() -> None:
    """One broker's `--log`: no standby listens, and its writer runs with no lease hooks."""
    stream_log = JetStreamLog(["nats://127.0.0.1:1"], "s", "test")
    stream_log.writer._refuse = None
    hub = FakeHub()
    bridge = stream_log.nats.bridge = FakeBridge(last_seq=0, stream_last=0)  # type: ignore[assignment]
    writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
    until(lambda: bridge.calls >= 1)  # its tail check, each TAIL_CHECK_SECONDS: a turn of its idle loop
    stop(stream_log, writer)
    assert stream_log.lease is None and hub.published == []
    assert "mqks.beat.s" not in hub.callbacks


def test_the_lease_sets_the_confirm_timeout_before_a_standby_may_take_over() -> None:
    stream_log, _ = leased_log(lease_seconds=12.0)
    assert stream_log.writer.timeout_seconds == 10.0  # 15 s asked: the lease less its margin
    assert JetStreamLog(["nats://127.0.0.1:1"], "s", "test").writer.timeout_seconds == 15.0


def test_an_owner_whose_log_stores_nothing_for_the_lease_steps_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the lease: confirmed publishes refused and the waiting commits failed; after it: this owner stops, so
    that a standby that can reach NATS takes the group over and its clients move there."""
    patch_seconds(monkeypatch, "ACK_SECONDS", 0.05)
    patch_seconds(monkeypatch, "RETRY_SECONDS", 0.02)
    stream_log, lease = leased_log(lease_seconds=2.4)  # confirms stop after 0.4 s
    hub = FakeHub()
    stream_log.nats.bridge = FakeBridge(last_seq=None)  # type: ignore[assignment]
    writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
    stream_log.append(b"r1")
    stream_log.commit()
    until(lambda: stream_log.blocked is not None)
    assert stream_log.fenced_by is None  # refused, not yet stepped down
    until(lambda: stream_log.fenced_by is not None, seconds=6.0)
    assert "stepped down as the owner of group s-0-of-2" in (stream_log.fenced_by or "")
    assert stream_log.poll() == (0, [1])
    writer.join(timeout=2)
    assert writer.dead
    assert not lease.steps_down(stream_log.writer, "a stall", 2.0)  # within the lease: no step-down


def test_a_planned_move_ends_with_a_hand_off_frame_and_then_the_old_owner_is_silent() -> None:
    """close() after everything is stored: one more frame, empty, naming the node the group goes to; once it is
    stored the old owner answers no owner ping (an answer from it made `mqks cluster move` report the group on the
    node it had just left, CI)."""
    stream_log, lease = leased_log()
    hub = FakeHub()
    stream_log.nats._hub = hub  # type: ignore[assignment]
    stream_log.nats.bridge = SimpleNamespace(close=lambda: None)  # type: ignore[assignment]
    writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
    stream_log.writer._writer = writer
    until(lambda: "mqks.owner.s-0-of-2" in hub.callbacks)
    ping = hub.callbacks["mqks.owner.s-0-of-2"]
    ping("mqks.owner.s-0-of-2", "r1", None, b"")
    assert [message.subject for message in hub.published] == ["r1"]  # the owner answers
    stream_log.handoff_to = "b"
    assert lease.handoff_to == "b"
    closing = gevent.spawn(stream_log.close, 5.0)
    until(lambda: any(message.subject == SUBJECT for message in hub.published))
    index, handoff = next((i, m) for i, m in enumerate(hub.published) if m.subject == SUBJECT)
    assert handoff.payload == b"" and handoff.headers[HANDOFF] == "b"
    assert not lease.handed_over(stream_log.writer)
    hub.ack(index, seq=8)
    closing.join(timeout=3)
    assert closing.dead and lease.handed_over(stream_log.writer)
    ping("mqks.owner.s-0-of-2", "r2", None, b"")
    assert "r2" not in [message.subject for message in hub.published]


def test_the_node_a_group_is_handed_to_is_not_a_rival() -> None:
    """Its takeover can be heard before this owner's own hand-off frame is answered (CI: the old owner read its
    tail, found itself fenced and stopped as taken over instead of as handed over)."""
    stream_log, _ = leased_log()
    stream_log.handoff_to = "b"  # mqks cluster move: this owner hands the group to node b
    hub = FakeHub()
    stream_log.nats.bridge = FakeBridge(last_seq=8)  # type: ignore[assignment]
    writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
    until(lambda: SUBJECT in hub.callbacks)
    hub.callbacks[SUBJECT](SUBJECT, "_INBOX.b.1", {EPOCH: "4", OWNER: "node b"}, b"W 4 b")
    assert stream_log.writer.recovery.rival_check is None and stream_log.writer.recovery.trouble is None
    stop(stream_log, writer)


def test_a_fenced_owner_answers_no_owner_ping() -> None:
    stream_log, _ = leased_log()
    answers: list[str] = []
    stream_log.nats._hub = SimpleNamespace(publish=lambda subject, data: answers.append(subject))  # type: ignore[assignment]
    ping = stream_log.writer._on_owner_ping
    ping("mqks.owner.s-0-of-2", "r1", None, b"")
    stream_log.writer.fenced_by = "node b"
    ping("mqks.owner.s-0-of-2", "r2", None, b"")
    assert answers == ["r1"]

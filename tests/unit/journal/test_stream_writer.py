"""A group's writer in a shared stream (server/journal/stream_writer.py, stream_recovery.py): one frame in flight,
fenced by the subject's last sequence, and every commit handed while it flies goes out in the next frame, together;
a rival's frame heard on the subject, or found by the periodic tail check, sends it to its tail (a leased owner's
heartbeats and hand-off are its lease's: tests/unit/cluster/test_lease.py). In process, the writer a
greenlet, over a fake hub connection that answers each frame only when the test says so. A stream of its own (one
broker's `--log`) holds what is handed while a frame flies, too, and pipelines full frames."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import gevent
import pytest

pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")

from mqks.server.journal import jetstream_log, stream, stream_reader, stream_recovery, stream_writer
from mqks.server.journal.jetstream_log import EPOCH, EXPECTED_OF_SUBJECT, OWNER, JetStreamLog
from mqks.server.journal.journal import SNAPSHOT_CHUNK_BYTES, Journal
from mqks.server.nats_io.nats_bridge import SharedFigures

pytestmark = pytest.mark.timeout(10)


class FakeHub:
    """What the writer uses of the hub's NATS connection: an inbox, subscriptions, and publishes it records (PubAcks
    come from `ack`)."""

    def __init__(self) -> None:
        self.published: list[SimpleNamespace] = []
        self.callbacks: dict[str, Any] = {}
        self.reconnects = 0

    def new_inbox(self) -> str:
        return "_INBOX.w"

    def subscribe(self, subject: str, callback: Any) -> int:
        self.callbacks[subject] = callback
        return len(self.callbacks)

    def publish(self, subject: str, data: bytes, reply: str = "", headers: dict[str, str] | None = None) -> None:
        self.published.append(SimpleNamespace(subject=subject, payload=data, reply=reply, headers=headers))

    def ack(self, index: int, seq: int) -> None:
        """NATS stored the `index`-th frame published at stream sequence `seq`."""
        reply = self.published[index].reply
        data = json.dumps({"stream": "s-g2-s0-of-1", "seq": seq}).encode()
        self.callbacks["_INBOX.w.*"](reply, "", None, data)


class FakeBridge:
    """The bridge as the writer's JetStream API calls see it: the group's last sequence, as its leader answers it
    (None: no answer), and how many calls were made."""

    def __init__(self, last_seq: int | None = 0, stream_last: int | None = None) -> None:
        self.last_seq = last_seq
        self.stream_last = stream_last  # the whole stream's last sequence, as its info says (None: no info)
        self.calls = 0
        self.tail_reads = 0
        self.infos = 0

    def jetstream(self, timeout: float = 5.0) -> Any:
        async def get_last_msg(stream: str, subject: str) -> SimpleNamespace:
            self.tail_reads += 1
            if self.last_seq is None:
                raise TimeoutError("no stream leader")
            return SimpleNamespace(seq=self.last_seq)

        async def stream_info(stream: str, subjects_filter: str | None = None) -> SimpleNamespace:
            if self.stream_last is None:
                raise TimeoutError("no stream leader")
            self.infos += 1
            state = SimpleNamespace(bytes=0, messages=0, subjects={}, last_seq=self.stream_last)
            return SimpleNamespace(state=state, cluster=None)

        return SimpleNamespace(get_last_msg=get_last_msg, stream_info=stream_info)

    def run(self, make: Callable[[Any], Any], timeout: float = 10.0) -> Any:
        self.calls += 1
        return asyncio.run(make(self))


class QuietLease:
    """A lease as the writer sees it, doing nothing of its own (no heartbeat, no step-down, no hand-off): the
    writer's leased checks alone (cluster/lease.py's own are in tests/unit/cluster/test_lease.py)."""

    handoff_to: str | None = None

    def confirm_timeout(self, timeout_seconds: float) -> float:
        return timeout_seconds

    def beat_due(self, writer: Any) -> float:
        return float("inf")

    def idle(self, writer: Any, hub: Any, now: float) -> None:
        pass

    def steps_down(self, writer: Any, reason: str, stalled_for: float) -> bool:
        return False

    def handing_over(self) -> bool:
        return False

    def handed_over(self, writer: Any) -> bool:
        return False

    def before_close(self, writer: Any, deadline: float) -> None:
        pass


def patch_seconds(monkeypatch: pytest.MonkeyPatch, name: str, value: float) -> None:
    """A timing constant, in every module of the log that reads it."""
    for module in (jetstream_log, stream, stream_reader, stream_recovery, stream_writer):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, value)


def until(condition: Callable[[], bool], seconds: float = 2.0) -> None:
    """Let the writer run until `condition` holds; fails after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the writer did not get there"
        gevent.sleep(0.001)


def let_run() -> None:
    for _ in range(5):
        gevent.sleep(0)


def stop(stream_log: JetStreamLog, writer: gevent.Greenlet) -> None:
    stream_log.writer._stopping = True
    stream_log.writer._poke()
    writer.join(timeout=2)
    assert writer.dead


def shared_stream_log(lease: Any = None, frame_wait_seconds: float = 0.0) -> JetStreamLog:
    stream_log = JetStreamLog(["nats://127.0.0.1:1"], "s-g2-s0-of-1", "test", group="s-0-of-2",
                              stream_subjects=["mqks.log.s-0-of-2", "mqks.log.s-1-of-2"], lease=lease,
                              frame_wait_seconds=frame_wait_seconds)
    stream_log.writer._refuse = None  # as after its replay
    return stream_log


def test_commits_handed_during_a_flight_leave_together_as_the_next_frame() -> None:
    stream_log = shared_stream_log()
    hub = FakeHub()

    def scenario() -> None:
        writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
        stream_log.append(b"r1")
        stream_log.commit()
        until(lambda: len(hub.published) == 1)
        for record in (b"r2", b"r3", b"r4"):  # three hub turns, the writer woken between them
            stream_log.append(record)
            stream_log.commit()
            let_run()
        assert len(hub.published) == 1  # one frame in flight: its fence is the sequence it will get
        hub.ack(0, seq=7)
        until(lambda: len(hub.published) == 2)
        assert hub.published[1].payload == b"r2\nr3\nr4"  # not three frames, one per PubAck
        hub.ack(1, seq=9)
        until(lambda: stream_log.poll()[0] == 4)
        stop(stream_log, writer)

    scenario()
    first, second = hub.published
    assert (first.subject, first.payload) == ("mqks.log.s-0-of-2", b"r1")
    assert second.headers[EXPECTED_OF_SUBJECT] == "7"  # fenced on the frame before it


def test_with_a_frame_wait_the_next_frame_waits_after_its_stored_predecessor_and_takes_what_came_meanwhile() -> None:
    stream_log = shared_stream_log(frame_wait_seconds=0.2)
    hub = FakeHub()

    def scenario() -> None:
        writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
        stream_log.append(b"r1")
        stream_log.commit()
        until(lambda: len(hub.published) == 1)  # the first goes at once: nothing was sent before it
        hub.ack(0, seq=3)
        for record in (b"r2", b"r3"):
            stream_log.append(record)
            stream_log.commit()
            let_run()
        assert len(hub.published) == 1  # stored, and still no second frame: it waits out the frame wait
        until(lambda: len(hub.published) == 2)
        stop(stream_log, writer)

    scenario()
    assert hub.published[1].payload == b"r2\nr3"


def test_commits_that_fill_a_frame_do_not_wait() -> None:
    """A snapshot's chunks, or a burst: a full frame gains nothing by waiting (a snapshot holds the hub meanwhile)."""
    stream_log = shared_stream_log(frame_wait_seconds=60.0)
    hub = FakeHub()
    full = b"x" * stream_log.nats.max_payload

    def scenario() -> None:
        writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
        stream_log.append(b"r1")
        stream_log.commit()
        until(lambda: len(hub.published) == 1)
        hub.ack(0, seq=3)
        stream_log.append(full)
        stream_log.commit()
        until(lambda: len(hub.published) == 2)  # within the test's bound, not after a minute
        stop(stream_log, writer)

    scenario()
    assert hub.published[1].payload == full

@pytest.mark.parametrize("stored", [True, False], ids=["its-takeover-stored", "its-takeover-refused"])
def test_a_rivals_frame_on_the_subject_sends_the_owner_to_its_tail_once_stored_and_an_old_owners_does_not(
        stored: bool) -> None:
    """Heard as it is published, a takeover may not be stored yet (CI: an owner that read its tail at once found
    nothing and answered for its group on), or may be refused: the log's last sequence decides, looked at again."""
    stream_log = shared_stream_log(QuietLease())
    stream_log.writer.epoch, stream_log.writer.tail_seq = 3, 7
    hub = FakeHub()
    bridge = stream_log.nats.bridge = FakeBridge(last_seq=7)  # type: ignore[assignment]
    writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
    until(lambda: "mqks.log.s-0-of-2" in hub.callbacks)
    heard = hub.callbacks["mqks.log.s-0-of-2"]
    heard("mqks.log.s-0-of-2", "_INBOX.old.1", {EPOCH: "2", OWNER: "node c"}, b"late")
    assert stream_log.writer.recovery.rival_check is None  # an old owner's late frame: nothing to look at
    heard("mqks.log.s-0-of-2", "_INBOX.rival.1", {EPOCH: "4", OWNER: "node b"}, b"W 4 node b")
    rival_check = stream_log.writer.recovery.rival_check
    assert rival_check is not None
    until(lambda: bridge.calls >= 1)
    assert stream_log.writer.recovery.trouble is None  # not stored yet when first looked at
    recovery = stream_log.writer.recovery
    if stored:
        bridge.last_seq = 8
        until(lambda: recovery.trouble is not None)
        assert "last sequence is 8, past this writer's 7" in (recovery.trouble or "")  # its tail is read next
    else:
        rival_check.join(timeout=3)
        assert rival_check.dead and recovery.trouble is None and bridge.calls == 3  # looked three times, then on
    stop(stream_log, writer)


@pytest.mark.parametrize("leader_says", [7, 8, None])
def test_the_tail_check_finds_a_rival_it_did_not_hear_and_a_leader_out_of_reach(
        leader_says: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    patch_seconds(monkeypatch, "FIGURES_SECONDS", 0.01)
    stream_log = shared_stream_log(QuietLease())
    stream_log.writer.epoch, stream_log.writer.tail_seq = 3, 7
    hub = FakeHub()
    bridge = stream_log.nats.bridge = FakeBridge(last_seq=leader_says)  # type: ignore[assignment]
    writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
    until(lambda: bridge.calls >= 4 or stream_log.writer.recovery.trouble is not None)
    trouble = stream_log.writer.recovery.trouble
    stop(stream_log, writer)
    if leader_says == 7:
        assert trouble is None
    elif leader_says == 8:
        assert "last sequence is 8, past this writer's 7" in (trouble or "")
    else:  # no heartbeat while it cannot read its log: a standby that can takes the group over after the lease
        assert "could not be read" in (trouble or "")


def test_the_tail_is_read_again_only_once_the_stream_has_grown_or_the_hub_reconnected(monkeypatch) -> None:
    """An idle cluster's owners read their stream's figures (which a process's groups share), not each its own tail:
    a stream that stored nothing since a check found no rival holds no rival's frame."""
    patch_seconds(monkeypatch, "FIGURES_SECONDS", 0.01)
    stream_log = shared_stream_log(QuietLease())
    stream_log.writer.epoch, stream_log.writer.tail_seq = 3, 7
    hub = FakeHub()
    bridge = stream_log.nats.bridge = FakeBridge(last_seq=7, stream_last=40)  # type: ignore[assignment]
    writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
    until(lambda: bridge.infos >= 5)
    assert bridge.tail_reads == 1  # the first check read it; the others found the stream as it was
    bridge.stream_last = 41  # another group stored a frame
    until(lambda: bridge.tail_reads == 2)
    infos = bridge.infos
    until(lambda: bridge.infos >= infos + 3)
    assert bridge.tail_reads == 2
    hub.reconnects += 1  # frames published meanwhile were not heard
    stream_log.writer._poke()
    until(lambda: bridge.tail_reads == 3)
    assert stream_log.writer.recovery.trouble is None
    stop(stream_log, writer)


def test_a_processs_groups_share_one_read_of_the_streams_figures() -> None:
    """nats_bridge.py's SharedFigures: groups asking together wait for one read; a read younger than max_age answers
    without NATS; a failed read fails every group that waited for it, and the next ask reads again."""
    reads: list[str] = []

    async def stream_info(stream: str, subjects_filter: str | None = None) -> SimpleNamespace:
        reads.append(stream)
        await asyncio.sleep(0.01)
        if stream == "gone":
            raise TimeoutError("no stream leader")
        return SimpleNamespace(state=SimpleNamespace(last_seq=len(reads)))

    nc = SimpleNamespace(jetstream=lambda timeout: SimpleNamespace(stream_info=stream_info))
    figures = SharedFigures(max_age=60.0)

    async def scenario() -> tuple[list[Any], Any, list[Any], Any]:
        together = await asyncio.gather(*(figures.info(nc, "s") for _ in range(3)))
        later = await figures.info(nc, "s")
        failed = await asyncio.gather(*(figures.info(nc, "gone") for _ in range(2)), return_exceptions=True)
        figures.max_age = 0.0
        return together, later, failed, await figures.info(nc, "s")

    together, later, failed, aged = asyncio.run(scenario())
    assert [info.state.last_seq for info in together] == [1, 1, 1] and later is together[0]
    assert all(isinstance(e, TimeoutError) for e in failed) and reads == ["s", "gone", "s"]
    assert aged.state.last_seq == 3


def test_a_stream_of_its_own_sends_what_is_handed_during_a_flight_as_one_frame_and_pipelines_full_ones() -> None:
    """Group commit that waits for the pipeline: a commit with nothing in flight goes at once (a lone confirm waits
    no longer); commits handed while a frame flies go together once it is stored (fuller frames cost NATS less per
    message); frames that are full already (a snapshot's parts) go without waiting for each other."""
    stream_log = JetStreamLog(["nats://127.0.0.1:1"], "s", "test")
    stream_log.writer._refuse = None
    hub = FakeHub()

    def scenario() -> None:
        writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
        stream_log.append(b"a1")
        stream_log.commit()
        until(lambda: len(hub.published) == 1)
        for record in (b"b2", b"c3"):
            stream_log.append(record)
            stream_log.commit()
        let_run()
        assert len(hub.published) == 1  # held while the first frame flies
        hub.ack(0, seq=1)
        until(lambda: len(hub.published) == 2)
        assert hub.published[1].payload == b"b2\nc3"
        hub.ack(1, seq=2)
        until(lambda: stream_log.poll()[0] == 3)
        stream_log.nats.max_payload = 10
        stream_log.append(b"x" * 35)  # four parts: full frames, sent without waiting for each other
        stream_log.commit(new_segment=True)
        until(lambda: len(hub.published) == 6)
        assert [len(frame.payload) for frame in hub.published[2:]] == [10, 10, 10, 5]
        stop(stream_log, writer)

    scenario()


@pytest.mark.parametrize("own_stream", [True, False], ids=["own-stream", "shared-stream"])
def test_a_snapshot_of_several_chunks_does_not_wait_for_a_writer_that_runs_in_its_own_loop(own_stream) -> None:
    """The journal blocks the hub between a snapshot's 4 MB chunks until the log's writer took the last one (the
    disk log's writer is a thread). The replicated log's writer is a greenlet of that hub: waiting for it blocked
    the broker for good (a --log broker or cluster group whose live state passed 4 MB at a snapshot, since
    372b339). Its chunks wait in memory until the snapshot ends, then go as full frames."""
    stream_log = JetStreamLog(["nats://127.0.0.1:1"], "s", "test") if own_stream else shared_stream_log()
    stream_log.writer._refuse = None
    hub = FakeHub()
    writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
    let_run()
    journal = Journal(stream_log, lambda rid, reason: b"")
    line = b"x" * 1000
    journal.snapshot(line for _ in range(3 * (SNAPSHOT_CHUNK_BYTES // len(line))))  # three chunks and more
    until(lambda: len(hub.published) >= 1)
    assert stream_log.writer._commits >= 4
    stop(stream_log, writer)


@pytest.mark.parametrize("own_stream", [True, False], ids=["own-stream", "shared-stream"])
def test_unsynced_bytes_come_back_to_zero_once_every_part_and_every_merged_commit_is_stored(own_stream) -> None:
    """A commit over the frame size (a snapshot's 4 MB chunk) goes in parts, each with its own PubAck; commits merged
    into one frame are joined by newlines. Once all is stored nothing is unsynced: the journal stops reading
    publishers while unsynced_bytes is past MAX_UNSYNCED_BYTES, and a 136 MB snapshot once left them unread for good."""
    stream_log = (JetStreamLog(["nats://127.0.0.1:1"], "s", "test") if own_stream else shared_stream_log())
    stream_log.writer._refuse = None
    stream_log.nats.max_payload = 10
    hub = FakeHub()

    def scenario() -> None:
        writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
        stream_log.append(b"x" * 35)  # four parts: 10, 10, 10, 5
        stream_log.commit(new_segment=True)
        for part in range(4):
            until(lambda part=part: len(hub.published) > part)
            hub.ack(part, seq=part + 1)  # one PubAck at a time, as NATS answers them
        until(lambda: stream_log.poll()[0] == 1)
        assert stream_log.unsynced_bytes == 0
        for record in (b"a1", b"b2", b"c3"):  # handed together: one frame "a1\nb2\nc3"
            stream_log.append(record)
            stream_log.commit()
        until(lambda: len(hub.published) == 5)
        assert hub.published[4].payload == b"a1\nb2\nc3"
        assert stream_log.unsynced_bytes == 6
        hub.ack(4, seq=5)
        until(lambda: stream_log.poll()[0] == 4)
        assert stream_log.unsynced_bytes == 0
        stop(stream_log, writer)

    scenario()
    assert [frame.payload for frame in hub.published[:4]] == [b"x" * 10] * 3 + [b"x" * 5]


def test_a_puback_that_comes_while_the_tail_read_fails_ends_the_stall_and_leaves_no_refusal_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 56's wedge, replayed: a frame gets no PubAck in time, the tail read that follows fails (a NATS leader
    change), the PubAck comes meanwhile, and the read goes on failing past the timeout. The writer refused every
    confirmed publish from then on, for minutes, and nothing ended it."""
    patch_seconds(monkeypatch, "ACK_SECONDS", 0.05)
    patch_seconds(monkeypatch, "RETRY_SECONDS", 0.02)
    stream_log = shared_stream_log(QuietLease())
    stream_log.writer.timeout_seconds = 0.3
    stream_log.writer.epoch, stream_log.writer.tail_seq = 3, 7
    hub = FakeHub()
    bridge = stream_log.nats.bridge = FakeBridge(last_seq=None)  # type: ignore[assignment]
    writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
    stream_log.append(b"r1")
    stream_log.commit()
    until(lambda: bridge.tail_reads >= 1)  # no PubAck in time: reading the tail, which does not answer
    hub.ack(0, seq=8)  # the PubAck, late: the frame is stored and the stall is over
    assert stream_log.poll()[0] == 1 and stream_log.writer.recovery.stalled_since is None
    reads = bridge.tail_reads
    deadline = time.monotonic() + 0.5  # the read goes on failing past the timeout
    while time.monotonic() < deadline or bridge.tail_reads < reads + 3:
        assert stream_log.writer.blocked is None, "a stall a PubAck ended refuses confirmed publishes"
        gevent.sleep(0.01)
    bridge.last_seq = 8  # the log answers again
    until(lambda: stream_log.writer.recovery.trouble is None)
    stream_log.append(b"r2")
    stream_log.commit()
    until(lambda: len(hub.published) == 2)
    hub.ack(1, seq=9)
    until(lambda: stream_log.poll()[0] == 2)
    assert stream_log.writer.blocked is None
    stop(stream_log, writer)


def test_a_writer_that_refuses_confirms_probes_the_log_and_takes_writes_again_once_it_stores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing a refused publish writes could show that the log takes writes again: the writer probes it itself, with
    an empty frame (a reader takes it for a heartbeat), and the first one stored ends the refusal."""
    patch_seconds(monkeypatch, "TAIL_CHECK_SECONDS", 0.02)
    stream_log = shared_stream_log(QuietLease())
    stream_log.writer.epoch, stream_log.writer.tail_seq = 3, 7
    stream_log.writer.blocked = "the replicated log does not answer"  # however it came to refuse
    hub = FakeHub()
    stream_log.nats.bridge = FakeBridge(last_seq=7)  # type: ignore[assignment]
    writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
    until(lambda: any(message.subject == "mqks.log.s-0-of-2" for message in hub.published))
    probes = [i for i, message in enumerate(hub.published) if message.subject == "mqks.log.s-0-of-2"]
    assert len(probes) == 1 and hub.published[probes[0]].payload == b""  # one at a time
    assert stream_log.writer.blocked is not None
    hub.ack(probes[0], seq=8)
    until(lambda: stream_log.writer.blocked is None)
    stop(stream_log, writer)


def test_a_takeover_no_stream_leader_answers_stands_by_again_instead_of_ending_the_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 56: after a heal, JetStream answered 503 for 5-14 s while it elected leaders, and a standby claiming then
    ended its group with "no stream leader answers" (a restart with a back-off). Now the claim stands by again."""
    from nats.errors import NoRespondersError  # what nats-py raises for JetStream's 503

    patch_seconds(monkeypatch, "TAKEOVER_SECONDS", 0.05)
    patch_seconds(monkeypatch, "RETRY_SECONDS", 0.01)
    stream_log = shared_stream_log(QuietLease())
    stream_log.nats._hub = FakeHub()  # type: ignore[assignment]
    requests = []

    class Electing(FakeBridge):
        async def request(self, subject: str, data: bytes, timeout: float, headers: dict[str, str]) -> Any:
            requests.append(headers[jetstream_log.MSG_ID])
            raise NoRespondersError

    stream_log.nats.bridge = Electing(last_seq=7)  # type: ignore[assignment]
    reading = SimpleNamespace(replayer=jetstream_log.Replayer(), read=7, last_seq=7)
    assert stream_log.take_over(reading) is None  # type: ignore[arg-type]
    assert len(requests) >= 2 and len(set(requests)) == 1  # asked again with one Msg-Id: stored once if at all
    assert stream_log.writer._writer is None


def test_after_close_a_links_records_are_dropped_and_confirmed_publishes_refused_not_raised() -> None:
    """The partition test: right after `handed over to node a`, a link's lines still ran in the group's server and
    their commit raised `RuntimeError: the log is closed` (a traceback per hand-off). They are the next owner's to
    store; and a confirmed publish forwarded then must be refused, never answered ok unstored."""
    stream_log = shared_stream_log(QuietLease())
    hub = FakeHub()
    writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
    stream_log.writer._writer = writer
    stream_log.append(b"r1")
    stream_log.commit()
    until(lambda: len(hub.published) == 1)
    hub.ack(0, seq=1)
    until(lambda: stream_log.poll()[0] == 1)
    stream_log.nats.bridge = SimpleNamespace(close=lambda: None)  # type: ignore[assignment]
    stream_log.close(timeout_seconds=1)
    assert stream_log.writer.blocked is not None
    stream_log.append(b"r2")  # a link's line, after the hand-off
    assert stream_log.commit() is None
    stream_log.writer.recovery.stall_ended("frames are stored again")  # a late PubAck: still refused for good
    assert stream_log.writer.blocked is not None


def test_a_takeover_answered_duplicate_in_process_is_sent_again_and_wins_with_the_first_ones_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The partition test: a minority's stream leader answered a resent takeover 10158 ('duplicate message id is in
    process') and the group ended with 'the takeover was refused'. The same Msg-Id, asked again, is answered."""
    patch_seconds(monkeypatch, "RETRY_SECONDS", 0.01)
    patch_seconds(monkeypatch, "RESEND_SECONDS", 0.01)
    answers = [{"error": {"err_code": 10158, "description": "duplicate message id is in process"}},
               {"stream": "s-g2-s0-of-1", "seq": 8, "duplicate": True}]

    async def request(subject: str, data: bytes, timeout: float, headers: dict[str, str]) -> Any:
        return SimpleNamespace(data=json.dumps(answers.pop(0)).encode())

    nc = SimpleNamespace(request=request)
    answer = asyncio.run(shared_stream_log().nats.append_takeover(nc, b"W 1 a", 7, epoch=1, writer_id="w"))
    assert (answer.seq, answer.error_code, answers) == (8, 0, [])


def test_a_stream_of_its_own_pipelines_a_frame_that_is_not_full_once_the_commits_waiting_weigh_as_much_as_those_flying(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 59's plain confirmed publishes (a client's window of 2,000, no consumer): commits held while one frame
    flew waited a whole PubAck each. They go while others fly once they weigh PIPELINED_FRAME_BYTES and as much as a
    frame flying does on average, up to MAX_PIPELINED_FRAMES; lighter ones still wait to go together. Whatever the
    order of the PubAcks, a commit is durable only once its frame and every frame before it are stored."""
    monkeypatch.setattr(stream_writer, "PIPELINED_FRAME_BYTES", 10, raising=False)
    monkeypatch.setattr(stream_writer, "MAX_PIPELINED_FRAMES", 3, raising=False)
    stream_log = JetStreamLog(["nats://127.0.0.1:1"], "s", "test")
    stream_log.writer._refuse = None
    hub = FakeHub()

    def commit(record: bytes) -> None:
        stream_log.append(record)
        stream_log.commit()
        let_run()

    def scenario() -> None:
        writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
        commit(b"a1")
        until(lambda: len(hub.published) == 1)  # nothing flew: at once
        commit(b"b" * 30)
        until(lambda: len(hub.published) == 2)  # heavy enough: it does not wait for the first PubAck
        commit(b"c" * 4)
        commit(b"d" * 4)
        assert len(hub.published) == 2  # 10 bytes waiting: lighter than the 16 a frame flying holds on average
        commit(b"e" * 5)
        until(lambda: len(hub.published) == 3)
        assert hub.published[2].payload == b"cccc\ndddd\neeeee"
        commit(b"f" * 40)
        assert len(hub.published) == 3  # three fly: the most
        hub.ack(2, seq=3)
        hub.ack(1, seq=2)
        until(lambda: len(hub.published) == 4)  # two fewer fly
        assert stream_log.poll()[0] == 0  # the first frame is not stored yet: nothing after it is durable either
        hub.ack(0, seq=1)
        until(lambda: stream_log.poll()[0] == 5)
        hub.ack(3, seq=4)
        until(lambda: stream_log.poll()[0] == 6)
        stop(stream_log, writer)

    scenario()
    expected = [str(seq) for seq in range(4)]  # each frame fenced on the one before it, sent or stored
    assert [frame.headers[stream.EXPECTED] for frame in hub.published] == expected


def test_a_tail_read_asked_while_nats_elects_a_leader_is_asked_again_and_the_first_answer_ends_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 56: a request sent while NATS has no stream leader is never answered, it waits out its whole timeout
    (5 s); frames were stored again 5.8 s after NATS had elected the new leader (that wait, then the retry pause),
    and the majority's queues went 13.7 s without a confirm. A tail read that goes unanswered is asked again beside
    it, and the first answer ends it."""
    patch_seconds(monkeypatch, "ACK_SECONDS", 0.05)
    patch_seconds(monkeypatch, "RETRY_SECONDS", 0.3)
    patch_seconds(monkeypatch, "TAIL_ASK_AGAIN_SECONDS", 0.05)
    lost_seconds = 3.0  # a request NATS lost waits this long (its timeout), even once a leader answers others

    class Electing(FakeBridge):
        def run(self, make: Callable[[Any], Any], timeout: float = 10.0) -> Any:
            if self.last_seq is None:
                gevent.sleep(lost_seconds)
                raise TimeoutError("nats: timeout")
            return super().run(make, timeout)

    stream_log = shared_stream_log(QuietLease())
    stream_log.writer.epoch, stream_log.writer.tail_seq, stream_log.writer._stored_seq = 3, 7, 7
    hub = FakeHub()
    bridge = stream_log.nats.bridge = Electing(last_seq=None)  # type: ignore[assignment]
    writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
    stream_log.append(b"r1")
    stream_log.commit()
    until(lambda: stream_log.writer.recovery.trouble is not None)  # no PubAck in time: the tail read is asked
    gevent.sleep(0.1)
    bridge.last_seq = 7  # NATS elected the stream's leader: nothing of this writer's was stored
    until(lambda: len(hub.published) == 2, seconds=lost_seconds / 2)  # the frame goes again, before the lost asks end
    assert hub.published[1].payload == b"r1" and hub.published[1].headers[EXPECTED_OF_SUBJECT] == "7"
    hub.ack(1, seq=8)
    until(lambda: stream_log.poll()[0] == 1)
    assert stream_log.writer.recovery.stalled_since is None and stream_log.writer.blocked is None
    stop(stream_log, writer)


def test_a_tail_read_fails_once_its_asks_have_all_failed_while_nats_is_out_of_reach(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An owner cut off from NATS: every ask of the tail fails after its timeout. The read asks TAIL_ASKS times in
    all and then fails, so the writer stalls and its owner steps down after the lease; asking again beside each
    failed ask kept the read from ever failing, and a cut-off owner served its groups for minutes (seen in CI)."""
    patch_seconds(monkeypatch, "TAIL_ASK_AGAIN_SECONDS", 0.02)
    asked: list[float] = []

    class OutOfReach(FakeBridge):
        def run(self, make: Callable[[Any], Any], timeout: float = 10.0) -> Any:
            asked.append(time.monotonic())
            gevent.sleep(0.05)  # the request's own timeout
            raise TimeoutError("nats: timeout")

    stream_log = shared_stream_log(QuietLease())
    stream_log.nats.bridge = OutOfReach(last_seq=None)  # type: ignore[assignment]
    never_failed = AssertionError("the tail read never failed while NATS was out of reach")
    with gevent.Timeout(5, never_failed), pytest.raises(TimeoutError):
        stream_log.writer.recovery.ask_tail()
    assert len(asked) == stream_recovery.TAIL_ASKS


class FencingNats(FakeHub):
    """A stream of its own as JetStream keeps it: a frame is stored only when its expected last sequence is the
    stream's (else refused, 10071), answers come when the test says (`answer`), and a frame the test names fails once
    (not stored); the tail read's calls (`jetstream`, `run`) read what was stored."""

    def __init__(self) -> None:
        super().__init__()
        self.stored: list[SimpleNamespace] = []
        self.answers: list[bytes] = []  # by publish, in order
        self.fail_once: set[int] = set()  # indexes of publishes NATS answers with an error, storing nothing

    def publish(self, subject: str, data: bytes, reply: str = "", headers: dict[str, str] | None = None) -> None:
        super().publish(subject, data, reply, headers)
        index = len(self.published) - 1
        expected = int((headers or {})[stream.EXPECTED])
        if index in self.fail_once:
            answer: dict[str, Any] = {"error": {"err_code": 10077, "description": "insufficient resources"}}
        elif expected != len(self.stored):
            answer = {"error": {"err_code": stream.WRONG_LAST_SEQUENCE,
                                "description": f"wrong last sequence: {len(self.stored)}"}}
        else:
            self.stored.append(SimpleNamespace(seq=len(self.stored) + 1, payload=data, headers=headers))
            answer = {"stream": "s", "seq": len(self.stored)}
        self.answers.append(json.dumps(answer).encode())

    def answer(self, index: int) -> None:
        self.callbacks["_INBOX.w.*"](self.published[index].reply, "", None, self.answers[index])

    def jetstream(self, timeout: float = 5.0) -> Any:
        async def stream_info(stream_name: str, subjects_filter: str | None = None) -> SimpleNamespace:
            state = SimpleNamespace(bytes=0, messages=len(self.stored), subjects={}, last_seq=len(self.stored))
            return SimpleNamespace(state=state, cluster=None)

        async def get_msg(stream_name: str, seq: int) -> SimpleNamespace:
            return self.stored[seq - 1]

        return SimpleNamespace(stream_info=stream_info, get_msg=get_msg)

    def run(self, make: Callable[[Any], Any], timeout: float = 10.0) -> Any:
        return asyncio.run(make(self))


def test_frames_flying_behind_a_failed_one_are_never_confirmed_before_it_is_stored_and_go_again_in_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream of its own pipelines its frames, each fenced on the sequence the one before it gets: when one fails,
    NATS refuses every frame flying behind it, nothing after it is confirmed, and the tail read sends them all again
    after the stream's tail, in order. Whatever order their answers come in, the stream holds the commits in the
    order they were made, and a commit is confirmed only once it and everything before it are stored."""
    patch_seconds(monkeypatch, "RETRY_SECONDS", 0.01)
    stream_log = JetStreamLog(["nats://127.0.0.1:1"], "s", "test")
    stream_log.writer._refuse = None
    stream_log.nats.max_payload = 10  # each commit fills a frame: they fly together
    nats = FencingNats()
    nats.fail_once.add(1)
    stream_log.nats.bridge = nats  # type: ignore[assignment]
    confirmed: list[int] = []

    def poll() -> int:
        confirmed.append(stream_log.poll()[0])
        return confirmed[-1]

    def scenario() -> None:
        writer = gevent.spawn(stream_log.writer._write_until_stopped, nats)
        for record in (b"a" * 10, b"b" * 10, b"c" * 10, b"d" * 10):
            stream_log.append(record)
            stream_log.commit()
            let_run()
        until(lambda: len(nats.published) == 4)  # four frames fly; the second fails, NATS refuses those behind it
        for index in (3, 0, 2):  # the first is stored; the two behind the failed one are refused (its is not in yet)
            nats.answer(index)
            let_run()
            assert poll() <= 1
        nats.answer(1)
        until(lambda: len(nats.published) == 7)  # the tail read found the first alone: the other three go again
        assert poll() == 1
        for index in (6, 5):  # the last two are stored, the one before them not yet answered
            nats.answer(index)
            let_run()
            assert poll() == 1
        nats.answer(4)
        until(lambda: poll() == 4)
        stop(stream_log, writer)

    scenario()
    assert [message.payload[:1] for message in nats.stored] == [b"a", b"b", b"c", b"d"]
    assert confirmed == sorted(confirmed) and stream_log.writer.recovery.trouble is None


@pytest.mark.parametrize("own_stream", [True, False], ids=["own-stream", "shared-stream"])
def test_commits_taken_together_go_as_two_halves_on_a_stream_of_its_own_and_the_first_is_confirmed_alone(
        own_stream: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 59's plain confirmed publishes: a client's window read in one hub turn went as one frame, and none of it
    was confirmed before all of it was stored. Commits as heavy as two pipelined frames go as two, the first closed
    once it holds half of them, and its PubAck confirms its commits alone; a group of a shared stream, one frame in
    flight at a time, still sends them as one."""
    monkeypatch.setattr(stream_writer, "PIPELINED_FRAME_BYTES", 10)
    stream_log = JetStreamLog(["nats://127.0.0.1:1"], "s", "test") if own_stream else shared_stream_log()
    stream_log.writer._refuse = None
    hub = FakeHub()

    def scenario() -> None:
        writer = gevent.spawn(stream_log.writer._write_until_stopped, hub)
        for record in (b"a" * 10, b"b" * 10, b"c" * 10, b"d" * 10):  # one hub turn: the writer takes them together
            stream_log.append(record)
            stream_log.commit()
        until(lambda: len(hub.published) >= 1)
        let_run()
        if own_stream:
            assert [message.payload[::11] for message in hub.published] == [b"ab", b"cd"]
            hub.ack(0, seq=1)
            until(lambda: stream_log.poll()[0] == 2)
            hub.ack(1, seq=2)
        else:
            assert [message.payload[::11] for message in hub.published] == [b"abcd"]
            hub.ack(0, seq=1)
        until(lambda: stream_log.poll()[0] == 4)
        stop(stream_log, writer)

    scenario()

"""The write-ahead log on a NATS JetStream stream (`mqksd --log nats://...`, the cluster extra): the same
records as the local log, replicated and fsynced by a quorum of NATS servers before a confirm is answered.

The stream holds messages, each a frame (commits joined with newlines; a frame over the server's
max_payload is split in parts, `Mqks-More` on all but the last). Headers on every message:

    Mqks-Epoch: E                      the writer's epoch; a takeover message raises it by one
    Mqks-Frame: k                      the writer's counter within its epoch (0: the takeover message)
    Nats-Msg-Id: {stream}.{E}.{w}.{k}  so a frame sent again after a timeout is stored once; `w` is random per
                                       writer: JetStream answers a Msg-Id it has seen with the first one's
                                       sequence before checking the fence, so two brokers taking the stream over
                                       at once with one Msg-Id would both be told they won
    Nats-Expected-Last-Sequence: N     the fence: JetStream refuses the append if anything else came after N

A cluster's slot groups share streams (`--streams`): a group's log is then its subject, `mqks.log.GROUP`, and
everything below reads and writes that subject alone, fenced by `Nats-Expected-Last-Subject-Sequence` (the
group's last sequence). That fence names the sequence of the frame before, known once it is stored: such a
writer has one frame in flight, and the commits handed meanwhile go together as the next one. NATS may refuse
a right subject fence for the moment (error 10164, "wrong last sequence" with no number,
bench/subject_fencing.py): the same frame is sent again. 10071 is a real fence.

One writer per stream (or subject). The writer of a stream of its own sends many frames in flight, each
expecting the sequence the one before it will get, and reports a commit durable once the frame holding it
and every frame before it have their PubAck. Its first refusal, error or timeout stops the sending: it waits
for what is in flight, reads the stream's tail from the leader, and then either finds a frame of a higher
epoch (taken over: it stops and fails what waits) or goes on, sending again what the tail does not hold. A
leader change inside NATS is such a refusal with no rival: nothing is failed for it.

Replay keeps, per epoch, the frames in counter order and ignores every frame of an epoch lower than the
highest it has seen: after a takeover, frames a stopped writer still had in flight may be stored behind
the takeover (measured: `w0, w1, rival, w3, w4, w5`), and none of them was ever confirmed.

Compaction: a snapshot starts a new frame; once its last frame and every frame before it are stored, the
writer purges the stream below the snapshot's first frame. A purge takes no expected-sequence check, but
it needs none here: it only removes frames a complete, stored snapshot covers, and a writer taken over
before its snapshot was stored whole never gets that far (its first frame after the takeover is refused,
so the rest never count as stored).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import gevent
from gevent.event import Event

from ..nats_io.hub_nats import Headers, ack_sequences
from ..nats_io.nats_bridge import Bridge, BridgeError, Hub, NatsBridge, SharedNats, parse_puback
from . import records
from .journal import p50_p99, take_failed

log = logging.getLogger("mqks.log")

EPOCH = "Mqks-Epoch"
FRAME = "Mqks-Frame"
MORE = "Mqks-More"
OWNER = "Mqks-Owner"
HANDOFF = "Mqks-Handoff"  # on an owner's last frame: the node it hands its group to (mqks cluster move)
SNAPSHOT = "Mqks-Snapshot"  # on a snapshot's first frame: a reader that missed the frames before it may start there
LAST = "Mqks-Last"  # on an idle owner's heartbeat: the log's last sequence, as the owner just read it
MSG_ID = "Nats-Msg-Id"
EXPECTED = "Nats-Expected-Last-Sequence"
EXPECTED_OF_SUBJECT = "Nats-Expected-Last-Subject-Sequence"  # a group's fence in a stream it shares
WRONG_LAST_SEQUENCE = 10071  # a fence: something else was appended (the text says the last sequence)
# "wrong last sequence" with no number: a shared stream's leader refusing a right expectation for the moment
# (bench/subject_fencing.py: 4 in 117,830 frames); the same frame, sent again, is stored once
WRONG_LAST_SEQUENCE_FOR_NOW = 10164
NOT_FOUND = 10037
# "duplicate message id is in process": the takeover sent again while NATS still handles the first (a minority's
# leader, during a partition): asked again, it is answered as the first one is (the partition test)
DUPLICATE_IN_PROCESS = 10158
RESEND_SECONDS = 0.005

# frames sent and not yet answered: full ones (a snapshot's parts); else one, see _write_until_stopped (a group of a
# shared stream: one, see _send)
MAX_IN_FLIGHT = 32
MAX_IN_FLIGHT_BYTES = 32 << 20  # JetStream's ingest queue holds 128 MiB: stay well under it
FRAME_BYTES = 1 << 20  # commits waiting to be sent are merged into frames up to this (or max_payload)
ACK_SECONDS = 2.0  # a frame with no answer after this: read the tail (an election answers 503 at once)
TAIL_CHECK_SECONDS = 1.0  # idle: look at the stream's last sequence this often (a rival, the figures)
RETRY_SECONDS = 0.5  # NATS has no answer: read the tail again after this
REPLAY_BATCH = 256
FOLLOW_IDLE_SECONDS = 10.0  # NATS drops a standby's push consumer this long after its subscription went
REPLAY_RETRY_SECONDS = 30.0  # replay: a read that keeps failing this long (NATS away) ends the start
STARTING_NATS_SECONDS = 30.0  # open: JetStream calls that time out this long (a NATS just started) end the start
OWNER_PING_SECONDS = 1.5
TAKEOVER_SECONDS = 10.0  # a takeover no stream leader answers for this long stands by again (NATS elects in 2-14 s)
FIGURES_SECONDS = 10.0  # a cluster's owner reads its stream's figures this often
SUBJECTS_OVERLAP = 10065
PUBACK_SAMPLES = 1024
REPLICAS_FALLBACK_ERRORS = (10074, 10005)  # insufficient resources, R>1 on a single server
PURGE_RETRY_FIRST_SECONDS = 1.0  # a failed purge is tried again after this, doubling up to the next
PURGE_RETRY_MAX_SECONDS = 30.0
STEP_DOWN_MARGIN_SECONDS = 2.0  # an owner that stored nothing for lease minus this stops confirming
RIVAL_CHECK_PAUSES = (0.05, 0.25, 1.0)  # a rival's frame heard: look at the tail after these (stored, or refused)


class LogOwned(Exception):
    """Another broker owns the stream and answers: name it, and say how to take over."""


class _Frame:
    """One message of the stream as the writer tracks it until it is stored."""

    __slots__ = ("k", "payload", "handed_bytes", "more", "commit", "snapshot_starts", "snapshot_ends", "seq",
                 "sent_at", "token", "handoff")

    def __init__(self, k: int, payload: bytes, more: bool, commit: int, snapshot_starts: bool,
                 snapshot_ends: bool, handed_bytes: int) -> None:
        self.k = k
        self.payload = payload
        self.handed_bytes = handed_bytes  # of the commits' payloads it carries (the newlines joining them aside)
        self.more = more
        self.commit = commit  # the last commit this frame completes; 0 for a part that is not the last
        self.snapshot_starts = snapshot_starts
        self.snapshot_ends = snapshot_ends
        self.seq = 0  # its stream sequence, once stored
        self.sent_at = 0.0
        self.token = 0  # the send it waits on (its PubAck's reply subject)
        self.handoff = ""  # the owner's last frame: the node it hands the group to


class Replayer:
    """The stream's messages in, the records of the frames that count out (epoch, then counter order)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.next_k = 0
        self.pending: dict[int, tuple[bytes, bool]] = {}
        self.parts: list[bytes] = []
        self.owner = ""
        self.frames = 0
        self.ignored = 0
        self.handoff: str | None = None  # the last frame read hands the group to this node

    def feed(self, headers: dict[str, str] | None, data: bytes) -> list[bytes]:
        """The records this message completes (none while a frame's parts or an earlier frame are missing)."""
        headers = headers or {}
        epoch, k = int(headers.get(EPOCH, 0)), int(headers.get(FRAME, 0))
        if epoch < self.epoch:
            self.ignored += 1  # a writer taken over: nothing of it after the takeover was confirmed
            return []
        if epoch > self.epoch or (k > self.next_k and SNAPSHOT in headers and not self.parts):
            # a new writer: its takeover (k 0), or its first frame left by a purge; or a snapshot this reader
            # reached across frames a purge removed before it read them (the snapshot stands for them)
            if epoch > self.epoch:
                self.owner = headers.get(OWNER, self.owner)
                self.pending.clear()
            else:  # frames after the snapshot that came before it stay
                self.pending = {later: frame for later, frame in self.pending.items() if later > k}
            self.epoch, self.next_k, self.parts = epoch, k, []
        self.handoff = headers.get(HANDOFF)
        if k < self.next_k:
            return []  # a frame sent again and stored twice (after the duplicate window)
        self.pending[k] = (data, MORE in headers)
        lines: list[bytes] = []
        while self.next_k in self.pending:
            part, more = self.pending.pop(self.next_k)
            self.next_k += 1
            self.parts.append(part)
            if not more:
                frame = b"".join(self.parts)
                self.parts = []
                self.frames += 1
                if frame:  # an empty frame is an idle owner's heartbeat
                    lines += frame.split(b"\n")
        return lines


class StreamReading:
    """How far one reading of the stream has come: the records of the frames fed so far (their owner, epoch and any
    hand-off), the last sequence read, and the tail it reads to."""

    __slots__ = ("replayer", "read", "last_seq", "started")

    def __init__(self) -> None:
        self.replayer = Replayer()
        self.read = 0
        self.last_seq = 0
        self.started = time.perf_counter()


class JetStreamLog:
    """The journal's Log on a JetStream stream; `open()`, then `replay()` to the end (which takes the stream
    over), then commits. The writer is a greenlet: it publishes frames and reads their PubAcks on the hub's own NATS
    connection (hub_nats.py), and makes its JetStream API calls (a tail read, figures, a purge) through the bridge."""

    disk_full = False  # no disk of ours: `blocked` says why the log cannot write
    where = "in the replicated log"

    def __init__(self, servers: list[str], stream: str, owner: str, replicas: int = 3, takeover: bool = False,
                 timeout_seconds: float = 15.0, wake: Callable[[], None] = lambda: None,
                 connect_timeout: float = 5.0, lease_seconds: float | None = None, node: str | None = None,
                 nats_options: dict[str, Any] | None = None, shared: SharedNats | None = None,
                 group: str | None = None, stream_subjects: list[str] | None = None,
                 frame_wait_seconds: float = 0.0) -> None:
        self.servers = servers
        self.stream = stream
        # a cluster's slot group in a stream it shares with others (`group`: its name, `stream_subjects`: every
        # group's subject): it reads and writes its subject alone, fenced by the subject's last sequence
        self.name = group or stream
        self.in_shared_stream = group is not None
        self.label = f"group {group}" if group is not None else f"stream {stream}"
        self.subject = f"mqks.log.{self.name}"
        self.stream_subjects = stream_subjects or [self.subject]
        self._fence = EXPECTED_OF_SUBJECT if self.in_shared_stream else EXPECTED
        # a shared stream's subject fence names the previous frame's sequence, known once it is stored: one frame in
        # flight (commits waiting meanwhile go in the next, fuller one); a stream of its own pipelines its frames
        self.max_in_flight = 1 if self.in_shared_stream else MAX_IN_FLIGHT
        # ... and it sends its next frame at least this long after its last (a stored message costs NATS the same,
        # full or not: a cluster's 16 groups sent 900 frames a second of 45 publishes each, 0.7 ms of NATS CPU each)
        self.frame_wait_seconds = frame_wait_seconds if self.in_shared_stream else 0.0
        self.owner_subject = f"mqks.owner.{self.name}"
        self.beat_subject = f"mqks.beat.{self.name}"
        self.owner = owner
        self.replicas = replicas
        self.takeover = takeover
        # a cluster's group: an idle owner appends a heartbeat every quarter lease (standbys take over after a lease
        # of silence), stops confirming before a standby may take over, and steps down after the lease
        self.lease_seconds = lease_seconds
        self.heartbeat_seconds = lease_seconds / 4 if lease_seconds is not None else None
        self.node = node  # the cluster node this broker is, as its owner ping answers
        if lease_seconds is not None:
            timeout_seconds = min(timeout_seconds, lease_seconds - STEP_DOWN_MARGIN_SECONDS)
        self.timeout_seconds = timeout_seconds
        self.handoff_to: str | None = None  # set by the hub before close(): the last frame names that node
        self._handoff_k = 0
        self.wake = wake
        # a cluster node's process shares one connection between its groups (`shared`); else the log has its own
        self.bridge: Bridge = (NatsBridge(servers, connect_timeout, nats_options) if shared is None
                                                 else shared.scope())
        # ... and its groups read their shared stream's figures together
        self._shared_figures = shared.figures if shared is not None and self.in_shared_stream else None
        self._stream_last_checked = -1  # the stream's last sequence when the last tail check found no rival
        # hub side
        self._records: list[bytes] = []
        self.append = self._records.append
        self._commits = 0
        self._handed_bytes = 0
        self.unsynced_bytes = 0
        self._refuse: str | None = "replay() the stream to its end before the first commit"
        self._closed = False
        # handed over: commit() appends, the writer greenlet takes them when a frame can go
        self._handed: deque[tuple[int, bytes, bool, bool, float]] = deque()
        # written by the writer greenlet, read by the journal
        self._durable = 0
        self._durable_bytes = 0
        self._failed: deque[int] = deque()
        self.blocked: str | None = None
        self.fenced_by: str | None = None  # the owner that took the stream over: this broker must stop
        # the writer's own
        self.epoch = 0
        self.writer_id = os.urandom(4).hex()
        self.max_payload = FRAME_BYTES
        self._k = 0
        self._frames: dict[int, _Frame] = {}  # by k: built and not yet stored in order
        self._unsent: deque[_Frame] = deque()
        self._in_flight = 0
        self._in_flight_bytes = 0
        self._waiting_to_send = False  # a timer wakes the writer when frame_wait_seconds have passed
        self._last_frame_at = 0.0  # when the last frame was sent (heartbeats aside)
        self._stored_k = 0  # every frame up to this one is stored
        self._tail_seq = 0  # the sequence the stream's last message has, as this writer expects it
        self._stored_seq = 0  # the sequence of the last frame stored in order
        self._tokens = itertools.count(1)
        self._by_token: dict[int, _Frame] = {}
        self._trouble: str | None = None  # the first error since the last tail read
        self._commit_times: deque[tuple[int, float]] = deque()  # handed commits not yet durable
        self._failed_up_to = 0
        self._snapshot_seq = 0  # the first frame of the snapshot being stored
        self._purging: gevent.Greenlet | None = None  # the purge being made: an older one still retrying gives up
        self._stalled_since: float | None = None  # the first trouble since a frame was last stored
        self._stall_logged = False
        self._stopping = False
        self._writer_done = False
        self._inbox = ""
        self._wake = Event()  # the writer's: commits handed, a PubAck, a check due
        self._writer: gevent.Greenlet | None = None
        self._rival_check: gevent.Greenlet | None = None
        self._hub: Hub | None = None  # the hub's NATS connection (the bridge's hub_nats), once the log needs it
        self._last_sent_at = 0.0
        self._reader: Any = None  # replay's pull consumer
        self._next_seq = 1  # the next sequence it reads
        # a standby follows the tail on a push consumer: NATS sends each frame as it is stored, with no request per
        # frame (a pull per frame was most of a standby's CPU and of NATS's API load, issue 40)
        self._follower: Any = None  # the subscription on the push consumer's deliver subject
        self._beats: Any = None  # the subscription on the owner's heartbeats
        self._beat: tuple[int, int] | None = None  # the last heartbeat heard: its epoch and last sequence
        self._followed: deque[tuple[int, dict[str, str] | None, bytes]] = deque()
        self._follow_next = 0  # the follower's next frame is at this sequence or after it
        self._follow_next_delivery = 1  # the consumer's count of the frame it sends next
        self._follow_generation = 0  # frames from a follower of another generation are a replaced one's
        self._fresh_after = 0  # followed frames up to this sequence were stored before following began
        self._follow_event = Event()  # set when frames wait in _followed
        self._refollowing: gevent.Greenlet | None = None
        # figures
        self._puback_ms: deque[float] = deque(maxlen=PUBACK_SAMPLES)
        self._stream_bytes = 0
        self._stream_messages = 0
        self._leader = ""
        self._stalls = 0
        self._purges = 0
        self._purge_failures = 0
        self._resent = 0
        self._replayed_records = 0
        self._ignored_frames = 0
        self._recovery_seconds = 0.0

    # -- the hub's side -------------------------------------------------------------------------

    def open(self) -> None:
        """Connect and make sure the stream exists; raises BridgeError when NATS cannot be reached."""
        self.bridge.start()
        self.bridge.run(self._ensure_stream, timeout=60)

    def replay(self, repair: bool = False) -> Iterator[bytes]:
        """Every record the stream holds, in order; then take the stream over (a takeover message with epoch+1,
        expecting the last sequence read), whose record ends the replay. Refuses (LogOwned) while another broker
        answers for the stream, unless --takeover. `repair` has no meaning here. A cluster node does not call this:
        its cluster layer (server/cluster/election.py) reads, follows and takes over with the calls below."""
        reading = self.start_reading()
        while True:
            yield from self.read_to_tail(reading)
            if not self.takeover:
                owner = self.ask_owner()
                if owner is not None:
                    raise LogOwned(f"{self.label} is owned by {owner}, which is running: stop it first, "
                                   "or start with --takeover to fence it off")
            record = self.take_over(reading)
            if record is not None:
                yield record
                return

    def start_reading(self) -> StreamReading:
        """A reading of the stream from its first message (a pull reader on NATS), up to its tail as of now."""
        reading = StreamReading()
        self._replayed_records = 0
        reading.last_seq = self.bridge.run(self._open_reader, timeout=60)
        return reading

    def read_to_tail(self, reading: StreamReading) -> Iterator[bytes]:
        """The records of every message after `reading.read` up to `reading.last_seq`."""
        run = self.bridge.run
        failing_since = 0.0
        while reading.read < reading.last_seq:
            try:
                batch = run(self._read_batch, timeout=60)
            except (BridgeError, gevent.Timeout):
                raise
            except Exception as e:  # 503 while a new reader or the stream's leader settles: read on from `read`
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since > REPLAY_RETRY_SECONDS:
                    raise
                log.warning("%s: reading it failed (%r); again", self.label, e)
                gevent.sleep(RETRY_SECONDS)
                continue
            failing_since = 0.0
            if not batch:
                raise BridgeError(f"{self.label}: no message after sequence {reading.read} of "
                                  f"{reading.last_seq}")
            yield from self._feed(reading, batch)

    def _feed(self, reading: StreamReading, batch: list[tuple[int, dict[str, str] | None, bytes]]) -> list[bytes]:
        lines: list[bytes] = []
        replayer = reading.replayer
        for seq, headers, data in batch:
            reading.read = seq
            lines += replayer.feed(headers, data)
        self._replayed_records += len(lines)
        return lines

    def take_over(self, reading: StreamReading) -> bytes | None:
        """Append the takeover message (epoch + 1), expecting the stream's last sequence to be `reading.read`: its
        record once stored, and the writer starts. None when something came after what was read (another writer
        took it over first, or an owner appended): `reading.last_seq` is the tail then, read on to it."""
        run = self.bridge.run
        replayer = reading.replayer
        self._hub_nats()  # the writer's connection, before taking over: a log that cannot have it must not
        self.epoch = replayer.epoch + 1
        record = records.takeover(self.epoch, self.owner.encode())
        answer = run(functools.partial(self._append_takeover, record=record, last_seq=reading.read), timeout=60)
        if answer is None:  # no stream leader answered for a while: NATS is electing one (a heal); stand by again
            log.warning("%s: no stream leader answers the takeover (NATS is electing one): standing by again",
                        self.label)
            return None
        if answer.error_code == WRONG_LAST_SEQUENCE:
            reading.last_seq = run(self._last_seq, timeout=60)
            return None
        if answer.error:
            raise BridgeError(f"{self.label}: the takeover was refused: {answer.error}")
        if replayer.epoch:
            log.info("%s: taken over from %s (epoch %d -> %d)", self.label, replayer.owner or "?",
                     replayer.epoch, self.epoch)
        else:
            log.info("%s: taken (epoch %d)", self.label, self.epoch)
        self._ignored_frames = replayer.ignored
        self._tail_seq = self._stored_seq = answer.seq
        self._k = 0
        run(self._close_reader, timeout=30)
        self._refuse = None
        self._recovery_seconds = time.perf_counter() - reading.started
        self._writer = gevent.spawn(self._write)
        return record

    def ask_owner(self, silent_is_owner: bool = False) -> str | None:
        """The running owner's description, or None when no broker answers for the stream (with `silent_is_owner`,
        only when none listens: one that listens and does not answer may be paused, not gone)."""
        return self.bridge.run(functools.partial(self._ask_owner, silent_is_owner=silent_is_owner), timeout=30)

    def last_seq(self) -> int:
        """The stream's last sequence now (one stream info)."""
        return self.bridge.run(self._last_seq, timeout=30)

    def follow(self, reading: StreamReading, fresh_after: int = 0) -> None:
        """Follow the tail after `reading.read` on a push consumer: NATS sends each message as it is stored. Messages up
        to `fresh_after` were stored before: read_followed applies them but does not count them as the owner heard."""
        self._fresh_after = fresh_after
        self._follow(reading.read + 1)

    def read_followed(self, reading: StreamReading, timeout: float) -> tuple[bool, list[bytes]]:
        """Wait up to `timeout` for followed messages or the owner's heartbeat: whether the owner was heard, and the
        records the messages complete. A heartbeat counts once the follower has every frame it says is stored (a
        follower that lost its NATS node hears heartbeats and no frames: silence, then a check, then follow anew)."""
        self._follow_event.wait(timeout)
        batch = self._take_followed()
        records = self._feed(reading, batch)
        beat, self._beat = self._beat, None
        heard_beat = beat is not None and beat[0] >= reading.replayer.epoch and beat[1] <= reading.read
        return (bool(batch) and batch[-1][0] > self._fresh_after) or heard_beat, records

    def stop_following(self, reading: StreamReading) -> None:
        """No more following: read_to_tail reads on from after `reading.read` with the pull reader."""
        self._next_seq = reading.read + 1
        self._stop_following()
        self._followed.clear()

    def commit(self, new_segment: bool = False, completes: bool | None = None) -> int | None:
        """Close the open batch into one commit for the writer; its number, or None when empty.

        new_segment=True starts a snapshot (a frame of its own); the stream is purged below it once the
        commit with completes=True (by default the same) and everything before it are stored."""
        if completes is None:
            completes = new_segment
        batch = self._records
        if not batch:
            return None
        if self._refuse is not None:
            if self._closed:
                # handed over, or stopping: a link's lines still run here for a moment, and what they change is the
                # next owner's to store (none of it is confirmed: `blocked` refuses confirmed publishes now)
                batch.clear()
                return None
            raise RuntimeError(self._refuse)
        payload = b"\n".join(batch)
        batch.clear()
        self._commits = number = self._commits + 1
        self._handed_bytes += len(payload)
        self.unsynced_bytes = self._handed_bytes - self._durable_bytes
        self._handed.append((number, payload, new_segment, completes, time.monotonic()))
        if len(self._handed) == 1 and not self._writer_done and self._in_flight < self.max_in_flight:
            # once per batch the writer has not taken: it takes every commit waiting when it wakes; a group's writer
            # with its frame in flight takes them once that frame is stored, as its PubAck wakes it (waking it for
            # nothing was a third of its wakes under load)
            self._wake.set()
        return number

    @property
    def frames_waiting(self) -> bool:
        """Never: a snapshot's next chunk must not wait for this writer. It is a greenlet of the hub the snapshot
        holds (the disk log's writer is a thread): waiting for it blocked the broker for good. A snapshot's
        chunks wait in memory, handed, until it ends; the journal stops reading publishers meanwhile (their
        bytes are unsynced)."""
        return False

    @property
    def handed_bytes(self) -> int:
        return self._handed_bytes

    def poll(self) -> tuple[int, list[int]]:
        """The highest durable commit, and the commits failed since the last poll."""
        return take_failed(self._durable, self._failed)

    def stats(self) -> dict[str, Any]:
        puback_ms_p50, puback_ms_p99 = p50_p99(self._puback_ms)
        return {
            "log_bytes": self._stream_bytes,
            "stream_messages": self._stream_messages,
            "commits": self._commits,
            "frames_in_flight": self._in_flight,
            "bytes_in_flight": self._in_flight_bytes,
            "puback_ms_p50": puback_ms_p50,
            "puback_ms_p99": puback_ms_p99,
            "unsynced_bytes": self.unsynced_bytes,
            "disk_full": False,
            "blocked": self.blocked is not None,
            "stream": self.stream,
            "stream_leader": self._leader,
            "epoch": self.epoch,
            "last_seq": self._tail_seq,
            "stalls": self._stalls,
            "resent_frames": self._resent,
            "purges": self._purges,
            "purge_failures": self._purge_failures,
            "replayed_records": self._replayed_records,
            "ignored_frames": self._ignored_frames,
            "recovery_seconds": self._recovery_seconds,
        }

    def close(self, timeout_seconds: float | None = None) -> None:
        """Send what is open, wait (at most timeout_seconds) until it is stored, then disconnect."""
        if self._closed:
            return
        if self._refuse is None:
            self.commit()
        self._closed = True
        self._refuse = "the log is closed"
        why_not_stored = self.blocked or "NATS does not answer"
        if self.blocked is None:  # a confirmed publish forwarded here now gets an error its client retries elsewhere
            self.blocked = "this node no longer serves the group (handed over, or stopping)"
        deadline = time.monotonic() + (timeout_seconds if timeout_seconds is not None else 3600.0)
        while (self._durable < self._commits and not self._writer_done and self.fenced_by is None
               and time.monotonic() < deadline):
            gevent.sleep(0.01)
        if self._durable < self._commits and self.fenced_by is None:
            log.error("closing %s: %d bytes of unconfirmed records are not stored (%s); stopping without "
                      "them", self.label, self.unsynced_bytes, why_not_stored)
        elif self.handoff_to is not None and self.fenced_by is None and not self._writer_done:
            self._add_handoff()
            while self._handoff_k != -1 and not self._writer_done and time.monotonic() < deadline:
                gevent.sleep(0.01)
            log.info("%s: handed over to node %s%s", self.label, self.handoff_to,
                     "" if self._handoff_k == -1 else " (its frame is not stored: it takes over after the lease)")
        self._stopping = True
        self._wake.set()
        if self._writer is not None:
            self._writer.join(timeout=1.0)  # its last moments (a tail read) end before the bridge closes under it
            self._writer.kill(block=False)
        for helper in (self._purging, self._refollowing, self._rival_check):
            if helper is not None:
                helper.kill(block=False)
        self.bridge.close()

    # -- the JetStream API, in the bridge's asyncio thread: stream management ---------------------

    async def _ensure_stream(self, nc: Any) -> None:
        from nats.errors import NoRespondersError
        from nats.errors import TimeoutError as NatsTimeout
        from nats.js.api import DiscardPolicy, StorageType, StreamConfig
        from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

        js = nc.jetstream(timeout=5)
        self.max_payload = min(FRAME_BYTES, nc.max_payload) if nc.max_payload else FRAME_BYTES
        # a NATS cluster started moments ago (Compose, CI) answers JetStream calls only once its meta leader is
        # elected: until then a call times out or finds no responder (CI: "cannot start: nats: timeout")
        deadline = time.monotonic() + STARTING_NATS_SECONDS
        while True:
            try:
                info = await js.stream_info(self.stream)
                break
            except NotFoundError:
                info = None
                break
            except (NatsTimeout, NoRespondersError, ServiceUnavailableError) as e:
                await self._ask_again_later(e, deadline)
        if info is None:
            replicas = self.replicas
            while True:
                config = StreamConfig(name=self.stream, subjects=self.stream_subjects, num_replicas=replicas,
                                      storage=StorageType.FILE, discard=DiscardPolicy.NEW, allow_rollup_hdrs=True,
                                      allow_direct=False, duplicate_window=120.0)
                try:
                    info = await js.add_stream(config)
                    break
                except (NatsTimeout, NoRespondersError, ServiceUnavailableError) as e:
                    await self._ask_again_later(e, deadline)
                    try:  # a create that timed out may have been made meanwhile
                        info = await js.stream_info(self.stream)
                        break
                    except (NotFoundError, NatsTimeout, NoRespondersError, ServiceUnavailableError):
                        continue
                except APIError as e:
                    if replicas > 1 and e.err_code in REPLICAS_FALLBACK_ERRORS:
                        log.warning("%s: NATS cannot place %d replicas (%s): trying %d", self.label,
                                    replicas, e.description, replicas - 1)
                        replicas -= 1
                        continue
                    hint = (": the cluster's groups are in streams of another layout on this NATS (every node must "
                            "run the same --groups and --streams)") if e.err_code == SUBJECTS_OVERLAP else ""
                    raise BridgeError(f"cannot create stream {self.stream}: {e.description}{hint}") from None
            log.info("stream %s created on NATS: %d replicas, file storage", self.stream, replicas)
        config = info.config
        if self.subject not in (config.subjects or []):
            raise BridgeError(f"stream {self.stream} does not hold subject {self.subject} (its subjects: "
                              f"{', '.join(config.subjects or [])}): it was made for another layout")
        limited = [name for name, value in (("max_msgs", config.max_msgs), ("max_bytes", config.max_bytes),
                                            ("max_age", config.max_age)) if value not in (None, -1, 0)]
        if limited and config.discard != DiscardPolicy.NEW:
            raise BridgeError(f"stream {self.stream} has limits ({', '.join(limited)}) that would discard old "
                              "frames: a log must lose nothing; remove them or use discard: new")
        # the stream takes no write until it has a leader (a fresh R3 stream, or during an election)
        deadline = time.monotonic() + 30
        while not (info.cluster is None or info.cluster.leader) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            info = await js.stream_info(self.stream)
        self._note_info(info)
        if self.in_shared_stream:
            await self._note_figures(nc)

    async def _ask_again_later(self, error: Exception, deadline: float) -> None:
        """A JetStream call timed out or found no responder, as while NATS elects its meta leader: raise `error`
        past `deadline`, else say so and wait before the caller asks again."""
        if time.monotonic() > deadline:
            raise error
        log.warning("%s: JetStream does not answer yet (%s); asking again", self.label, type(error).__name__)
        await asyncio.sleep(RETRY_SECONDS)

    def _note_info(self, info: Any) -> None:
        self._stream_bytes = info.state.bytes
        self._stream_messages = info.state.messages
        self._leader = (info.cluster.leader or "") if info.cluster is not None else ""

    async def _last_seq(self, nc: Any) -> int:
        """The log's last sequence: the stream's; in a shared stream, its subject's (0: none yet)."""
        js = nc.jetstream(timeout=5)
        if not self.in_shared_stream:
            info = await js.stream_info(self.stream)
            self._note_info(info)
            return int(info.state.last_seq)
        from nats.js.errors import NotFoundError

        try:
            return int((await js.get_last_msg(self.stream, self.subject)).seq or 0)  # from the stream's leader
        except NotFoundError:
            return 0

    async def _note_figures(self, nc: Any) -> int:
        """The stream's figures for `stats()` (in a shared stream, the messages are its subject's); its last
        sequence."""
        if self._shared_figures is not None:
            info = await self._shared_figures.info(nc, self.stream)
        else:
            info = await nc.jetstream(timeout=5).stream_info(
                self.stream, subjects_filter=self.subject if self.in_shared_stream else None)
        self._note_info(info)
        if self.in_shared_stream:
            self._stream_messages = int((info.state.subjects or {}).get(self.subject, 0))
        return int(info.state.last_seq)

    async def _open_reader(self, nc: Any, start_seq: int = 0) -> int:
        """A reader from `start_seq` (the start: 0); the stream's last sequence. A reader that cannot be made now
        (an election) is made by the next read."""
        last_seq = await self._last_seq(nc)
        if self._reader is not None:
            await self._close_reader(nc)
        self._next_seq = max(1, start_seq)
        try:
            await self._make_reader(nc)
        except Exception as e:  # a new R3 stream's consumer waits for its leader: the reads retry, the start goes on
            log.warning("%s: no reader yet (%s); the next read makes one", self.label, e or type(e).__name__)
        return last_seq

    async def _make_reader(self, nc: Any) -> None:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        start = self._next_seq
        policy = dict(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start) if start > 1 else dict(
            deliver_policy=DeliverPolicy.ALL)
        self._reader = await nc.jetstream(timeout=self.timeout_seconds).pull_subscribe(
            self.subject, durable=None, stream=self.stream,
            config=ConsumerConfig(ack_policy=AckPolicy.NONE, mem_storage=True, inactive_threshold=60.0, **policy))

    async def _read_batch(self, nc: Any, timeout: float = 5.0) -> list[tuple[int, dict[str, str] | None, bytes]]:
        """The next messages in order ([] when none came within `timeout`); after a failure the next call reads on
        from where this one stopped, on a new reader (its NATS node may have gone)."""
        from nats.errors import TimeoutError as NatsTimeout

        if self._reader is None:
            await self._make_reader(nc)
        try:
            msgs = await self._reader.fetch(REPLAY_BATCH, timeout=timeout)
        except (NatsTimeout, TimeoutError):  # nats-py raises either, by where the wait ended
            return []
        except Exception:
            await self._close_reader(nc)
            raise
        batch = [(msg.metadata.sequence.stream, msg.headers, msg.data) for msg in msgs]
        if batch:
            self._next_seq = batch[-1][0] + 1
        return batch

    def _hub_nats(self) -> Hub:
        """The hub's NATS connection this log publishes and subscribes on (the process's, for a cluster's group)."""
        if self._hub is None:
            self._hub = self.bridge.hub_nats()
        return self._hub

    def _follow(self, start_seq: int, keep: bool = False) -> None:
        """Follow the stream from `start_seq` on a push consumer (memory, one replica, no acks) that delivers to an
        inbox of the hub's connection: frames come to `_on_followed` as they are stored. Replaces the replay's pull
        reader and any earlier follower; the frames the hub has not taken yet are dropped unless `keep` (they come
        before `start_seq`)."""
        hub = self._hub_nats()
        if self._reader is not None:
            self.bridge.run(self._close_reader, timeout=30)
        self._stop_following()
        if not keep:
            self._followed.clear()
        self._follow_next = start_seq
        self._follow_generation += 1
        inbox = hub.new_inbox()
        # the subscription first, and NATS has it (a PONG) before the consumer exists: it starts sending at once
        self._follower = hub.subscribe(inbox, functools.partial(self._on_followed, self._follow_generation))
        if self._beats is None and self.lease_seconds is not None:
            self._beats = hub.subscribe(self.beat_subject, self._on_beat)
        self._follow_next_delivery = 1
        hub.sync()
        self.bridge.run(functools.partial(self._add_follower, inbox=inbox, start_seq=start_seq), timeout=30)

    async def _add_follower(self, nc: Any, inbox: str, start_seq: int) -> None:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        await nc.jetstream(timeout=self.timeout_seconds)._jsm.add_consumer(self.stream, config=ConsumerConfig(
            deliver_subject=inbox, deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq,
            filter_subject=self.subject, ack_policy=AckPolicy.NONE, mem_storage=True, num_replicas=1,
            inactive_threshold=FOLLOW_IDLE_SECONDS))

    def _on_followed(self, generation: int, subject: str, reply: str, headers: Headers | None, data: bytes) -> None:
        if generation != self._follow_generation:  # a replaced follower's last frames
            return
        if not data and headers and "Status" in headers:  # an idle heartbeat or a flow control request
            return
        seq, delivery = ack_sequences(reply)
        # the consumer counts what it delivers, one by one: a gap there is a frame lost on the way (a slow
        # consumer, a reconnect); stream sequences have gaps of their own in a shared stream (the other groups')
        if delivery != self._follow_next_delivery or seq < self._follow_next:
            if delivery > self._follow_next_delivery:  # follow again from the gap
                expected = self._follow_next
                log.warning("%s: following it skipped %d frames; following again from %d", self.label,
                            delivery - self._follow_next_delivery, expected)
                self._follow_generation += 1
                self._refollowing = gevent.spawn(self._follow_again, expected)
            return
        self._follow_next_delivery = delivery + 1
        self._follow_next = seq + 1
        self._followed.append((seq, headers, data))
        if len(self._followed) == 1:  # the waiting hub is woken once per batch it has not taken yet
            self._follow_event.set()

    def _follow_again(self, start_seq: int) -> None:
        try:
            self._follow(start_seq, keep=True)
        except Exception as e:  # the standby's silence check follows anew after a lease without frames
            log.warning("%s: following again failed (%s)", self.label, e or type(e).__name__)

    def _on_beat(self, subject: str, reply: str, headers: Headers | None, data: bytes) -> None:
        try:
            self._beat = (int((headers or {}).get(EPOCH, 0)), int((headers or {}).get(LAST, 0)))
        except ValueError:
            return
        self._follow_event.set()

    def _stop_following(self) -> None:
        hub = self._hub
        beats, self._beats = self._beats, None
        follower, self._follower = self._follower, None
        if hub is None:
            return
        if beats is not None:
            hub.unsubscribe(beats)
        if follower is not None:
            hub.unsubscribe(follower)  # NATS drops the consumer once no one listens (FOLLOW_IDLE_SECONDS)

    def _take_followed(self) -> list[tuple[int, dict[str, str] | None, bytes]]:
        """Hub side: the frames the follower brought since the last call, in order."""
        self._follow_event.clear()
        followed = self._followed
        batch = []
        while followed:
            batch.append(followed.popleft())
        return batch

    async def _close_reader(self, nc: Any) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            try:
                await reader.unsubscribe()
            except Exception:
                pass

    async def _ask_owner(self, nc: Any, silent_is_owner: bool = False) -> str | None:
        """The running owner's description, or None when no broker answers for the stream (with `silent_is_owner`,
        only when none listens: one that listens and does not answer may be paused, not gone)."""
        from nats.errors import NoRespondersError
        from nats.errors import TimeoutError as NatsTimeout

        try:
            answer = await nc.request(self.owner_subject, b"", timeout=OWNER_PING_SECONDS)
        except NoRespondersError:
            return None
        except NatsTimeout:
            return "an owner that does not answer" if silent_is_owner else None
        try:
            about = json.loads(answer.data)
            return f"{about['owner']} (epoch {about['epoch']})"
        except (ValueError, KeyError):
            return answer.data.decode(errors="replace")

    async def _append_takeover(self, nc: Any, record: bytes, last_seq: int) -> Any:
        """The takeover's PubAck; None when no stream leader answered within TAKEOVER_SECONDS. The same Msg-Id makes a
        later try safe: stored meanwhile, it is answered with the first one's sequence."""
        from nats.errors import NoRespondersError
        from nats.errors import TimeoutError as NatsTimeout

        headers = {EPOCH: str(self.epoch), FRAME: "0", OWNER: self.owner,
                   MSG_ID: f"{self.name}.{self.epoch}.{self.writer_id}.0", self._fence: str(last_seq)}
        deadline = time.monotonic() + TAKEOVER_SECONDS
        while True:
            try:
                msg = await nc.request(self.subject, record, timeout=ACK_SECONDS, headers=headers)
                if msg.data:
                    answer = parse_puback(0, msg.data)
                    if answer.error_code not in (WRONG_LAST_SEQUENCE_FOR_NOW, DUPLICATE_IN_PROCESS):
                        return answer
                    await asyncio.sleep(RESEND_SECONDS)
                    continue
            except (NoRespondersError, NatsTimeout):
                pass
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(RETRY_SECONDS)  # an election: the same Msg-Id makes the retry safe

    # -- the writer ------------------------------------------------------------------------------

    def _handed_fill_a_frame(self) -> bool:
        """Whether the commits waiting fill a frame already (a snapshot's chunks do): waiting would gain nothing."""
        size = 0
        for _, payload, _, _, _ in self._handed:
            size += len(payload) + 1
            if size >= self.max_payload:
                return True
        return False

    def _frame_wait_over(self) -> None:
        self._waiting_to_send = False
        self._wake.set()

    def _poke(self) -> None:
        self._wake.set()

    def _write(self) -> None:
        try:
            self._write_until_stopped(self._hub_nats())
        except Exception as e:  # a bug, or NATS gone for good, must not leave confirms waiting in silence
            log.exception("the writer of %s failed", self.label)
            self._stop_with(f"the replicated log's writer failed: {e!r}")
        finally:
            self._writer_done = True
            self.wake()

    def _write_until_stopped(self, hub: Hub) -> None:
        wake = self._wake
        self._inbox = hub.new_inbox()
        hub.subscribe(self._inbox + ".*", self._on_puback)
        hub.subscribe(self.owner_subject, self._on_owner_ping)
        # a rival's takeover is heard as it is published (the hub's connection does not hear its own frames):
        # an idle owner need not poll its log's tail for one
        hub.subscribe(self.subject, self._on_foreign_frame)
        heartbeat_seconds = self.heartbeat_seconds
        wake.set()  # commits handed during the replay's end
        last_check = self._last_sent_at = time.monotonic()
        checking: gevent.Greenlet | None = None
        # what the subscription could have missed (a reconnect) and a stream leader out of reach show in the tail
        # check: each second for one broker, every FIGURES_SECONDS for a cluster's group (sixteen groups' checks each
        # second, then one per heartbeat, were most of an idle NATS's API calls)
        tail_check_seconds = TAIL_CHECK_SECONDS if heartbeat_seconds is None else FIGURES_SECONDS
        reconnects = hub.reconnects
        reconnected = False
        while not self._stopping and self.fenced_by is None:
            if (self._in_flight or self._unsent or self._handed or self._trouble is not None
                    or self._stalled_since is not None or self.blocked is not None):
                wake.wait(TAIL_CHECK_SECONDS)  # an unanswered frame and a stall are looked at this often
            else:  # idle: until the next heartbeat or check is due
                due = last_check + tail_check_seconds
                if heartbeat_seconds is not None:
                    due = min(due, self._last_sent_at + heartbeat_seconds)
                wake.wait(max(0.0, due - time.monotonic()))
            wake.clear()
            if hub.reconnects != reconnects:
                # frames published meanwhile were not heard: look now, at the group's own tail
                reconnects, last_check, reconnected = hub.reconnects, 0.0, True
            if self._in_flight < self.max_in_flight and (not self._in_flight or self._handed_fill_a_frame()):
                # commits wait as handed until a frame can go, then go as one: taken at every wake, a
                # writer with one frame in flight queued a frame per hub turn and sent one per PubAck,
                # falling behind for good (2 groups in one process: 4,000-6,000 confirms/s, now 162,000).
                # A stream of its own pipelines full frames only: what is handed while a frame flies goes once it
                # is stored, as one fuller frame (a stored message costs NATS about the same, full or not: one
                # broker's confirmed publishes with an ack each went from 316,000 to 364,000 msg/s, and a lone
                # confirm waits no longer, since nothing flies then)
                wait = self._last_frame_at + self.frame_wait_seconds - time.monotonic()
                if wait <= 0 or not self._handed or self._handed_fill_a_frame():
                    self._take_handed()
                elif not self._waiting_to_send:
                    self._waiting_to_send = True
                    gevent.spawn_later(wait, self._frame_wait_over)
            now = time.monotonic()
            if (self.blocked is not None and not self._closed and self._trouble is None and not self._in_flight
                    and not self._unsent and not self._handed):
                # refusing confirms, no publish writes a frame that could show the log takes writes again: probe it
                # with an empty frame (a reader takes it for a heartbeat); stored, it ends the refusal
                self._add_frame([b""], False, 0, False, False)
            if self._in_flight and self._trouble is None:
                oldest = min((f.sent_at for f in self._by_token.values()), default=now)
                if now - oldest > ACK_SECONDS:
                    self._in_trouble(f"no PubAck within {ACK_SECONDS:g} s")
            if self._stalled_since is not None and now - self._stalled_since > self.timeout_seconds:
                self._stall_too_long(f"the replicated log has stored nothing for {self.timeout_seconds:g} s")
            if self._trouble is not None:
                self._read_tail()
                continue
            if (heartbeat_seconds is not None and not self._unsent and not self._in_flight
                    and now - self._last_sent_at >= heartbeat_seconds):
                self._last_sent_at = now  # the lease: standbys take over after silence
                self._send_beat(hub)
            self._send(hub)
            if now - last_check >= tail_check_seconds and (checking is None or checking.dead):
                last_check = now
                checking = gevent.spawn(self._check_tail, reconnected)
                reconnected = False

    def _send_beat(self, hub: Hub) -> None:
        """An idle owner's heartbeat: a core NATS message to the standbys naming its epoch and the last sequence it
        stored (nothing stored: a stored heartbeat was an R3 write with fsync every quarter lease per group, kept
        until the next snapshot). It reads nothing: a rival is heard as it appends (_on_foreign_frame), and a stream
        leader out of reach shows in the tail check, after which this owner sends no heartbeat and steps down after
        the lease."""
        try:
            hub.publish(self.beat_subject, b"", headers={EPOCH: str(self.epoch), LAST: str(self._tail_seq)})
        except BridgeError:
            pass  # reconnecting: the next beat goes, or the standbys take over after the lease

    def _on_foreign_frame(self, subject: str, reply: str, headers: Headers | None, data: bytes) -> None:
        """Another writer published on this log's subject: one of a higher epoch took it over, or tries to (a late
        frame of a lower epoch is an old owner's, and never counts). Heard as it is published, it may not be stored
        yet, or may be refused: the log's last sequence says which, read a moment later and again."""
        try:
            epoch = int((headers or {}).get(EPOCH, 0))
        except ValueError:
            return
        if self.handoff_to is not None or self._handoff_k == -1:
            return  # handing the group over: the node it goes to takes it over next, as asked
        if epoch > self.epoch and not self._stopping and (self._rival_check is None or self._rival_check.dead):
            log.warning("%s: %s appends with epoch %d; looking at the log's tail", self.label,
                        (headers or {}).get(OWNER) or "another writer", epoch)
            self._rival_check = gevent.spawn(self._look_for_rival)

    def _look_for_rival(self) -> None:
        for pause in RIVAL_CHECK_PAUSES:
            gevent.sleep(pause)
            if self._stopping or self.fenced_by is not None or self._trouble is not None:
                return  # a frame of this writer's was refused meanwhile: its tail read settles it
            if self._rival_found():
                return

    def _take_handed(self) -> None:
        """The hub's commits into frames: merged up to the frame size, split over max_payload."""
        handed = self._handed
        limit = self.max_payload
        parts: list[bytes] = []
        size = last_commit = 0
        starts = False
        while handed:
            number, payload, new_segment, completes, at = handed.popleft()
            self._commit_times.append((number, at))
            if parts and (new_segment or size + 1 + len(payload) > limit):
                self._add_frame(parts, False, last_commit, starts, False)
                parts, size, starts = [], 0, False
            if len(payload) > limit:  # alone, in parts
                for offset in range(0, len(payload), limit):
                    last = offset + limit >= len(payload)
                    self._add_frame([payload[offset:offset + limit]], not last, number if last else 0,
                                    new_segment and offset == 0, completes and last)
                continue
            parts.append(payload)
            size += len(payload) + 1
            last_commit = number
            starts = starts or new_segment
            if completes:
                self._add_frame(parts, False, number, starts, True)
                parts, size, starts = [], 0, False
        if parts:
            self._add_frame(parts, False, last_commit, starts, False)

    def _add_frame(self, parts: list[bytes], more: bool, commit: int, snapshot_starts: bool,
                   snapshot_ends: bool) -> None:
        """A frame of `parts` (commits, or one part of a commit), which count as handed bytes (unsynced_bytes)."""
        self._k += 1
        frame = _Frame(self._k, parts[0] if len(parts) == 1 else b"\n".join(parts), more, commit, snapshot_starts,
                       snapshot_ends, sum(map(len, parts)))
        self._frames[frame.k] = frame
        self._unsent.append(frame)

    def _send(self, hub: Hub) -> None:
        unsent = self._unsent
        publish, subject, inbox = hub.publish, self.subject, self._inbox
        epoch, prefix = str(self.epoch), f"{self.name}.{self.epoch}.{self.writer_id}."
        fence, max_in_flight, own_stream = self._fence, self.max_in_flight, not self.in_shared_stream
        while unsent and self._in_flight < max_in_flight and self._in_flight_bytes < MAX_IN_FLIGHT_BYTES:
            frame = unsent.popleft()
            frame.token = token = next(self._tokens)
            frame.sent_at = self._last_sent_at = self._last_frame_at = time.monotonic()
            self._by_token[token] = frame
            self._in_flight += 1
            self._in_flight_bytes += len(frame.payload)
            headers = {EPOCH: epoch, FRAME: str(frame.k), MSG_ID: prefix + str(frame.k), fence: str(self._tail_seq)}
            if frame.more:
                headers[MORE] = "1"
            if frame.snapshot_starts:
                headers[SNAPSHOT] = "1"
            if frame.handoff:
                headers[HANDOFF] = frame.handoff
            if own_stream:
                self._tail_seq += 1  # the next frame expects this one's sequence (in a shared one: set once stored)
            try:
                publish(subject, frame.payload, f"{inbox}.{token}", headers)
            except BridgeError as e:  # reconnecting: the tail read settles it
                self._in_trouble(f"publish failed: {e}")
                return

    def _on_puback(self, subject: str, reply: str, headers: Headers | None, data: bytes) -> None:
        frame = self._by_token.pop(int(subject.rpartition(".")[2]), None)
        if frame is None:
            return  # answered after a tail read settled it
        self._in_flight -= 1
        self._in_flight_bytes -= len(frame.payload)

        status = (headers or {}).get("Status") if not data else None
        if status is not None:  # 503: no stream leader (an election)
            self._in_trouble(f"NATS status {status}")
        else:
            ack = parse_puback(frame.k, data)
            if ack.error_code == WRONG_LAST_SEQUENCE_FOR_NOW and self.in_shared_stream:
                self._resent += 1
                self._unsent.appendleft(frame)  # the same frame (its Msg-Id) again, in a moment
                gevent.spawn_later(RESEND_SECONDS, self._poke)
                return
            if ack.error:
                self._in_trouble(f"error {ack.error_code}: {ack.error}")
            else:
                self._puback_ms.append((time.monotonic() - frame.sent_at) * 1000.0)
                self._stored(frame, ack.seq)
        self._wake.set()

    def _in_trouble(self, reason: str) -> None:
        """Stop sending until the tail is read; the stall lasts until a frame is stored again."""
        if self._trouble is None:
            self._trouble = reason
        if self._stalled_since is None:
            self._stalled_since = time.monotonic()

    def _stored(self, frame: _Frame, seq: int) -> None:
        """`frame` is in the stream at `seq`: advance what is durable over every frame stored in order."""
        frame.seq = seq
        if self.in_shared_stream and seq > self._tail_seq:
            self._tail_seq = seq
        if self._stalled_since is not None or (self.blocked is not None and self.fenced_by is None):
            self._stall_ended("frames are stored again")
        frames = self._frames
        durable = self._durable
        durable_bytes = self._durable_bytes
        purge = 0
        while (head := frames.get(self._stored_k + 1)) is not None and head.seq:
            del frames[head.k]
            self._stored_k = head.k
            self._stored_seq = head.seq
            durable_bytes += head.handed_bytes
            if head.snapshot_starts:
                self._snapshot_seq = head.seq
            if head.snapshot_ends and self._snapshot_seq:
                purge, self._snapshot_seq = self._snapshot_seq, 0
            if head.commit:
                durable = head.commit
            if head.k == self._handoff_k:
                self._handoff_k = -1  # stored: close() may go
        # every frame stored in order counts, a part of a commit too: counted only with the commit it completes, a
        # snapshot's 4 MB chunks (1 MB parts) left three quarters of it unsynced for good, and once that passed
        # MAX_UNSYNCED_BYTES publishers were never read again (a 136 MB snapshot did it)
        self._durable_bytes = durable_bytes
        self.unsynced_bytes = self._handed_bytes - durable_bytes
        if durable != self._durable:
            self._durable = durable
            times = self._commit_times
            while times and times[0][0] <= durable:
                times.popleft()
            self.wake()
        if purge:
            self._purging = gevent.spawn(self._purge, purge)

    def _stall_ended(self, how: str) -> None:
        if self._stalled_since is not None:
            log.info("%s: %s after %.1f s", self.label, how, time.monotonic() - self._stalled_since)
        self._stalled_since = None
        self._stall_logged = False
        if self.blocked is not None and self.fenced_by is None and not self._closed:  # closed: refused for good
            log.warning("%s: the replicated log takes writes again", self.label)
            self.blocked = None

    def _purge(self, below: int) -> None:
        """Remove the frames the stored snapshot starting at `below` replaces. A failed purge is tried again until
        a newer snapshot's purge takes its place: a broker that goes idle writes no next snapshot, and its stream
        would keep every frame it ever wrote."""
        pause = PURGE_RETRY_FIRST_SECONDS
        while not self._stopping and self.fenced_by is None and self._purging is gevent.getcurrent():
            try:
                self.bridge.run(functools.partial(self._purge_below, below=below), timeout=60)
            except Exception as e:
                self._purge_failures += 1
                log.warning("%s: purge below %d failed (%s): trying again in %g s", self.label, below,
                            e or type(e).__name__, pause)
                gevent.sleep(pause)
                pause = min(pause * 2, PURGE_RETRY_MAX_SECONDS)
            else:
                self._purges += 1
                return

    async def _purge_below(self, nc: Any, below: int) -> None:
        await nc.jetstream(timeout=self.timeout_seconds).purge_stream(
            self.stream, seq=below, subject=self.subject if self.in_shared_stream else None)

    def _check_tail(self, after_reconnect: bool = False) -> None:
        """Each second (a cluster's group: every FIGURES_SECONDS), as a greenlet of its own (a slow JetStream API
        call must not hold the writer): the stream's figures; and a stream that grew past this writer's last frame
        while it had nothing in flight means a rival whose frame was not heard (a reconnect), or a late frame: read
        its tail. A read that overlapped a send is stale, not a rival. A cluster's owner that cannot read it stops
        its heartbeats (a stall). A stream that stored nothing since the last check found no rival has no rival's
        frame either: its group's tail is not read (an idle cluster's owners read nothing but the figures, which a
        process's groups share)."""
        stream_last = None
        if self.heartbeat_seconds is not None:
            try:
                stream_last = self.bridge.run(self._note_figures, timeout=30)
            except Exception:
                pass
            if stream_last is not None and stream_last == self._stream_last_checked and not after_reconnect:
                return
        if not self._rival_found() and stream_last is not None and self._trouble is None:
            self._stream_last_checked = stream_last

    def _rival_found(self) -> bool:
        """Whether the log grew past this writer's last frame while it had nothing in flight: a rival whose frame was
        not heard (a reconnect), or a late frame; its tail is read next."""
        expected = self._tail_seq
        idle = not self._in_flight and not self._unsent
        try:
            last = self.bridge.run(self._last_seq, timeout=30)
        except Exception as e:
            if (self.heartbeat_seconds is not None and idle and not self._in_flight and not self._unsent
                    and self._trouble is None):
                # a leased owner that cannot reach its stream's leader stops its heartbeats: its standbys, which
                # may reach it, take the group over after the lease
                self._in_trouble(f"the log's last sequence could not be read ({type(e).__name__}: {e})")
                self._poke()
            return False
        if (last > expected and idle and expected == self._tail_seq and not self._in_flight and not self._unsent
                and self._trouble is None):
            self._in_trouble(f"the stream's last sequence is {last}, past this writer's {expected}")
            self._poke()
            return True
        return False

    def _read_tail(self) -> None:
        """After a refusal, an error or a timeout: settle every frame from the stream itself, then go on."""
        started = time.monotonic()
        if not self._stall_logged:  # once per stall, not once per tail read
            log.warning("%s: %s; reading the tail", self.label, self._trouble)
            self._stall_logged = True
            self._stalls += 1
        if self._trouble is not None and self._trouble.startswith("error"):
            # refused: the frames behind it are answered within moments (a timeout waits for nothing)
            while self._in_flight and time.monotonic() - started < ACK_SECONDS:
                gevent.sleep(0.05)
        last = 0
        while not self._stopping and self.fenced_by is None:
            try:
                last, found = self.bridge.run(functools.partial(self._tail_after, base=self._stored_seq), timeout=60)
                for seq, headers in found:
                    epoch = int(headers.get(EPOCH, 0))
                    if epoch > self.epoch:
                        self._fenced(headers.get(OWNER, "another broker"), epoch)
                        return
                    if epoch == self.epoch:
                        frame = self._frames.get(int(headers.get(FRAME, 0)))
                        if frame is not None and not frame.seq:
                            self._stored(frame, seq)
                break
            except Exception as e:
                # the stall as it is now: a PubAck that came meanwhile ended it (issue 56: read once, at the start,
                # a stall a PubAck had ended still refused confirms here, and nothing ever cleared that)
                stalled_since = self._stalled_since
                if stalled_since is not None and time.monotonic() - stalled_since > self.timeout_seconds:
                    self._stall_too_long(f"the replicated log has not answered for {self.timeout_seconds:g} s "
                                         f"({type(e).__name__}: {e})")
                gevent.sleep(RETRY_SECONDS)
        if self.fenced_by is not None or self._stopping:
            return
        # everything not stored goes again, in order, after the tail as it is now
        self._by_token.clear()
        self._in_flight = self._in_flight_bytes = 0

        again = sorted((f for f in self._frames.values() if not f.seq), key=lambda f: f.k)
        self._resent += sum(1 for f in again if f.token)
        self._unsent = deque(again)
        self._tail_seq = last
        self._trouble = None
        if not again and not self._frames and self._stalled_since is not None:
            self._stall_ended("the log answers again")  # an idle owner's: nothing waits to be stored
        log.debug("%s: tail read at sequence %d after %.1f s; %d frames go again", self.label, last,
                  time.monotonic() - started, len(again))
        self.wake()
        if self._stalled_since is not None:
            gevent.sleep(RETRY_SECONDS)  # NATS refused or did not answer: do not spin on it
        self._poke()

    async def _tail_after(self, nc: Any, base: int) -> tuple[int, list[tuple[int, dict[str, str]]]]:
        """The log's last sequence, and the headers of its messages after sequence `base` up to it, each read from
        the stream's leader (a replica may be behind), up to the first of a higher epoch; in a shared stream, its
        subject's alone."""
        js = nc.jetstream(timeout=3)
        last = await self._last_seq(nc)
        found: list[tuple[int, dict[str, str]]] = []
        seq = base
        while seq < last:
            try:
                if self.in_shared_stream:
                    msg = await js.get_msg(self.stream, seq + 1, subject=self.subject, next=True)
                    seq = int(msg.seq)
                    if seq > last:
                        break
                else:
                    seq += 1
                    msg = await js.get_msg(self.stream, seq)
            except Exception as e:
                if "no message found" in str(e).lower() or getattr(e, "err_code", 0) == NOT_FOUND:
                    if self.in_shared_stream:
                        break
                    continue
                raise
            headers = dict(msg.headers or {})
            found.append((seq, headers))
            if int(headers.get(EPOCH, 0)) > self.epoch:
                break
        return last, found

    def _stall_too_long(self, reason: str) -> None:
        """Confirmed publishes are refused, and the commits waiting longer than the timeout are failed.

        A cluster node's owner that has stored nothing for the whole lease steps down: a standby that can reach
        NATS takes the group over now, and this owner's clients must move there."""
        if self._stalled_since is None:
            return  # a frame was stored meanwhile: the log takes writes
        lease = self.lease_seconds
        if lease is not None and time.monotonic() - self._stalled_since > lease:
            log.error("%s: %s: this node steps down as its owner", self.label, reason)
            self._stop_with(f"the replicated log has stored nothing for {lease:g} s: this node "
                            f"stepped down as the owner of {self.label}")
            return
        if self.blocked is None:
            log.error("%s: %s: confirmed publishes are refused until it answers", self.label, reason)
            self.blocked = "the replicated log does not answer"
        cutoff = time.monotonic() - self.timeout_seconds
        waiting = [*self._commit_times, *((number, at) for number, _, _, _, at in list(self._handed))]
        failed = [number for number, at in waiting if at < cutoff and number > self._failed_up_to]
        if failed:
            self._failed_up_to = failed[-1]
            self._failed.extend(failed)
            self.wake()

    def _fenced(self, owner: str, epoch: int) -> None:
        log.critical("%s was taken over by %s (epoch %d > %d): this broker stops confirming and exits",
                     self.label, owner, epoch, self.epoch)
        self._stop_with(f"the log was taken over by {owner}")

    def _stop_with(self, reason: str) -> None:
        """Fail every commit not durable, and tell the hub this broker must stop."""
        self.blocked = reason
        self._failed.extend(number for number, _ in self._commit_times if number > self._failed_up_to)
        self._commit_times.clear()
        self.fenced_by = reason
        self.wake()

    def _on_owner_ping(self, subject: str, reply: str, headers: Headers | None, data: bytes) -> None:
        if self._handoff_k == -1 or self.fenced_by is not None:
            # handed over or taken over: the new owner answers; this process still listens until it exits, and an
            # answer from it made `mqks cluster move` report the group on the node it had just left (CI)
            return
        if reply and self._hub is not None:
            try:
                self._hub.publish(reply, json.dumps(
                    {"owner": self.owner, "epoch": self.epoch, "pid": os.getpid(), "node": self.node}).encode())
            except BridgeError:
                pass

    def _add_handoff(self) -> None:
        """The owner's last frame: after everything it wrote, it names the node that takes the group over."""
        assert self.handoff_to is not None
        self._add_frame([b""], False, 0, False, False)
        frame = self._frames[self._k]
        frame.handoff = self.handoff_to
        self._handoff_k = frame.k
        self._poke()

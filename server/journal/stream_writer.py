"""A log's writer (the cluster extra): the hub's commits merged into frames, published on the hub's own NATS
connection, fenced by expected sequences, durable once every frame up to theirs has its PubAck (jetstream_log.py
describes the frames and the fences). Its first refusal, error or timeout hands over to stream_recovery.py (the
tail read, the stall and its probe, rival checks) until frames are stored again. A leased owner's liveness
(heartbeats, hand-off, step-down) plugs in through `OwnerLease` (server/cluster/lease.py); one broker's `--log`
runs with none.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections import deque
from typing import Any, Protocol

import gevent
from gevent.event import Event

from ..nats_io.hub_nats import Headers
from ..nats_io.nats_bridge import BridgeError, Hub, parse_puback
from .journal import p50_p99, take_failed
from .stream import (
    ACK_SECONDS,
    EPOCH,
    FRAME,
    HANDOFF,
    MORE,
    MSG_ID,
    RESEND_SECONDS,
    SNAPSHOT,
    WRONG_LAST_SEQUENCE_FOR_NOW,
    LogStream,
)
from .stream_recovery import WriterRecovery

log = logging.getLogger("mqks.log")

# frames sent and not yet answered: full ones (a snapshot's parts); fewer that are not full, see _frame_may_go (a group
# of a shared stream: one, see _send)
MAX_IN_FLIGHT = 32
MAX_IN_FLIGHT_BYTES = 32 << 20  # JetStream's ingest queue holds 128 MiB: stay well under it
TAIL_CHECK_SECONDS = 1.0  # idle: look at the stream's last sequence this often (a rival, the figures)
FIGURES_SECONDS = 10.0  # a cluster's owner reads its stream's figures this often
PUBACK_SAMPLES = 1024
# a stream of its own sends a frame that is not full while others fly once the commits waiting weigh as much as a frame
# flying does on average, and at least this much (a stored frame costs NATS about 1 ms of CPU, 1 KB or 40 KB alike)
PIPELINED_FRAME_BYTES = 64 << 10
MAX_PIPELINED_FRAMES = 4  # ... while fewer than this many fly
# commits taken together that weigh at least two of those go as two frames, halves (a stream of its own): a client's
# window read in one hub turn went as one frame, and nothing of it was confirmed before the whole of it was stored;
# the first half's confirms now come while NATS stores the second, and the client's next publishes run meanwhile
# (issue 59's plain cell, window 2,000, against the local disk: 0.50x -> 0.62x, medians of 3, while the connection
# yielded with gevent.idle(); 0.62x -> 0.64x, medians of 7, faster in 6 of 7 pairs, with its timer yield of c4b4fde)


class Frame:
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


class OwnerLease(Protocol):
    """What a leased owner's liveness protocol adds to its writer (server/cluster/lease.py): the writer calls these
    at the moments named; the journal imports nothing of the cluster layer."""

    handoff_to: str | None  # set by the hub before close(): the owner's last frame names that node

    def confirm_timeout(self, timeout_seconds: float) -> float:
        """The log's timeout under the lease (confirms stop before a standby may take over)."""
        ...

    def beat_due(self, writer: StreamWriter) -> float:
        """When, on the monotonic clock, the idle writer should wake for its next heartbeat."""
        ...

    def idle(self, writer: StreamWriter, hub: Hub, now: float) -> None:
        """Nothing is unsent or in flight: a heartbeat, if one is due."""
        ...

    def steps_down(self, writer: StreamWriter, reason: str, stalled_for: float) -> bool:
        """The writer has stored nothing for `stalled_for` seconds: whether the owner steps down (it has stopped)."""
        ...

    def handing_over(self) -> bool:
        """The group is being handed to another node: its takeover is expected, not a rival's."""
        ...

    def handed_over(self, writer: StreamWriter) -> bool:
        """The hand-off frame is stored: the next owner answers for the group now."""
        ...

    def before_close(self, writer: StreamWriter, deadline: float) -> None:
        """Everything is stored, the writer still runs: the owner's last frame (a hand-off), if any."""
        ...


class StreamWriter:
    """The writer of one log: `commit()` hands a batch over, the writer greenlet sends it in frames, `poll()` says
    which commits are durable or failed. `start()` once the takeover is stored; `close()` drains and stops it."""

    def __init__(self, nats: LogStream, wake: Any, timeout_seconds: float, frame_wait_seconds: float = 0.0,
                 lease: OwnerLease | None = None) -> None:
        self.nats = nats
        self.wake = wake
        self.timeout_seconds = timeout_seconds
        self.lease = lease
        self.in_shared_stream = nats.in_shared_stream
        # a shared stream's subject fence names the previous frame's sequence, known once it is stored: one frame in
        # flight (commits waiting meanwhile go in the next, fuller one); a stream of its own pipelines its frames
        self.max_in_flight = 1 if self.in_shared_stream else MAX_IN_FLIGHT
        # ... and it sends its next frame at least this long after its last (a stored message costs NATS the same,
        # full or not: a cluster's 16 groups sent 900 frames a second of 45 publishes each, 0.7 ms of NATS CPU each)
        self.frame_wait_seconds = frame_wait_seconds if self.in_shared_stream else 0.0
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
        self._handed_waiting_bytes = 0  # of the commits handed and not yet taken into frames, a newline each
        # written by the writer greenlet, read by the journal
        self._durable = 0
        self._durable_bytes = 0
        self._failed: deque[int] = deque()
        self.blocked: str | None = None
        self.fenced_by: str | None = None  # the owner that took the stream over: this broker must stop
        # the writer's own
        self.epoch = 0
        self.writer_id = os.urandom(4).hex()
        self._k = 0
        self._frames: dict[int, Frame] = {}  # by k: built and not yet stored in order
        self._unsent: deque[Frame] = deque()
        self._in_flight = 0
        self._in_flight_bytes = 0
        self._waiting_to_send = False  # a timer wakes the writer when frame_wait_seconds have passed
        self._last_frame_at = 0.0  # when the last frame was sent (heartbeats aside)
        self.stored_k = 0  # every frame up to this one is stored
        self.tail_seq = 0  # the sequence the stream's last message has, as this writer expects it
        self._stored_seq = 0  # the sequence of the last frame stored in order
        self._tokens = itertools.count(1)
        self._by_token: dict[int, Frame] = {}
        self._commit_times: deque[tuple[int, float]] = deque()  # handed commits not yet durable
        self._failed_up_to = 0
        self._snapshot_seq = 0  # the first frame of the snapshot being stored
        self._stopping = False
        self.writer_done = False
        self._inbox = ""
        self._wake = Event()  # the writer's: commits handed, a PubAck, a check due
        self._writer: gevent.Greenlet | None = None
        self.last_sent_at = 0.0  # when anything was last sent (a frame, a heartbeat)
        self.recovery = WriterRecovery(self)
        # figures
        self._puback_ms: deque[float] = deque(maxlen=PUBACK_SAMPLES)
        self._resent = 0

    def start(self, epoch: int, seq: int) -> None:
        """The takeover (epoch `epoch`) is stored at `seq`: commits are taken from now on."""
        self.epoch = epoch
        self.tail_seq = self._stored_seq = seq
        self._k = 0
        self._refuse = None
        self._writer = gevent.spawn(self._write)

    def stats(self) -> dict[str, Any]:
        puback_ms_p50, puback_ms_p99 = p50_p99(self._puback_ms)
        return {"commits": self._commits, "frames_in_flight": self._in_flight, "bytes_in_flight": self._in_flight_bytes,
                "puback_ms_p50": puback_ms_p50, "puback_ms_p99": puback_ms_p99, "unsynced_bytes": self.unsynced_bytes,
                "disk_full": False, "blocked": self.blocked is not None, "epoch": self.epoch,
                "last_seq": self.tail_seq, "stalls": self.recovery.stalls, "resent_frames": self._resent,
                "purges": self.recovery.purges,
                "purge_failures": self.recovery.purge_failures}

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
        self._handed_waiting_bytes += len(payload) + 1
        if not self.writer_done and self._in_flight < self.max_in_flight and (
                len(self._handed) == 1 or (self._in_flight and self._frame_may_go())):
            # once per batch the writer has not taken, or once they may go beside frames flying: it takes every
            # commit waiting when it wakes; a group's writer with its frame in flight takes them once that frame is
            # stored, as its PubAck wakes it (waking it for nothing was a third of its wakes under load)
            self._wake.set()
        return number

    @property
    def handed_bytes(self) -> int:
        return self._handed_bytes

    def poll(self) -> tuple[int, list[int]]:
        """The highest durable commit, and the commits failed since the last poll."""
        return take_failed(self._durable, self._failed)

    def _handed_fill_a_frame(self) -> bool:
        """Whether the commits waiting fill a frame already (a snapshot's chunks do): waiting would gain nothing."""
        return self._handed_waiting_bytes >= self.nats.max_payload

    def _frame_may_go(self) -> bool:
        """Whether the commits waiting go as a frame now: nothing flies (a lone confirm waits no longer), they fill a
        frame, or fewer than MAX_PIPELINED_FRAMES fly and they weigh as much as one of those on average (at least
        PIPELINED_FRAME_BYTES): a client's window of confirmed publishes waited a PubAck for nothing, held while one
        frame flew. A group of a shared stream never gets here with a frame in flight (max_in_flight is 1)."""
        in_flight, waiting = self._in_flight, self._handed_waiting_bytes
        return (not in_flight or waiting >= self.nats.max_payload or (
            in_flight < MAX_PIPELINED_FRAMES and waiting >= PIPELINED_FRAME_BYTES
            and waiting * in_flight >= self._in_flight_bytes))

    def _frame_wait_over(self) -> None:
        self._waiting_to_send = False
        self._wake.set()

    def _poke(self) -> None:
        self._wake.set()

    def _write(self) -> None:
        try:
            self._write_until_stopped(self.nats.hub())
        except Exception as e:  # a bug, or NATS gone for good, must not leave confirms waiting in silence
            log.exception("the writer of %s failed", self.nats.label)
            self.stop_with(f"the replicated log's writer failed: {e!r}")
        finally:
            self.writer_done = True
            self.wake()

    def _write_until_stopped(self, hub: Hub) -> None:
        wake = self._wake
        self._inbox = hub.new_inbox()
        hub.subscribe(self._inbox + ".*", self._on_puback)
        hub.subscribe(self.nats.owner_subject, self._on_owner_ping)
        # a rival's takeover is heard as it is published (the hub's connection does not hear its own frames):
        # an idle owner need not poll its log's tail for one
        hub.subscribe(self.nats.subject, self.recovery.on_foreign_frame)
        lease, recovery = self.lease, self.recovery
        wake.set()  # commits handed during the replay's end
        last_check = self.last_sent_at = time.monotonic()
        checking: gevent.Greenlet | None = None
        # what the subscription could have missed (a reconnect) and a stream leader out of reach show in the tail
        # check: each second for one broker, every FIGURES_SECONDS for a cluster's group (sixteen groups' checks each
        # second, then one per heartbeat, were most of an idle NATS's API calls)
        tail_check_seconds = TAIL_CHECK_SECONDS if lease is None else FIGURES_SECONDS
        reconnects = hub.reconnects
        reconnected = False
        while not self._stopping and self.fenced_by is None:
            if (self._in_flight or self._unsent or self._handed or recovery.trouble is not None
                    or recovery.stalled_since is not None or self.blocked is not None):
                wake.wait(TAIL_CHECK_SECONDS)  # an unanswered frame and a stall are looked at this often
            else:  # idle: until the next heartbeat or check is due
                due = last_check + tail_check_seconds
                if lease is not None:
                    due = min(due, lease.beat_due(self))
                wake.wait(max(0.0, due - time.monotonic()))
            wake.clear()
            if hub.reconnects != reconnects:
                # frames published meanwhile were not heard: look now, at the group's own tail
                reconnects, last_check, reconnected = hub.reconnects, 0.0, True
            if self._in_flight < self.max_in_flight and self._frame_may_go():
                # commits wait as handed until a frame can go, then go as one: taken at every wake, a
                # writer with one frame in flight queued a frame per hub turn and sent one per PubAck,
                # falling behind for good (2 groups in one process: 4,000-6,000 confirms/s, now 162,000).
                # A stream of its own pipelines full frames, and frames as heavy as those flying (_frame_may_go):
                # what is handed while a frame flies goes once it is stored, as one fuller frame (a stored message
                # costs NATS about the same, full or not: one broker's confirmed publishes with an ack each went
                # from 316,000 to 364,000 msg/s, and a lone confirm waits no longer, since nothing flies then)
                wait = self._last_frame_at + self.frame_wait_seconds - time.monotonic()
                if wait <= 0 or not self._handed or self._handed_fill_a_frame():
                    self._take_handed()
                elif not self._waiting_to_send:
                    self._waiting_to_send = True
                    gevent.spawn_later(wait, self._frame_wait_over)
            now = time.monotonic()
            if (self.blocked is not None and not self._closed and recovery.trouble is None and not self._in_flight
                    and not self._unsent and not self._handed):
                # refusing confirms, no publish writes a frame that could show the log takes writes again: probe it
                # with an empty frame (a reader takes it for a heartbeat); stored, it ends the refusal
                self._add_frame([b""], False, 0, False, False)
            if self._in_flight and recovery.trouble is None:
                oldest = min((f.sent_at for f in self._by_token.values()), default=now)
                if now - oldest > ACK_SECONDS:
                    recovery.in_trouble(f"no PubAck within {ACK_SECONDS:g} s")
            if recovery.stalled_since is not None and now - recovery.stalled_since > self.timeout_seconds:
                recovery.stall_too_long(f"the replicated log has stored nothing for {self.timeout_seconds:g} s")
            if recovery.trouble is not None:
                recovery.read_tail()
                continue
            if lease is not None and not self._unsent and not self._in_flight:
                lease.idle(self, hub, now)
            self._send(hub)
            if now - last_check >= tail_check_seconds and (checking is None or checking.dead):
                last_check = now
                checking = gevent.spawn(recovery.check_tail, reconnected)
                reconnected = False

    def _on_owner_ping(self, subject: str, reply: str, headers: Headers | None, data: bytes) -> None:
        if (self.lease is not None and self.lease.handed_over(self)) or self.fenced_by is not None:
            # handed over or taken over: the new owner answers; this process still listens until it exits, and an
            # answer from it made `mqks cluster move` report the group on the node it had just left (CI)
            return
        hub = self.nats.hub_if_made
        if reply and hub is not None:
            try:
                about = {"owner": self.nats.owner, "epoch": self.epoch, "pid": os.getpid(), "node": self.nats.node}
                hub.publish(reply, json.dumps(about).encode())
            except BridgeError:
                pass

    def _take_handed(self) -> None:
        """The hub's commits into frames: merged up to the frame size, split over max_payload; on a stream of its
        own, commits as heavy as two pipelined frames go as two, the first closed once it holds half of them."""
        handed = self._handed
        half = self._handed_waiting_bytes // 2
        if self.in_shared_stream or half < PIPELINED_FRAME_BYTES:
            half = 0  # one frame flies at a time there: the second half would wait a PubAck
        self._handed_waiting_bytes = 0
        limit = self.nats.max_payload
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
            if completes or size >= half > 0:
                self._add_frame(parts, False, number, starts, completes)
                parts, size, starts, half = [], 0, False, 0
        if parts:
            self._add_frame(parts, False, last_commit, starts, False)

    def _add_frame(self, parts: list[bytes], more: bool, commit: int, snapshot_starts: bool,
                   snapshot_ends: bool) -> None:
        """A frame of `parts` (commits, or one part of a commit), which count as handed bytes (unsynced_bytes)."""
        self._k += 1
        frame = Frame(self._k, parts[0] if len(parts) == 1 else b"\n".join(parts), more, commit, snapshot_starts,
                       snapshot_ends, sum(map(len, parts)))
        self._frames[frame.k] = frame
        self._unsent.append(frame)

    def add_handoff(self, node: str) -> Frame:
        """The owner's last frame: after everything it wrote, it names the node that takes the group over."""
        self._add_frame([b""], False, 0, False, False)
        frame = self._frames[self._k]
        frame.handoff = node
        self._poke()
        return frame

    def _send(self, hub: Hub) -> None:
        unsent = self._unsent
        publish, subject, inbox = hub.publish, self.nats.subject, self._inbox
        epoch, prefix = str(self.epoch), f"{self.nats.name}.{self.epoch}.{self.writer_id}."
        fence, max_in_flight, own_stream = self.nats.fence, self.max_in_flight, not self.in_shared_stream
        while unsent and self._in_flight < max_in_flight and self._in_flight_bytes < MAX_IN_FLIGHT_BYTES:
            frame = unsent.popleft()
            frame.token = token = next(self._tokens)
            frame.sent_at = self.last_sent_at = self._last_frame_at = time.monotonic()
            self._by_token[token] = frame
            self._in_flight += 1
            self._in_flight_bytes += len(frame.payload)
            headers = {EPOCH: epoch, FRAME: str(frame.k), MSG_ID: prefix + str(frame.k), fence: str(self.tail_seq)}
            if frame.more:
                headers[MORE] = "1"
            if frame.snapshot_starts:
                headers[SNAPSHOT] = "1"
            if frame.handoff:
                headers[HANDOFF] = frame.handoff
            if own_stream:
                self.tail_seq += 1  # the next frame expects this one's sequence (in a shared one: set once stored)
            try:
                publish(subject, frame.payload, f"{inbox}.{token}", headers)
            except BridgeError as e:  # reconnecting: the tail read settles it
                self.recovery.in_trouble(f"publish failed: {e}")
                return

    def _on_puback(self, subject: str, reply: str, headers: Headers | None, data: bytes) -> None:
        frame = self._by_token.pop(int(subject.rpartition(".")[2]), None)
        if frame is None:
            return  # answered after a tail read settled it
        self._in_flight -= 1
        self._in_flight_bytes -= len(frame.payload)

        status = (headers or {}).get("Status") if not data else None
        if status is not None:  # 503: no stream leader (an election)
            self.recovery.in_trouble(f"NATS status {status}")
        else:
            ack = parse_puback(frame.k, data)
            if ack.error_code == WRONG_LAST_SEQUENCE_FOR_NOW and self.in_shared_stream:
                self._resent += 1
                self._unsent.appendleft(frame)  # the same frame (its Msg-Id) again, in a moment
                gevent.spawn_later(RESEND_SECONDS, self._poke)
                return
            if ack.error:
                self.recovery.in_trouble(f"error {ack.error_code}: {ack.error}")
            else:
                self._puback_ms.append((time.monotonic() - frame.sent_at) * 1000.0)
                self._stored(frame, ack.seq)
        self._wake.set()

    def _stored(self, frame: Frame, seq: int) -> None:
        """`frame` is in the stream at `seq`: advance what is durable over every frame stored in order."""
        frame.seq = seq
        if self.in_shared_stream and seq > self.tail_seq:
            self.tail_seq = seq
        if self.recovery.stalled_since is not None or (self.blocked is not None and self.fenced_by is None):
            self.recovery.stall_ended("frames are stored again")
        frames = self._frames
        durable = self._durable
        durable_bytes = self._durable_bytes
        purge = 0
        while (head := frames.get(self.stored_k + 1)) is not None and head.seq:
            del frames[head.k]
            self.stored_k = head.k
            self._stored_seq = head.seq
            durable_bytes += head.handed_bytes
            if head.snapshot_starts:
                self._snapshot_seq = head.seq
            if head.snapshot_ends and self._snapshot_seq:
                purge, self._snapshot_seq = self._snapshot_seq, 0
            if head.commit:
                durable = head.commit
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
            self.recovery.purging = gevent.spawn(self.recovery.purge, purge)

    def stop_with(self, reason: str) -> None:
        """Fail every commit not durable, and tell the hub this broker must stop."""
        self.blocked = reason
        self._failed.extend(number for number, _ in self._commit_times if number > self._failed_up_to)
        self._commit_times.clear()
        self.fenced_by = reason
        self.wake()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_seconds: float | None = None) -> None:
        """Send what is open, wait (at most timeout_seconds) until it is stored (and the lease's last frame), then
        stop the writer."""
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
        while (self._durable < self._commits and not self.writer_done and self.fenced_by is None
               and time.monotonic() < deadline):
            gevent.sleep(0.01)
        if self._durable < self._commits and self.fenced_by is None:
            log.error("closing %s: %d bytes of unconfirmed records are not stored (%s); stopping without "
                      "them", self.nats.label, self.unsynced_bytes, why_not_stored)
        elif self.lease is not None and self.fenced_by is None and not self.writer_done:
            self.lease.before_close(self, deadline)
        self._stopping = True
        self._wake.set()
        if self._writer is not None:
            self._writer.join(timeout=1.0)  # its last moments (a tail read) end before the bridge closes under it
            self._writer.kill(block=False)
        for helper in (self.recovery.purging, self.recovery.rival_check):
            if helper is not None:
                helper.kill(block=False)

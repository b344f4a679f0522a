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

The roles, as NATS splits its stream store from raft: stream.py (where the log lives, the JetStream API calls),
stream_writer.py and stream_recovery.py (the writer, its tail reads and stalls), stream_reader.py (replay,
follow, `Replayer`), the transport below them (nats_io/), and a leased owner's liveness above them
(cluster/lease.py, through the writer's `OwnerLease` hooks). `JetStreamLog` is the journal's `Log` over them.

Compaction: a snapshot starts a new frame; once its last frame and every frame before it are stored, the
writer purges the stream below the snapshot's first frame. A purge takes no expected-sequence check, but
it needs none here: it only removes frames a complete, stored snapshot covers, and a writer taken over
before its snapshot was stored whole never gets that far (its first frame after the takeover is refused,
so the rest never count as stored).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..nats_io.nats_bridge import Bridge, BridgeError, SharedNats
from . import records
from .stream import (
    EPOCH,
    EXPECTED_OF_SUBJECT,
    FRAME,
    HANDOFF,
    LAST,
    MORE,
    MSG_ID,
    OWNER,
    SNAPSHOT,
    WRONG_LAST_SEQUENCE,
    LogOwned,
    LogStream,
)
from .stream_reader import Replayer, StreamReader, StreamReading
from .stream_writer import OwnerLease, StreamWriter

__all__ = ["EPOCH", "EXPECTED_OF_SUBJECT", "FRAME", "HANDOFF", "LAST", "MORE", "MSG_ID", "OWNER", "SNAPSHOT",
           "JetStreamLog", "LogOwned", "Replayer", "StreamReading"]

log = logging.getLogger("mqks.log")


class JetStreamLog:
    """The journal's Log on a JetStream stream; `open()`, then `replay()` to the end (which takes the stream
    over), then commits. A cluster's election reads, follows and takes over with the calls below instead of
    `replay()`; it passes its group's `lease`."""

    disk_full = False  # no disk of ours: `blocked` says why the log cannot write
    where = "in the replicated log"

    def __init__(self, servers: list[str], stream: str, owner: str, replicas: int = 3, takeover: bool = False,
                 timeout_seconds: float = 15.0, wake: Callable[[], None] = lambda: None,
                 connect_timeout: float = 5.0, lease: OwnerLease | None = None, node: str | None = None,
                 nats_options: dict[str, Any] | None = None, shared: SharedNats | None = None,
                 group: str | None = None, stream_subjects: list[str] | None = None,
                 frame_wait_seconds: float = 0.0) -> None:
        if lease is not None:
            timeout_seconds = lease.confirm_timeout(timeout_seconds)
        self.nats = LogStream(servers, stream, owner, replicas, timeout_seconds, connect_timeout, node, nats_options,
                              shared, group, stream_subjects)
        self.takeover = takeover
        self.lease = lease
        self.wake = wake
        self.name, self.label, self.owner, self.stream = self.nats.name, self.nats.label, owner, stream
        self.writer = StreamWriter(self.nats, wake, timeout_seconds, frame_wait_seconds, lease)
        self.reader = StreamReader(self.nats, hears_beats=lease is not None)
        self.append = self.writer.append
        self.commit = self.writer.commit
        self.poll = self.writer.poll
        self.blocked_in = self.writer  # what holds `blocked` (Journal.blocked reads it there, not through ours)
        self._ignored_frames = 0
        self._recovery_seconds = 0.0

    # what the hub, the journal and the cluster layer read of the parts

    @property
    def epoch(self) -> int:
        return self.writer.epoch

    @property
    def blocked(self) -> str | None:
        return self.writer.blocked

    @blocked.setter
    def blocked(self, value: str | None) -> None:
        self.writer.blocked = value

    @property
    def fenced_by(self) -> str | None:
        return self.writer.fenced_by

    @fenced_by.setter
    def fenced_by(self, value: str | None) -> None:
        self.writer.fenced_by = value

    @property
    def unsynced_bytes(self) -> int:
        return self.writer.unsynced_bytes

    @unsynced_bytes.setter
    def unsynced_bytes(self, value: int) -> None:
        self.writer.unsynced_bytes = value

    @property
    def handed_bytes(self) -> int:
        return self.writer.handed_bytes

    @property
    def frames_waiting(self) -> bool:
        """Never: a snapshot's next chunk must not wait for this writer. It is a greenlet of the hub the snapshot
        holds (the disk log's writer is a thread): waiting for it blocked the broker for good. A snapshot's
        chunks wait in memory, handed, until it ends; the journal stops reading publishers meanwhile (their
        bytes are unsynced)."""
        return False

    @property
    def bridge(self) -> Bridge:
        return self.nats.bridge

    @property
    def handoff_to(self) -> str | None:
        """The node the owner's last frame hands the group to (set by the hub before close(); a leased log's)."""
        return self.lease.handoff_to if self.lease is not None else None

    @handoff_to.setter
    def handoff_to(self, node: str | None) -> None:
        if self.lease is not None:
            self.lease.handoff_to = node

    def open(self) -> None:
        """Connect and make sure the stream exists; raises BridgeError when NATS cannot be reached."""
        self.nats.bridge.start()
        self.nats.bridge.run(self.nats.ensure, timeout=60)

    def replay(self, repair: bool = False) -> Iterator[bytes]:
        """Every record the stream holds, in order; then take the stream over (a takeover message with epoch+1,
        expecting the last sequence read), whose record ends the replay. Refuses (LogOwned) while another broker
        answers for the stream, unless --takeover. `repair` has no meaning here. A cluster node does not call this:
        its cluster layer (server/cluster/election.py) reads, follows and takes over with the calls below."""
        reading = self.start_reading()
        while True:
            for batch in self.read_to_tail(reading):
                yield from batch
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
        return self.reader.start_reading()

    def read_to_tail(self, reading: StreamReading) -> Iterator[list[bytes]]:
        return self.reader.read_to_tail(reading)

    def follow(self, reading: StreamReading, fresh_after: int = 0) -> None:
        self.reader.follow(reading, fresh_after)

    def read_followed(self, reading: StreamReading, timeout: float) -> tuple[bool, list[bytes]]:
        return self.reader.read_followed(reading, timeout)

    def stop_following(self, reading: StreamReading) -> None:
        self.reader.stop_following(reading)

    def take_over(self, reading: StreamReading) -> bytes | None:
        """Append the takeover message (epoch + 1), expecting the stream's last sequence to be `reading.read`: its
        record once stored, and the writer starts. None when something came after what was read (another writer
        took it over first, or an owner appended): `reading.last_seq` is the tail then, read on to it."""
        run = self.nats.bridge.run
        replayer = reading.replayer
        self.nats.hub()  # the writer's connection, before taking over: a log that cannot have it must not
        writer = self.writer
        writer.epoch = epoch = replayer.epoch + 1
        record = records.takeover(epoch, self.owner.encode())
        answer = run(functools.partial(self.nats.append_takeover, record=record, last_seq=reading.read, epoch=epoch,
                                       writer_id=writer.writer_id), timeout=60)
        if answer is None:  # no stream leader answered for a while: NATS is electing one (a heal); stand by again
            log.warning("%s: no stream leader answers the takeover (NATS is electing one): standing by again",
                        self.label)
            return None
        if answer.error_code == WRONG_LAST_SEQUENCE:
            reading.last_seq = run(self.nats.last_seq, timeout=60)
            return None
        if answer.error:
            raise BridgeError(f"{self.label}: the takeover was refused: {answer.error}")
        if replayer.epoch:
            log.info("%s: taken over from %s (epoch %d -> %d)", self.label, replayer.owner or "?",
                     replayer.epoch, epoch)
        else:
            log.info("%s: taken (epoch %d)", self.label, epoch)
        self._ignored_frames = replayer.ignored
        run(self.reader.close_reader, timeout=30)
        self._recovery_seconds = time.perf_counter() - reading.started
        writer.start(epoch, answer.seq)
        return record

    def ask_owner(self, silent_is_owner: bool = False) -> str | None:
        """The running owner's description, or None when no broker answers for the stream (with `silent_is_owner`,
        only when none listens: one that listens and does not answer may be paused, not gone)."""
        return self.nats.bridge.run(functools.partial(self.nats.ask_owner, silent_is_owner=silent_is_owner),
                                    timeout=30)

    def last_seq(self) -> int:
        """The stream's last sequence now (one stream info)."""
        return self.nats.bridge.run(self.nats.last_seq, timeout=30)

    def stats(self) -> dict[str, Any]:
        return {"log_bytes": self.nats.stream_bytes, "stream_messages": self.nats.stream_messages,
                **self.writer.stats(), "stream": self.nats.stream, "stream_leader": self.nats.leader,
                "replayed_records": self.reader.replayed_records, "ignored_frames": self._ignored_frames,
                "recovery_seconds": self._recovery_seconds}

    def close(self, timeout_seconds: float | None = None) -> None:
        """Send what is open, wait (at most timeout_seconds) until it is stored, then disconnect."""
        if self.writer.closed:
            return
        self.writer.close(timeout_seconds)
        self.reader.close()
        self.nats.bridge.close()

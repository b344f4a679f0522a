"""A log's reader (the cluster extra): replay to the tail on a pull consumer, then, for a standby, follow the tail
on a push consumer NATS sends each frame to as it is stored, and hear the owner's heartbeats. `Replayer` turns the
messages into the records of the frames that count (epoch, then counter order; jetstream_log.py says why);
`StreamReading` is how far one reading has come. It reads only: stream_writer.py appends.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import gevent
from gevent.event import Event

from ..nats_io.hub_nats import Headers, ack_sequences
from ..nats_io.nats_bridge import BridgeError
from .stream import EPOCH, FRAME, HANDOFF, LAST, MORE, OWNER, RETRY_SECONDS, SNAPSHOT, LogStream

log = logging.getLogger("mqks.log")

REPLAY_BATCH = 256
FOLLOW_IDLE_SECONDS = 10.0  # NATS drops a standby's push consumer this long after its subscription went
REPLAY_RETRY_SECONDS = 30.0  # replay: a read that keeps failing this long (NATS away) ends the start


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


class StreamReader:
    """Reads one log: to its tail (a pull reader), then follows it (a push consumer) with the owner's heartbeats."""

    def __init__(self, nats: LogStream, hears_beats: bool = False) -> None:
        self.nats = nats
        self.hears_beats = hears_beats  # a leased group's standby hears its idle owner's heartbeats
        self.replayed_records = 0
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

    @property
    def label(self) -> str:
        return self.nats.label

    def close(self) -> None:
        if self._refollowing is not None:
            self._refollowing.kill(block=False)

    def start_reading(self) -> StreamReading:
        """A reading of the stream from its first message (a pull reader on NATS), up to its tail as of now."""
        reading = StreamReading()
        self.replayed_records = 0
        reading.last_seq = self.nats.bridge.run(self._open_reader, timeout=60)
        return reading

    def read_to_tail(self, reading: StreamReading) -> Iterator[list[bytes]]:
        """The records of every message after `reading.read` up to `reading.last_seq`, a list per read."""
        run = self.nats.bridge.run
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
            yield self._feed(reading, batch)

    def _feed(self, reading: StreamReading, batch: list[tuple[int, dict[str, str] | None, bytes]]) -> list[bytes]:
        lines: list[bytes] = []
        replayer = reading.replayer
        for seq, headers, data in batch:
            reading.read = seq
            lines += replayer.feed(headers, data)
        self.replayed_records += len(lines)
        return lines

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

    async def _open_reader(self, nc: Any, start_seq: int = 0) -> int:
        """A reader from `start_seq` (the start: 0); the stream's last sequence. A reader that cannot be made now
        (an election) is made by the next read."""
        last_seq = await self.nats.last_seq(nc)
        if self._reader is not None:
            await self.close_reader(nc)
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
        self._reader = await nc.jetstream(timeout=self.nats.timeout_seconds).pull_subscribe(
            self.nats.subject, durable=None, stream=self.nats.stream,
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
            await self.close_reader(nc)
            raise
        batch = [(msg.metadata.sequence.stream, msg.headers, msg.data) for msg in msgs]
        if batch:
            self._next_seq = batch[-1][0] + 1
        return batch

    def _follow(self, start_seq: int, keep: bool = False) -> None:
        """Follow the stream from `start_seq` on a push consumer (memory, one replica, no acks) that delivers to an
        inbox of the hub's connection: frames come to `_on_followed` as they are stored. Replaces the replay's pull
        reader and any earlier follower; the frames the hub has not taken yet are dropped unless `keep` (they come
        before `start_seq`)."""
        hub = self.nats.hub()
        if self._reader is not None:
            self.nats.bridge.run(self.close_reader, timeout=30)
        self._stop_following()
        if not keep:
            self._followed.clear()
        self._follow_next = start_seq
        self._follow_generation += 1
        inbox = hub.new_inbox()
        # the subscription first, and NATS has it (a PONG) before the consumer exists: it starts sending at once
        self._follower = hub.subscribe(inbox, functools.partial(self._on_followed, self._follow_generation))
        if self._beats is None and self.hears_beats:
            self._beats = hub.subscribe(self.nats.beat_subject, self._on_beat)
        self._follow_next_delivery = 1
        hub.sync()
        self.nats.bridge.run(functools.partial(self._add_follower, inbox=inbox, start_seq=start_seq), timeout=30)

    async def _add_follower(self, nc: Any, inbox: str, start_seq: int) -> None:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        jsm = nc.jetstream(timeout=self.nats.timeout_seconds)._jsm
        await jsm.add_consumer(self.nats.stream, config=ConsumerConfig(
            deliver_subject=inbox, deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq,
            filter_subject=self.nats.subject, ack_policy=AckPolicy.NONE, mem_storage=True, num_replicas=1,
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
        hub = self.nats.hub_if_made
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

    async def close_reader(self, nc: Any) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            try:
                await reader.unsubscribe()
            except Exception:
                pass

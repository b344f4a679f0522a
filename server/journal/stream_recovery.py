"""A log writer's slow path (stream_writer.py): after a refusal, an error or a timeout, the tail read that settles
every frame from the stream itself (stored, to send again, or a rival's takeover: fenced); the stall that
refuses confirmed publishes past the timeout and its probe; the rival checks (a rival's frame heard on the
subject, the periodic tail check); and compaction's purge, tried again until it is made. A leased owner's
step-down is its lease's (`OwnerLease.steps_down`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

import gevent

from ..nats_io.hub_nats import Headers
from .stream import ACK_SECONDS, EPOCH, FRAME, OWNER, RETRY_SECONDS

if TYPE_CHECKING:
    from .stream_writer import StreamWriter

log = logging.getLogger("mqks.log")

RIVAL_CHECK_PAUSES = (0.05, 0.25, 1.0)  # a rival's frame heard: look at the tail after these (stored, or refused)
PURGE_RETRY_FIRST_SECONDS = 1.0  # a failed purge is tried again after this, doubling up to the next
PURGE_RETRY_MAX_SECONDS = 30.0
# a tail read unanswered this long is asked again beside it (TAIL_ASKS asks in all): NATS never answers a request
# sent while it has no stream leader, it waits out its whole timeout (5 s), and one sent once the leader is elected is
# answered at once (issue 56: frames were stored again 5.8 s after the election). In all, not at once: with NATS out
# of reach each ask fails after its timeout, and a new one beside them would keep the read from ever failing, so
# the writer never stalled and an owner cut off from NATS never stepped down
TAIL_ASK_AGAIN_SECONDS = 0.5
TAIL_ASKS = 6


class WriterRecovery:
    """The writer's trouble (the first error since the last tail read), its stall (since a frame was last
    stored), and what settles them; it reads and resets the writer's frames, which only the hub's greenlets touch."""

    def __init__(self, writer: StreamWriter) -> None:
        self.writer = writer
        self.trouble: str | None = None  # the first error since the last tail read
        self.stalled_since: float | None = None  # the first trouble since a frame was last stored
        self.stall_logged = False
        self.stalls = 0
        self.stream_last_checked = -1  # the stream's last sequence when the last tail check found no rival
        self.rival_check: gevent.Greenlet | None = None
        self.purging: gevent.Greenlet | None = None  # the purge being made: an older one still retrying gives up
        self.purges = 0
        self.purge_failures = 0

    def in_trouble(self, reason: str) -> None:
        """Stop sending until the tail is read; the stall lasts until a frame is stored again."""
        if self.trouble is None:
            self.trouble = reason
        if self.stalled_since is None:
            self.stalled_since = time.monotonic()

    def stall_ended(self, how: str) -> None:
        w = self.writer
        if self.stalled_since is not None:
            log.info("%s: %s after %.1f s", w.nats.label, how, time.monotonic() - self.stalled_since)
        self.stalled_since = None
        self.stall_logged = False
        if w.blocked is not None and w.fenced_by is None and not w._closed:  # closed: refused for good
            log.warning("%s: the replicated log takes writes again", w.nats.label)
            w.blocked = None

    def check_tail(self, after_reconnect: bool = False) -> None:
        """Each second (a cluster's group: every FIGURES_SECONDS), as a greenlet of its own (a slow JetStream API
        call must not hold the writer): the stream's figures; and a stream that grew past this writer's last frame
        while it had nothing in flight means a rival whose frame was not heard (a reconnect), or a late frame: read
        its tail. A read that overlapped a send is stale, not a rival. A cluster's owner that cannot read it stops
        its heartbeats (a stall). A stream that stored nothing since the last check found no rival has no rival's
        frame either: its group's tail is not read (an idle cluster's owners read nothing but the figures, which a
        process's groups share)."""
        w = self.writer
        stream_last = None
        if w.lease is not None:
            try:
                stream_last = w.nats.bridge.run(w.nats.note_figures, timeout=30)
            except Exception:
                pass
            if stream_last is not None and stream_last == self.stream_last_checked and not after_reconnect:
                return
        if not self.rival_found() and stream_last is not None and self.trouble is None:
            self.stream_last_checked = stream_last

    def rival_found(self) -> bool:
        """Whether the log grew past this writer's last frame while it had nothing in flight: a rival whose frame was
        not heard (a reconnect), or a late frame; its tail is read next."""
        w = self.writer
        expected = w.tail_seq
        idle = not w._in_flight and not w._unsent
        try:
            last = w.nats.bridge.run(w.nats.last_seq, timeout=30)
        except Exception as e:
            if (w.lease is not None and idle and not w._in_flight and not w._unsent
                    and self.trouble is None):
                # a leased owner that cannot reach its stream's leader stops its heartbeats: its standbys, which
                # may reach it, take the group over after the lease
                self.in_trouble(f"the log's last sequence could not be read ({type(e).__name__}: {e})")
                w._poke()
            return False
        if (last > expected and idle and expected == w.tail_seq and not w._in_flight and not w._unsent
                and self.trouble is None):
            self.in_trouble(f"the stream's last sequence is {last}, past this writer's {expected}")
            w._poke()
            return True
        return False

    def on_foreign_frame(self, subject: str, reply: str, headers: Headers | None, data: bytes) -> None:
        """Another writer published on this log's subject: one of a higher epoch took it over, or tries to (a late
        frame of a lower epoch is an old owner's, and never counts). Heard as it is published, it may not be stored
        yet, or may be refused: the log's last sequence says which, read a moment later and again."""
        w = self.writer
        try:
            epoch = int((headers or {}).get(EPOCH, 0))
        except ValueError:
            return
        if w.lease is not None and w.lease.handing_over():
            return  # handing the group over: the node it goes to takes it over next, as asked
        if epoch > w.epoch and not w._stopping and (self.rival_check is None or self.rival_check.dead):
            log.warning("%s: %s appends with epoch %d; looking at the log's tail", w.nats.label,
                        (headers or {}).get(OWNER) or "another writer", epoch)
            self.rival_check = gevent.spawn(self.look_for_rival)

    def look_for_rival(self) -> None:
        w = self.writer
        for pause in RIVAL_CHECK_PAUSES:
            gevent.sleep(pause)
            if w._stopping or w.fenced_by is not None or self.trouble is not None:
                return  # a frame of this writer's was refused meanwhile: its tail read settles it
            if self.rival_found():
                return

    def read_tail(self) -> None:
        """After a refusal, an error or a timeout: settle every frame from the stream itself, then go on."""
        w = self.writer
        started = time.monotonic()
        if not self.stall_logged:  # once per stall, not once per tail read
            log.warning("%s: %s; reading the tail", w.nats.label, self.trouble)
            self.stall_logged = True
            self.stalls += 1
        if self.trouble is not None and self.trouble.startswith("error"):
            # refused: the frames behind it are answered within moments (a timeout waits for nothing)
            while w._in_flight and time.monotonic() - started < ACK_SECONDS:
                gevent.sleep(0.05)
        last = 0
        while not w._stopping and w.fenced_by is None:
            try:
                last, found = self.ask_tail()
                for seq, headers in found:
                    epoch = int(headers.get(EPOCH, 0))
                    if epoch > w.epoch:
                        self.fenced(headers.get(OWNER, "another broker"), epoch)
                        return
                    if epoch == w.epoch:
                        frame = w._frames.get(int(headers.get(FRAME, 0)))
                        if frame is not None and not frame.seq:
                            w._stored(frame, seq)
                break
            except Exception as e:
                # the stall as it is now: a PubAck that came meanwhile ended it (issue 56: read once, at the start,
                # a stall a PubAck had ended still refused confirms here, and nothing ever cleared that)
                stalled_since = self.stalled_since
                if stalled_since is not None and time.monotonic() - stalled_since > w.timeout_seconds:
                    self.stall_too_long(f"the replicated log has not answered for {w.timeout_seconds:g} s "
                                         f"({type(e).__name__}: {e})")
                gevent.sleep(RETRY_SECONDS)
        if w.fenced_by is not None or w._stopping:
            return
        # everything not stored goes again, in order, after the tail as it is now
        w._by_token.clear()
        w._in_flight = w._in_flight_bytes = 0

        again = sorted((f for f in w._frames.values() if not f.seq), key=lambda f: f.k)
        w._resent += sum(1 for f in again if f.token)
        w._unsent = deque(again)
        w.tail_seq = last
        self.trouble = None
        if not again and not w._frames and self.stalled_since is not None:
            self.stall_ended("the log answers again")  # an idle owner's: nothing waits to be stored
        log.debug("%s: tail read at sequence %d after %.1f s; %d frames go again", w.nats.label, last,
                  time.monotonic() - started, len(again))
        w.wake()
        if self.stalled_since is not None:  # NATS refused or did not answer: do not spin on it (a read that waited
            gevent.sleep(max(0.0, started + RETRY_SECONDS - time.monotonic()))  # for an election waited enough)
        w._poke()

    def ask_tail(self) -> tuple[int, list[tuple[int, dict[str, str]]]]:
        """The stream's tail after this writer's last stored frame, asked again each TAIL_ASK_AGAIN_SECONDS it goes
        unanswered (TAIL_ASKS in all), the earlier asks still waiting: the first answer is the read's; it fails once
        every ask has."""
        w = self.writer
        tail_after = functools.partial(w.nats.tail_after, base=w._stored_seq, epoch=w.epoch)

        def ask() -> tuple[bool, object]:
            try:
                return True, w.nats.bridge.run(tail_after, timeout=60)
            except Exception as e:
                return False, e

        asks: list[gevent.Greenlet] = []
        try:
            while True:
                if len(asks) < TAIL_ASKS:
                    asks.append(gevent.spawn(ask))
                gevent.wait([a for a in asks if not a.ready()], timeout=TAIL_ASK_AGAIN_SECONDS, count=1)
                answers = [a.value for a in asks if a.ready()]
                for ok, value in answers:
                    if ok:
                        return value
                if len(answers) == len(asks):
                    raise answers[-1][1]
                if w._stopping or w.fenced_by is not None:
                    raise RuntimeError("the writer stops")
        finally:
            gevent.killall([a for a in asks if not a.ready()], block=False)

    def stall_too_long(self, reason: str) -> None:
        """Confirmed publishes are refused, and the commits waiting longer than the timeout are failed.

        A cluster node's owner that has stored nothing for the whole lease steps down: a standby that can reach
        NATS takes the group over now, and this owner's clients must move there."""
        w = self.writer
        if self.stalled_since is None:
            return  # a frame was stored meanwhile: the log takes writes
        if w.lease is not None and w.lease.steps_down(w, reason, time.monotonic() - self.stalled_since):
            return
        if w.blocked is None:
            log.error("%s: %s: confirmed publishes are refused until it answers", w.nats.label, reason)
            w.blocked = "the replicated log does not answer"
        cutoff = time.monotonic() - w.timeout_seconds
        waiting = [*w._commit_times, *((number, at) for number, _, _, _, at in list(w._handed))]
        failed = [number for number, at in waiting if at < cutoff and number > w._failed_up_to]
        if failed:
            w._failed_up_to = failed[-1]
            w._failed.extend(failed)
            w.wake()

    def fenced(self, owner: str, epoch: int) -> None:
        w = self.writer
        log.critical("%s was taken over by %s (epoch %d > %d): this broker stops confirming and exits",
                     w.nats.label, owner, epoch, w.epoch)
        w.stop_with(f"the log was taken over by {owner}")

    def purge(self, below: int) -> None:
        """Remove the frames the stored snapshot starting at `below` replaces. A failed purge is tried again until
        a newer snapshot's purge takes its place: a broker that goes idle writes no next snapshot, and its stream
        would keep every frame it ever wrote."""
        w = self.writer
        pause = PURGE_RETRY_FIRST_SECONDS
        while not w._stopping and w.fenced_by is None and self.purging is gevent.getcurrent():
            try:
                w.nats.bridge.run(functools.partial(w.nats.purge_below, below=below), timeout=60)
            except Exception as e:
                self.purge_failures += 1
                log.warning("%s: purge below %d failed (%s): trying again in %g s", w.nats.label, below,
                            e or type(e).__name__, pause)
                gevent.sleep(pause)
                pause = min(pause * 2, PURGE_RETRY_MAX_SECONDS)
            else:
                self.purges += 1
                return

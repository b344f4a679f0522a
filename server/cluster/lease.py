"""A leased group's owner (the cluster layer), plugged into its log's writer (journal/stream_writer.py
`OwnerLease`): an idle owner's heartbeat every quarter lease (a core NATS message naming the last sequence it
stored; standbys take over after a lease of silence), confirms refused before a standby may take over, a step-down
once the log has stored nothing for the whole lease, and the hand-off frame a planned move ends with. The standby's
side of the heartbeat (heard once its follower has every frame it names) is the reader's (journal/stream_reader.py).
"""

from __future__ import annotations

import logging
import time

import gevent

from ..journal.stream import EPOCH, LAST
from ..journal.stream_writer import Frame, StreamWriter
from ..nats_io.nats_bridge import BridgeError, Hub

log = logging.getLogger("mqks.log")

STEP_DOWN_MARGIN_SECONDS = 2.0  # an owner that stored nothing for lease minus this stops confirming


class Lease:
    """One group's lease as its owner keeps it; `handoff_to` is set by the hub before the log's close()."""

    def __init__(self, lease_seconds: float) -> None:
        self.lease_seconds = lease_seconds
        self.heartbeat_seconds = lease_seconds / 4
        self.handoff_to: str | None = None  # the last frame names that node ("*": any standby, at once)
        self._handoff: Frame | None = None

    def confirm_timeout(self, timeout_seconds: float) -> float:
        """The log's timeout under this lease: confirms stop before a standby may take over."""
        return min(timeout_seconds, self.lease_seconds - STEP_DOWN_MARGIN_SECONDS)

    def beat_due(self, writer: StreamWriter) -> float:
        return writer.last_sent_at + self.heartbeat_seconds

    def idle(self, writer: StreamWriter, hub: Hub, now: float) -> None:
        """An idle owner's heartbeat, once a quarter lease has passed with nothing sent. Nothing is stored (a stored
        heartbeat was an R3 write with fsync every quarter lease per group, kept until the next snapshot) and
        nothing read: a rival is heard as it appends, and a stream leader out of reach shows in the tail check,
        after which the writer is in trouble, sends no heartbeat, and steps down after the lease."""
        if now - writer.last_sent_at < self.heartbeat_seconds:
            return
        writer.last_sent_at = now  # the lease: standbys take over after silence
        try:
            hub.publish(writer.nats.beat_subject, b"", headers={EPOCH: str(writer.epoch), LAST: str(writer.tail_seq)})
        except BridgeError:
            pass  # reconnecting: the next beat goes, or the standbys take over after the lease

    def steps_down(self, writer: StreamWriter, reason: str, stalled_for: float) -> bool:
        """An owner that has stored nothing for the whole lease steps down: a standby that can reach NATS takes the
        group over now, and this owner's clients must move there."""
        if stalled_for <= self.lease_seconds:
            return False
        label = writer.nats.label
        log.error("%s: %s: this node steps down as its owner", label, reason)
        writer.stop_with(f"the replicated log has stored nothing for {self.lease_seconds:g} s: this node "
                         f"stepped down as the owner of {label}")
        return True

    def handing_over(self) -> bool:
        return self.handoff_to is not None

    def handed_over(self, writer: StreamWriter) -> bool:
        return self._handoff is not None and writer.stored_k >= self._handoff.k

    def before_close(self, writer: StreamWriter, deadline: float) -> None:
        """A planned move's last frame, after everything the owner wrote: it names the node that takes over."""
        if self.handoff_to is None:
            return
        self._handoff = writer.add_handoff(self.handoff_to)
        while not self.handed_over(writer) and not writer.writer_done and time.monotonic() < deadline:
            gevent.sleep(0.01)
        log.info("%s: handed over to node %s%s", writer.nats.label, self.handoff_to,
                 "" if self.handed_over(writer) else " (its frame is not stored: it takes over after the lease)")

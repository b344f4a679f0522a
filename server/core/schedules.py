"""Named schedules that publish on an interval or a cron rule (extension).

EventMQ's SCHEDULE/UNSCHEDULE: each firing is an ordinary publish of `{event} {data}` with
msg id `{name}.{n}`. A schedule that missed slots while the broker was down fires once when
it is back, not once per missed slot (NATS's rule). Cron rules are read by `cronsim`, in UTC.
Every change is recorded (`K {name} {json}` with the whole state, `U {name}` when removed),
so schedules and their counts survive a restart. No sockets here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from typing import Any

from cronsim import CronSim, CronSimError

from ..journal import records
from ..wire.protocol import delivery_tail


class BadRule(ValueError):
    """A cron rule cronsim cannot read; the message says why."""


def next_cron_time(rule: str, after: float) -> float:
    """The first time strictly after `after` (Unix seconds) that the five-field rule matches, in UTC."""
    try:
        return next(CronSim(rule, datetime.fromtimestamp(after, UTC))).timestamp()
    except CronSimError as e:
        raise BadRule(f"bad cron rule {rule!r}: {e}") from None
    except StopIteration:
        raise BadRule(f"cron rule {rule!r} never matches") from None


class Schedule:
    __slots__ = ("name", "every", "cron", "count", "nohaste", "event", "data", "fired", "next_due", "cancel_timer")

    def __init__(self, name: bytes, every: float | None, cron: str | None, count: int | None, nohaste: bool,
                 event: bytes, data: bytes, fired: int = 0, next_due: float = 0.0) -> None:
        self.name = name
        self.every = every
        self.cron = cron
        self.count = count  # None: forever
        self.nohaste = nohaste
        self.event = event
        self.data = data
        self.fired = fired
        self.next_due = next_due  # Unix seconds
        self.cancel_timer: Callable[[], None] | None = None

    def due_after(self, now: float, last_due: float | None) -> float:
        """The next firing time: one interval on from the last, or from now if that slot was missed."""
        if self.cron is not None:
            return next_cron_time(self.cron, now)
        assert self.every is not None
        if last_due is None:
            return now + self.every
        due = last_due + self.every
        return due if due > now else now + self.every

    def rule(self) -> str:
        return f"cron {self.cron}" if self.cron is not None else f"every {self.every:g}"

    def record(self) -> bytes:
        state = {"every": self.every, "cron": self.cron, "count": self.count, "nohaste": self.nohaste,
                 "event": self.event.decode(), "data": self.data.decode(), "fired": self.fired,
                 "next_due": self.next_due}
        return records.schedule(self.name, json.dumps(state, separators=(",", ":")).encode())

    def row(self) -> dict[str, Any]:
        return {"name": self.name.decode(), "rule": self.rule(), "next_due": round(self.next_due, 3),
                "fired": self.fired, "count": self.count, "event": self.event.decode(), "data": self.data.decode()}


class Schedules:
    """The process's schedules by name, each with one timer on the heap."""

    def __init__(self, schedule: Callable[[float, Callable[[], None]], Callable[[], None]],
                 publish: Callable[[bytes, bytes, bytes], None], wall: Callable[[], float] = time.time) -> None:
        self.schedule = schedule
        self.publish = publish  # (msg_id, event, tail): to every queue bound to the event
        self.record: Callable[[bytes], None] | None = None  # the journal's append, with --data-dir
        self.wall = wall
        self.by_name: dict[bytes, Schedule] = {}
        self.firings = 0

    def set(self, name: bytes, every: float | None, cron: str | None, count: int | None, nohaste: bool,
            event: bytes, data: bytes) -> Schedule:
        """Create or replace a schedule; it fires at once unless `nohaste`. Raises BadRule for a bad cron rule."""
        now = self.wall()
        new = Schedule(name, every, cron, count, nohaste, event, data)
        first_slot = new.due_after(now, None)  # reads a cron rule: a bad one raises before anything changes
        new.next_due = first_slot if nohaste else now
        self.remove(name, record=False)
        self.by_name[name] = new
        if self.record is not None:
            self.record(new.record())
        self._arm(new)
        return new

    def remove(self, name: bytes, record: bool = True) -> bool:
        found = self.by_name.pop(name, None)
        if found is None:
            return False
        if found.cancel_timer is not None:
            found.cancel_timer()
        if record and self.record is not None:
            self.record(records.schedule_removed(name))
        return True

    def rows(self) -> list[dict[str, Any]]:
        return [self.by_name[name].row() for name in sorted(self.by_name)]

    def restore(self, lines: Iterable[bytes]) -> None:
        """Take back schedules from their last K records; one that came due while down fires at once, once."""
        for line in lines:
            name, state_json = records.decode_schedule(line)
            state = json.loads(state_json)
            found = Schedule(name, state["every"], state["cron"], state["count"], state["nohaste"],
                             state["event"].encode(), state["data"].encode(), state["fired"], state["next_due"])
            self.by_name[name] = found
            self._arm(found)

    def snapshot_lines(self) -> Iterator[bytes]:
        for found in self.by_name.values():
            yield found.record()

    def _arm(self, found: Schedule) -> None:
        found.cancel_timer = self.schedule(max(0.0, found.next_due - self.wall()), lambda: self._fire(found))

    def _fire(self, found: Schedule) -> None:
        if self.by_name.get(found.name) is not found:
            return  # replaced or removed meanwhile
        found.fired += 1
        self.firings += 1
        msg_id = b"%b.%d" % (found.name, found.fired)
        self.publish(msg_id, found.event, delivery_tail(msg_id, found.event, found.data))
        if found.count is not None and found.fired >= found.count:
            self.remove(found.name)
            return
        found.next_due = found.due_after(self.wall(), found.next_due)
        if self.record is not None:
            self.record(found.record())
        self._arm(found)

    def stats(self) -> dict[str, Any]:
        return {"schedules": len(self.by_name), "schedule_firings": self.firings}

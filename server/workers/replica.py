"""The bindings replica: every other worker's queues and their events, so that a publish is sent only to the
workers that own a bound queue.

Each owner sends its binding changes on the links it answers (a `B` frame per change, the whole set when a link
opens; `Z` when it restarted); the replica routes an event to the owners as the broker routes it to its queues
(server/core/routing.py), and caches the answer per event until the next change.
"""

from __future__ import annotations

from ..core.routing import Routing, cache_put
from .frames import NEWLINE


class RemoteQueue:
    """Another worker's queue as the replica knows it: a name, its owner, its events."""

    __slots__ = ("name", "owner", "events")

    def __init__(self, name: bytes, owner: int) -> None:
        self.name = name
        self.owner = owner
        self.events: tuple[bytes, ...] = ()


class Replica:
    """Every other worker's bindings: event or mask -> their queues, and the links a publish must reach."""

    __slots__ = ("routing", "queues", "cache")

    def __init__(self) -> None:
        self.routing = Routing()
        self.queues: dict[bytes, RemoteQueue] = {}
        # event -> owners; cleared on any change, and bounded as the route cache (ids in event names)
        self.cache: dict[bytes, tuple[int, ...]] = {}

    def owners(self, event: bytes) -> tuple[int, ...]:
        owners = self.cache.get(event)
        if owners is None:
            owners = tuple(sorted({queue.owner for queue in self.routing.route(event)}))
            cache_put(self.cache, event, owners)
        return owners

    def update(self, owner: int, payload: bytes) -> None:
        """`{queue} {event}...` lines from `owner`: each queue's whole set of events now (none: unbound)."""
        routing = self.routing
        for line in payload.split(NEWLINE)[:-1]:
            name, *events = line.split(b" ")
            queue = self.queues.get(name)
            if queue is None:
                if not events:
                    continue
                queue = self.queues[name] = RemoteQueue(name, owner)
            for event in queue.events:
                routing.unbind(queue, event)
            queue.events = tuple(events)
            for event in events:
                routing.bind(queue, event)
            if not events:
                del self.queues[name]
        self.cache.clear()

    def forget(self, owner: int) -> None:
        for name, queue in list(self.queues.items()):
            if queue.owner == owner:
                for event in queue.events:
                    self.routing.unbind(queue, event)
                del self.queues[name]
        self.cache.clear()

    def count(self) -> int:
        return len(self.queues)

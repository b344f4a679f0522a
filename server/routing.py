"""Which queues get a copy of an event: an exact-name index plus a mask index, with a cache.

A publish looks its event up in `cache` (one dict hit). On a miss the route is computed
from `queues_by_event` plus the masks with the same number of dots as the event (`*`
never spans a dot, so no other mask can match), then cached. Any bind or unbind that
could change a route invalidates it: exact names pop one entry, masks clear the cache.
"""

from __future__ import annotations

import re
from typing import Any

MAX_CACHED_EVENTS = 65536  # events with ids in their names would otherwise grow it forever


def is_mask(event: bytes) -> bool:
    """A subscription is a mask only if it has a `*` and a dot (the spec's masks need dots)."""
    return b"*" in event and b"." in event


def compile_mask(mask: bytes) -> re.Pattern[bytes]:
    """`user.*.created` -> a pattern where `*` is any run of characters other than a dot."""
    return re.compile(re.escape(mask).replace(rb"\*", rb"[^.]*"))


class Routing:
    """Bindings of one worker: event or mask -> queues, in bind order."""

    __slots__ = ("queues_by_event", "queues_by_mask", "masks_by_dots", "cache", "cache_enabled")

    def __init__(self, cache_enabled: bool = True) -> None:
        self.queues_by_event: dict[bytes, dict[Any, None]] = {}
        self.queues_by_mask: dict[bytes, dict[Any, None]] = {}
        self.masks_by_dots: dict[int, dict[bytes, re.Pattern[bytes]]] = {}
        self.cache: dict[bytes, tuple] = {}
        self.cache_enabled = cache_enabled

    def bind(self, queue: Any, event: bytes) -> None:
        if is_mask(event):
            queues = self.queues_by_mask.get(event)
            if queues is None:
                queues = self.queues_by_mask[event] = {}
                self.masks_by_dots.setdefault(event.count(b"."), {})[event] = compile_mask(event)
            queues[queue] = None
            self.cache.clear()
        else:
            self.queues_by_event.setdefault(event, {})[queue] = None
            self.cache.pop(event, None)

    def unbind(self, queue: Any, event: bytes) -> None:
        if is_mask(event):
            queues = self.queues_by_mask.get(event)
            if queues is None:
                return
            queues.pop(queue, None)
            if not queues:
                del self.queues_by_mask[event]
                masks = self.masks_by_dots[event.count(b".")]
                del masks[event]
                if not masks:
                    del self.masks_by_dots[event.count(b".")]
            self.cache.clear()
        else:
            queues = self.queues_by_event.get(event)
            if queues is None:
                return
            queues.pop(queue, None)
            if not queues:
                del self.queues_by_event[event]
            self.cache.pop(event, None)

    def route(self, event: bytes) -> tuple:
        """Every queue bound to `event` by name or by mask, each once."""
        queues = self.cache.get(event)
        if queues is not None:
            return queues
        found = dict(self.queues_by_event.get(event, ()))
        if b"." in event:
            for mask, pattern in self.masks_by_dots.get(event.count(b"."), {}).items():
                if pattern.fullmatch(event):
                    found.update(self.queues_by_mask[mask])
        queues = tuple(found)
        if self.cache_enabled:
            if len(self.cache) >= MAX_CACHED_EVENTS:
                self.cache.clear()
            self.cache[event] = queues
        return queues

    def subscription_count(self) -> int:
        return len(self.queues_by_event) + len(self.queues_by_mask)

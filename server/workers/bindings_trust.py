"""How long a cluster's group may route by another group's bindings without a link to it, and what the owner of
those bindings promises in return.

A group whose link to another group's owner is lost routes publishes by the bindings that owner last sent, while the
map names the same owner (issue 56: a cut-off node must not stop confirmed publishes to every queue of the cluster).
That is safe only while the owner adds no binding the router has not seen: a queue bound there meanwhile would miss a
publish the router confirms. So the trust is bounded on both sides, lease-style, on each side's own clock:

- the router trusts the lost owner's bindings until `trust_seconds` after it *sent* the last keepalive mark the owner
  answered (`Trusts`);
- the owner refuses bindings that add events ("... try again", which clients retry) while a group without a link here
  may still trust what it had: until `trust_seconds` after the owner answered that group's last mark, and, once it
  takes a group over, for a lease (a router that still trusts the previous owner has not read this one's map entry
  yet, or stops serving within a lease once cut from NATS) (`Promises`). A promise ends early once the group links
  here again, or its owner changes (the process that trusted stopped serving it).

The router's send precedes the owner's answer, so the router's trust always ends before the owner's promise.
Not a cluster: nothing is trusted across a lost link (`trust_seconds` 0) and nothing is promised.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

KEEPALIVES_PER_TRUST = 6  # marks a link sends per trust period: the trust left at a loss is at least 5/6 of it
CLOCK_MARGIN_SECONDS = 1.0  # the owner's promise outlasts the router's trust by this (timers, clock rates)


class Trusts:
    """The router's side: until when each lost owner's bindings may still route a confirmed publish."""

    __slots__ = ("seconds", "until")

    def __init__(self, count: int) -> None:
        self.seconds = 0.0
        self.until = [0.0] * count

    def link_lost(self, worker: int, answered_at: float) -> None:
        self.until[worker] = answered_at + self.seconds

    def expired(self, worker: int) -> bool:
        return time.monotonic() >= self.until[worker]


class Promises:
    """The owner's side: the groups that may still route by this group's bindings without a link here."""

    __slots__ = ("seconds", "lease_seconds", "until", "owner_epoch")

    def __init__(self, owner_epoch: Callable[[int], Any]) -> None:
        self.seconds = 0.0  # the routers' trust; 0: not a cluster
        self.lease_seconds = 0.0
        self.until: dict[int, tuple[float, Any]] = {}  # worker -> (monotonic end, its owner's epoch then)
        self.owner_epoch = owner_epoch

    def link_lost(self, worker: int, answered_at: float) -> None:
        """`worker`'s link here is gone: it trusts what it had until `trust_seconds` after our last answer."""
        if self.seconds:
            self.promise(worker, answered_at + self.seconds + CLOCK_MARGIN_SECONDS)

    def took_over(self, workers: Collection[int]) -> None:
        """This group now has a new owner here: the others may still route by its previous owner's bindings."""
        if self.seconds:
            until = time.monotonic() + self.lease_seconds + CLOCK_MARGIN_SECONDS
            for worker in workers:
                self.promise(worker, until)

    def promise(self, worker: int, until: float) -> None:
        old = self.until.get(worker)
        if old is None or old[0] < until:
            self.until[worker] = (until, self.owner_epoch(worker))

    def waiting_for(self, linked: Collection[int]) -> list[int]:
        """The groups a binding added now could miss: no link here, and their promise still runs."""
        now = time.monotonic()
        waiting = []
        for worker, (until, epoch) in list(self.until.items()):
            if now >= until or worker in linked or self.owner_epoch(worker) != epoch:
                del self.until[worker]
            else:
                waiting.append(worker)
        return sorted(waiting)

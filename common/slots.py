"""Placement: which worker process owns a queue. Read by the broker (server/dispatch/slots.py), the clients
(client/placement.py) and the log's re-sharding, so that all of them place a queue alike.

A queue belongs to slot `crc32(queue) % SLOTS`, and slots map to workers in contiguous
ranges (`slot * workers // SLOTS`), as Redis Cluster's hash slots do. crc32 is stable across
processes and versions (unlike `hash()` of a str), so a queue's owner is known to every
worker, to every client, and to the next start of the broker. A different number of
workers moves whole slot ranges, never a queue away from the slot that names it. Pure: no I/O.
"""

from __future__ import annotations

import zlib

SLOTS = 16384  # a broker's hello names its own in "slots": a client reads the count from there


def slot_of(queue: bytes, slots: int = SLOTS) -> int:
    """The slot of `queue` among `slots` (the broker's SLOTS unless its hello says otherwise)."""
    return zlib.crc32(queue) % slots


def owner_of_slot(slot: int, workers: int) -> int:
    return slot * workers // SLOTS


def owner_of(queue: bytes, workers: int) -> int:
    """The worker that owns `queue` when the broker runs `workers` workers."""
    # slot_of and owner_of_slot inlined: the relay asks this once per line it places
    return zlib.crc32(queue) % SLOTS * workers // SLOTS


def slot_ranges(workers: int) -> list[list[int]]:
    """The slot map as `[first_slot, last_slot, worker]` rows, as `hello` tells clients."""
    return [[-(-worker * SLOTS // workers), -(-(worker + 1) * SLOTS // workers) - 1, worker]
            for worker in range(workers)]

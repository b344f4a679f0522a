"""Placement: which worker process owns a queue. Shared by the server, the client and the log's re-sharding.

A queue belongs to slot `crc32(queue) % SLOTS`, and slots map to workers in contiguous
ranges (`slot * workers // SLOTS`), as Redis Cluster's hash slots do. crc32 is stable across
processes and versions (unlike `hash()` of a str), so a queue's owner is known to every
worker, to every client, and to the next start of the broker. A different number of
workers moves whole slot ranges, never a queue away from the slot that names it.
"""

from __future__ import annotations

import zlib

SLOTS = 16384


def slot_of(queue: bytes) -> int:
    return zlib.crc32(queue) % SLOTS


def owner_of_slot(slot: int, workers: int) -> int:
    return slot * workers // SLOTS


def owner_of(queue: bytes, workers: int) -> int:
    """The worker that owns `queue` when the broker runs `workers` workers."""
    return zlib.crc32(queue) % SLOTS * workers // SLOTS


def slot_ranges(workers: int) -> list[list[int]]:
    """The slot map as `[first_slot, last_slot, worker]` rows, as `hello` tells clients."""
    return [[-(-worker * SLOTS // workers), -(-(worker + 1) * SLOTS // workers) - 1, worker]
            for worker in range(workers)]

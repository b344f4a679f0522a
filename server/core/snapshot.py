"""A broker's whole live state as records (journal/records.py), so a snapshot
can replace the log before it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain
from operator import itemgetter

from ..journal import records
from .messages import Item, Message, Packed, unpack
from .state import Broker, Queue, queue_record


def snapshot_lines(brokers: list[Broker], process_lines: Iterable[bytes] = ()) -> Iterator[bytes]:
    """Every queue of `brokers`, then their parked copies, then `process_lines` (what the process keeps above
    its broker: delayed publishes, schedules)."""
    return chain(state_lines(brokers), *map(parked_lines, brokers), process_lines)


def state_lines(brokers: list[Broker]) -> Iterator[bytes]:
    for broker in brokers:
        leased = broker.leases.held_by_queue() if broker.leases is not None else {}
        for queue in broker.queues.values():
            yield from queue_snapshot_lines(queue, leased.get(queue.name, ()))


def parked_lines(broker: Broker) -> Iterator[bytes]:
    """The copies rejected with --delay, as snapshot records: each message, then when it comes back."""
    for due_ms, entries in broker.parked.items():
        for queue, parked in entries:
            name: bytes = queue.name
            if broker.queues.get(name) is not queue:
                continue
            for record in parked:
                yield records.live(name, record.seq, record.retry, False, record.tail)
            yield records.parked(name, due_ms, parked)


def queue_snapshot_lines(queue: Queue, leased: Iterable[tuple[int, Item]] = ()) -> Iterator[bytes]:
    """A queue's live state as snapshot records: held messages (by consumers or leases) first, then waiting ones."""
    yield queue_record(queue)
    name = queue.name
    yield records.next_seq(name, queue.next_seq)
    held = sorted([*((seq, item) for consumer in queue.consumers for seq, item in consumer.unacked.items()),
                   *leased], key=itemgetter(0))
    for seq, item in held:
        message = item if isinstance(item, Message) else Message(seq, 0, item)
        yield records.live(name, seq, message.retry, True, message.tail)
    first_plain = queue.next_seq - (queue.depth() - queue.requeued)
    for item in queue.items():
        if isinstance(item, Message):
            yield records.live(name, item.seq, item.retry, False, item.tail)
        else:
            for tail in (unpack(item) if type(item) is Packed else (item,)):
                yield records.live(name, first_plain, 0, False, tail)
                first_plain += 1

"""Copies that came back past their queue's `--max-retries` move to
`{queue}.dead`, keeping their event, data and retry counter (extension).

The dead-letter queue may belong to another worker process: then `broker_for` gives a stand-in
(peers.RemoteDeadLetters) whose `send` moves them, and they count as moved only once that worker
has them in its log (a crash between repeats a dead letter, never loses one). An operator's
`requeue_dead` moves them back to their queue the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..journal import records
from .messages import Item, Message, retry_of

if TYPE_CHECKING:
    from .state import Broker, Queue


def divert(broker: Broker, queue: Queue, taken: list[tuple[int, Item]]) -> list[tuple[int, Item]]:
    """Send the copies that would come back past the queue's `max_retries` to its dead letters; the rest."""
    max_retries = queue.max_retries
    if max_retries is None:
        return taken
    dead = [taken_one for taken_one in taken if retry_of(taken_one[1]) >= max_retries]
    if dead:
        move(broker, queue, dead)
        taken = [taken_one for taken_one in taken if retry_of(taken_one[1]) < max_retries]
    return taken


def move(broker: Broker, queue: Queue, taken: list[tuple[int, Item]], raise_retry: bool = True,
         to: bytes | None = None) -> None:
    """Put copies into `{queue}.dead` (created if missing) with their event, data and retry counter.

    `to`: put dead letters taken from `queue` (a `.dead` one) back into the queue named so instead,
    their retry counters at 0 (`requeue_dead`); the same transfer, so the same no-loss rule.
    """
    name = queue.name + b".dead" if to is None else to
    owner = broker.broker_for(name)
    target = owner.queue(name)
    for _, item in taken:
        retry = 0 if to is not None else retry_of(item) + 1 if raise_retry else retry_of(item)
        target.put_record(item.tail if isinstance(item, Message) else item, retry)
    if to is None:
        broker.dead_lettered += len(taken)
    owner.pump(target)
    send = getattr(owner, "send", None)
    if send is None:
        moved(broker, queue, taken)
    else:  # another worker process owns the target queue: moved once it has them (server/workers/forwarding.py)
        send(broker, queue, taken)


def moved(broker: Broker, queue: Queue, taken: list[tuple[int, Item]]) -> None:
    """The copies are in their dead-letter queue: gone from this one.

    Recorded after their E records (a crash between the two repeats a dead letter, never loses
    one); a queue deleted while another worker took them was recorded whole (X).
    """
    if broker.record is not None and broker.queues.get(queue.name) is queue:
        broker.record(records.gone(queue.name, [seq for seq, _ in taken]))

"""The queues replay recovered (journal/recovery.py) put back into their brokers.

Un-acked messages are not lost on a crash: replay finds them delivered and not acked, and they
come back at the front with their retry raised, as a disconnect would.
"""

from __future__ import annotations

from collections.abc import Callable

from ..journal.recovery import Recovered, fields
from .messages import Message
from .state import Broker


def rebuild(recovered: dict[bytes, Recovered], broker_for: Callable[[bytes], Broker]) -> tuple[int, int]:
    """Put recovered queues into their workers; returns (queues, messages).

    Order at the front of each queue: messages that were held un-acked (retry raised, as a
    disconnect would), then requeued ones in the order they went back, then the rest by seq.
    """
    total = 0
    for name, state in recovered.items():
        broker = broker_for(name)
        queue = broker.queue(name)
        record, broker.record = broker.record, None  # the settings and parked copies are in the log already
        broker.rebind(queue, replace=state.events or None)
        queue.delete_when_unused_seconds = state.seconds
        queue.max_retries = state.limits["max_retries"]
        queue.max_length = state.limits["max_length"]
        messages = state.messages
        held = sorted(seq for seq, m in messages.items() if isinstance(m, list) and m[2])
        seen: set[int] = set(held) | state.parked.keys()
        parked_by_due: dict[int, list[Message]] = {}
        for seq, due_ms in sorted(state.parked.items()):
            tail, retry, _ = fields(messages[seq])
            parked_by_due.setdefault(due_ms, []).append(Message(seq, retry, tail))
        for due_ms, parked in parked_by_due.items():
            broker.park(queue, due_ms, parked)
        broker.record = record
        requeued = []
        for seq in state.front:
            if seq in messages and seq not in seen:
                seen.add(seq)
                requeued.append(seq)
        rest = sorted(seq for seq in messages if seq not in seen)
        # the newest never-delivered messages with consecutive seqs and nothing live above them
        # go back as plain tails, packed as a deep queue packs them (records cost ~2.5x the
        # memory); their seq stays implicit, so the queue's next seq follows the last of them
        plain_from = len(rest)
        while plain_from and fields(messages[rest[plain_from - 1]])[1] == 0 and (
                plain_from == len(rest) or rest[plain_from - 1] == rest[plain_from] - 1):
            plain_from -= 1
        if rest and max(held[-1:] + requeued + list(state.parked), default=-1) > rest[-1]:
            plain_from = len(rest)  # a live record above them: keep every seq explicit
        front = []  # explicit records: held (retry raised), requeued, then the rest that keep their seq
        for seq in held:
            tail, retry, _ = fields(messages[seq])
            front.append(Message(seq, retry + 1, tail))
        for seq in requeued + rest[:plain_from]:
            tail, retry, _ = fields(messages[seq])
            front.append(Message(seq, retry, tail))
        plain = [fields(messages[seq])[0] for seq in rest[plain_from:]]
        # the plain tails' seqs are implicit: the queue's next seq follows the last of them
        queue.restore(front, plain, rest[-1] + 1 if plain else max(state.next_seq, queue.next_seq))
        total += len(front) + len(plain)
    for name in recovered:
        # a copy held at the crash came back with retry raised: past max_retries it is a dead letter,
        # moved only now that every queue, its dead-letter queue included, is rebuilt
        broker = broker_for(name)
        queue = broker.queues[name]
        if queue.max_retries is not None:
            broker.limits_changed(queue)
    return len(recovered), total

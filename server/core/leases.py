"""Messages held under a named lease instead of by a consumer.

`fetch` takes messages off the front of a queue and holds them under a lease id that any
connection may later `settle` (ack or release): a Spark executor reads, the driver acks.
A lease belongs to the worker of its queue and holds messages of that queue only. Invariants:
- a lease holds exactly what its last fetch answered (plus `--add` fetches after it): a re-fetch
  under the same id first releases what the lease still held, so an ack never covers messages
  a re-run did not deliver;
- released or expired messages go back to the front of their queue with retry+1, as a reject
  (past the queue's --max-retries, to its dead letters);
- one timer per lease (re-armed by each fetch), never one per message; what `fetch --runs` takes in
  bulk is held as the runs it was taken in (a stored run, or a list of tails, by first seq), unpacked
  only if it comes back;
- with --data-dir, leased messages are journaled as held for an ack (`D`), so a crash
  returns them to their queue. No sockets, no gevent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import chain, islice
from typing import Any, TypeAlias

from ..journal import records
from ..wire.protocol import with_field
from .messages import HEADER_MARK, OK, PACK_TAILS, Item, Message, Packed, unpack
from .state import Broker, Queue

NEWLINE = b"\n"
Run: TypeAlias = "Packed | list[bytes]"  # never-delivered messages held as they were taken: consecutive seqs


class Lease:
    """Messages of one queue held under `lease_id` until settled or expired."""

    __slots__ = ("lease_id", "queue", "held", "runs", "run_count", "cancel_expiry")

    def __init__(self, lease_id: bytes, queue: Queue) -> None:
        self.lease_id = lease_id
        self.queue = queue
        self.held: dict[int, Item] = {}  # seq -> message, in fetch order
        self.runs: list[tuple[int, Run]] = []  # (first seq, run) of what `fetch --runs` took in bulk
        self.run_count = 0  # the messages in runs
        self.cancel_expiry: Callable[[], None] | None = None

    def count(self) -> int:
        return len(self.held) + self.run_count

    def items(self) -> list[tuple[int, Item]]:
        """Every message held, with its seq: those held one by one, then the runs' (unpacked here)."""
        items = list(self.held.items())
        for first, run in self.runs:
            tails = run if isinstance(run, list) else unpack(run)
            items += zip(range(first, first + len(tails)), tails, strict=True)
        return items

    def seqs(self) -> Iterator[int]:
        return chain(self.held, *(range(first, first + run_size(run)) for first, run in self.runs))

    def clear(self) -> None:
        self.held = {}
        self.runs = []
        self.run_count = 0


def run_size(run: Run) -> int:
    """The messages in a run: a stored one always holds PACK_TAILS (messages.py packs exactly that many)."""
    return PACK_TAILS if type(run) is Packed else len(run)


class Block:
    """Messages of one `fetch --runs` answer with consecutive seqs, sent as one length-counted block."""

    __slots__ = ("packed", "first", "count", "pieces", "headers")

    def __init__(self, packed: bool, first: int) -> None:
        self.packed = packed  # stored runs with their header apart (their lines `{msg_id}\\xff{data}`), or tails
        self.first = first
        self.count = 0
        self.pieces: list[bytes | memoryview] = []  # runs' lines (0xff for newlines), or tails
        self.headers: list[list] = []  # packed: [count, header] per stretch of runs that share a header

    def answer(self, prefix: bytes) -> list[bytes | memoryview]:
        """`{prefix} ok --tails|--packed {seq} {count} {bytes}[ {n} {header}...]\\n`, then the block's lines: pieces
        of 100 KiB or so, joined once with the whole answer (a block is megabytes, and each buffer that size is
        fresh pages from the kernel: with four of them a 20,904-message fetch's first byte left 3.2-4.5 ms after
        its line came, with one 0.6-1.7 ms)."""
        if self.packed:
            pieces = self.pieces
            body: list[bytes | memoryview] = [HEADER_MARK] * (2 * len(pieces) - 1)
            body[::2] = pieces
        else:
            body = [NEWLINE.join(self.pieces)]
        body.append(NEWLINE)
        kind = b"--packed" if self.packed else b"--tails"
        headers = b"".join([b" %d %b" % (count, header) for count, header in self.headers])
        size = sum(len(piece) for piece in body)
        return [b"%b ok %b %d %d %d%b\n" % (prefix, kind, self.first, self.count, size, headers), *body]


def take_blocks(queue: Queue, max_count: int, max_bytes: int, first_goes: bool) -> tuple[list[Block], list]:
    """Never-delivered messages off the front (none while a record is in front) as blocks of consecutive seqs, and
    the runs they were taken as, for the lease: (first seq, run) each.

    A stored run with its header apart (messages.pack) that fits whole goes as it is stored, its lines sliced
    out, no work per message (a 20,480-message fetch: 0.21 us of broker CPU a message with the runs unpacked and
    joined with the rid, 0.03 so); the tails between such runs, and a run that does not fit whole (take_tails
    splits it), go in `--tails` blocks. At most `max_count` and `max_bytes`
    (the first message whatever its size when `first_goes`).
    """
    blocks: list[Block] = []
    runs: list[tuple[int, Run]] = []
    messages = queue.messages
    count = size = 0
    while count < max_count and not queue.requeued:
        if not messages:
            if not queue.newest:
                break
            queue.spill()
        front = messages[0]
        left = max_count - count
        if type(front) is Packed:
            if not front.startswith(OK) and left >= PACK_TAILS and size + len(front) <= max_bytes:
                first = queue.next_seq - queue.depth()
                messages.popleft()
                queue.packed_extra -= PACK_TAILS - 1
                at = front.index(NEWLINE)
                block = _block(blocks, True, first)
                # one line, 0xff between every id and data: Arrow splits it once (twice, at newlines and then at
                # each 0xff, cost an executor 0.08 us a row more; this replace costs the broker 0.007)
                block.pieces.append(memoryview(front.replace(NEWLINE, HEADER_MARK))[at + 1 :])
                header = front[:at]
                if block.headers and block.headers[-1][1] == header:
                    block.headers[-1][0] += PACK_TAILS
                else:
                    block.headers.append([PACK_TAILS, header])
                block.count += PACK_TAILS
                runs.append((first, front))
                count += PACK_TAILS
                size += len(front) - at
                continue
            bound = min(left, PACK_TAILS)  # take_tails takes it whole or splits it, and stops at its end
        else:
            bound = left if not queue.packed_extra else _leading_tails(messages, left)
        first, tails, taken_bytes = queue.take_tails(bound, max_bytes - size, first_goes and not count)
        if not tails:
            break
        block = _block(blocks, False, first)
        block.pieces += tails
        block.count += len(tails)
        runs.append((first, tails))
        count += len(tails)
        size += taken_bytes
        if len(tails) < bound:
            break  # the byte limit stopped it, or the queue ran dry
    return blocks, runs


def _block(blocks: list[Block], packed: bool, first: int) -> Block:
    """The last block if it is of that kind (its seqs run on into `first`), else a new one."""
    if blocks and blocks[-1].packed == packed:
        return blocks[-1]
    block = Block(packed, first)
    blocks.append(block)
    return block


def _leading_tails(messages: Any, limit: int) -> int:
    """How many tails lead `messages` before its first stored run, up to `limit`."""
    count = 0
    for item in islice(messages, limit):
        if type(item) is Packed:
            break
        count += 1
    return count


def shown_tail(seq: int, item: Item) -> bytes:
    """The delivery tail with `,seq={n}` after the event (and retry), as `consume --seq` shows it."""
    return with_field(item.delivery_tail() if isinstance(item, Message) else item, b",seq=%d" % seq)


class Leases:
    """The leases of one worker, by id."""

    __slots__ = ("broker", "by_id")

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.by_id: dict[bytes, Lease] = {}

    def fetch(self, queue_name: bytes, lease_id: bytes, max_count: int, max_bytes: int, lease_seconds: float,
              add: bool, prefix: bytes, runs: bool = False) -> tuple[list[bytes | memoryview], int]:
        """Take up to `max_count` messages (and `max_bytes` of them; a lease's first one whatever its size).

        Returns the answer lines (`{prefix}{tail with seq}\\n`) and how many. Without `add`, what
        the lease held goes back to its queue first. The lease's expiry restarts at `lease_seconds`.
        With `runs` (fetch --runs), the messages never delivered before come after the redelivered ones,
        taken in bulk as blocks (take_blocks; docs/protocol.md says their lines).
        """
        broker = self.broker
        lease = self.by_id.get(lease_id)
        if lease is not None and not add:
            self._release(lease)
        queue = broker.queues.get(queue_name)
        if lease is not None and lease.queue is not queue:
            if lease.count():  # --add on another queue: a lease holds one queue's messages only
                self._release(lease)
            lease.queue = queue  # type: ignore[assignment]
        if queue is None:
            if lease is not None:
                self._drop(lease)
            return [], 0
        if lease is None:
            lease = self.by_id[lease_id] = Lease(lease_id, queue)
        lines: list[bytes | memoryview] = []
        held = lease.held
        size = 0
        count = 0
        seqs: list[int] = []
        record = broker.record
        first_goes = not lease.count()
        full = False
        # with runs, one by one only the records in front (redelivered messages: their seqs are their own)
        while count < max_count and (not runs or queue.requeued) and (length := queue.front_size()):
            if (count or not first_goes) and size + length > max_bytes:
                # a lease's first message goes whatever its size, so nothing blocks the queue; an
                # --add fetch for a lease that holds some already stays within its bytes
                full = True
                break
            seq, item = queue.pop()
            held[seq] = item
            lines.append(prefix + shown_tail(seq, item) + NEWLINE)
            size += length
            count += 1
            if record is not None:
                seqs.append(seq)
        if runs and not full and count < max_count:
            blocks, taken = take_blocks(queue, max_count - count, max_bytes - size, first_goes and not count)
            for block in blocks:
                lines += block.answer(prefix)
                count += block.count
                if record is not None:
                    seqs.extend(range(block.first, block.first + block.count))
            lease.runs += taken
            lease.run_count += sum(block.count for block in blocks)
        if seqs and record is not None:
            record(records.delivered(queue.name, seqs))
        broker.consumed += count
        self._arm(lease, lease_seconds)
        return lines, count

    def settle(self, lease_id: bytes, ack: bool) -> int:
        """Ack (or release) what the lease holds now, and forget it; returns how many messages."""
        lease = self.by_id.get(lease_id)
        if lease is None:
            return 0  # expired, settled before, or never fetched: holds nothing
        count = lease.count()
        if ack:
            if count and self._alive(lease):
                record = self.broker.record
                if record is not None:
                    record(records.gone(lease.queue.name, lease.seqs()))
                self.broker.acked += count
            lease.clear()
        else:
            self._release(lease)
        self._drop(lease)
        return count

    def _alive(self, lease: Lease) -> bool:
        return self.broker.queues.get(lease.queue.name) is lease.queue

    def _release(self, lease: Lease) -> None:
        """Every message the lease holds back to the front of its queue, retry+1, then to its consumers."""
        if not lease.count():
            return
        taken = lease.items()
        lease.clear()
        if self._alive(lease):
            broker = self.broker
            broker.rejected += len(taken)
            broker.requeue(lease.queue, taken)  # past the queue's --max-retries: to its dead letters
            broker.pump(lease.queue)

    def _drop(self, lease: Lease) -> None:
        if lease.cancel_expiry is not None:
            lease.cancel_expiry()
            lease.cancel_expiry = None
        if self.by_id.get(lease.lease_id) is lease:
            del self.by_id[lease.lease_id]

    def _arm(self, lease: Lease, seconds: float) -> None:
        if lease.cancel_expiry is not None:
            lease.cancel_expiry()
            lease.cancel_expiry = None
        schedule = self.broker.schedule
        if schedule is None:
            return  # no timers (a bare Broker in unit tests): the lease lasts until settled

        def expire() -> None:
            lease.cancel_expiry = None
            self._release(lease)
            self._drop(lease)

        lease.cancel_expiry = schedule(seconds, expire)

    def held_by_queue(self) -> dict[bytes, list[tuple[int, Item]]]:
        """Every message held under a lease, by queue name (for the snapshot)."""
        held: dict[bytes, list[tuple[int, Item]]] = {}
        for lease in self.by_id.values():
            if lease.count() and self._alive(lease):
                held.setdefault(lease.queue.name, []).extend(lease.items())
        return held

    def count_by_queue(self) -> dict[bytes, int]:
        """How many messages leases hold, by queue name: counted, not copied (`queues` asks at every Spark batch)."""
        counts: dict[bytes, int] = {}
        for lease in self.by_id.values():
            if (count := lease.count()) and self._alive(lease):
                name = lease.queue.name
                counts[name] = counts.get(name, 0) + count
        return counts

    def stats(self) -> dict[str, Any]:
        return {"leases": len(self.by_id), "messages_leased": sum(lease.count() for lease in self.by_id.values())}

"""Replay (server/journal/recovery.py) reads a one-copy publish in place and keeps a message as published as its
bare tail: what it rebuilds must be what the records say, whatever happens to the message after."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mqks.server.journal import records
from mqks.server.journal.recovery import fields, recover, recover_batches

pytestmark = pytest.mark.timeout(10)

TAILS = [b" id=1,event=e body", b" id=2,event=e ", b" id=3,event=e two  spaces  -4 inside"]


def state_of(lines: list[bytes]) -> dict[bytes, dict[int, tuple[bytes, int, bool]]]:
    return {name: {seq: fields(m) for seq, m in q.messages.items()} for name, q in recover(lines).queues.items()}


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("held", [False, True])
@pytest.mark.parametrize("seq", [0, 7, 123456789])
def test_a_one_copy_publish_reads_as_the_general_record_of_one_copy(tail, held, seq):
    one = records.published_one(b"q.a-1", seq, held, tail)
    general = records.published([records.ref(b"q.a-1", seq, held)], tail)
    assert one == general  # the one format both writers use: replay reads it in place
    assert state_of([one]) == {b"q.a-1": {seq: (tail, 0, held)}}
    assert recover([one]).queues[b"q.a-1"].next_seq == seq + 1


def test_copies_of_one_publish_share_its_tail_and_each_keeps_its_seq():
    line = records.published([records.ref(b"a", 3, False), records.ref(b"b", 9, True),
                              records.ref(b"c", 1, False)], TAILS[2])
    assert state_of([line]) == {b"a": {3: (TAILS[2], 0, False)}, b"b": {9: (TAILS[2], 0, True)},
                                b"c": {1: (TAILS[2], 0, False)}}


def test_a_message_kept_as_its_tail_takes_deliveries_requeues_and_parking_after_it():
    lines = [records.published_one(b"q", seq, False, TAILS[0]) for seq in range(5)]
    lines += [records.delivered(b"q", [1, 2, 3]), records.requeued(b"q", [SimpleNamespace(seq=2, retry=4)]),
              records.parked(b"q", 99, [SimpleNamespace(seq=3, retry=1)]), records.gone(b"q", [0])]
    recovered = recover(lines).queues[b"q"]
    assert {seq: fields(m) for seq, m in recovered.messages.items()} == {
        1: (TAILS[0], 0, True), 2: (TAILS[0], 4, False), 3: (TAILS[0], 1, False), 4: (TAILS[0], 0, False)}
    assert recovered.front == [2] and recovered.parked == {3: 99}


def whole_state(recovery) -> tuple:
    """Everything a replay rebuilds, comparable."""
    queues = {name: ({seq: fields(m) for seq, m in q.messages.items()}, q.front, q.parked, q.next_seq, q.events,
                     q.seconds, q.limits) for name, q in recovery.queues.items()}
    return queues, recovery.delayed, recovery.schedules


# a standby's reads: an owner's frames, a snapshot begun in one read and ended in a later one, and a takeover that
# cuts the next snapshot short (its records after SB do not count)
STREAM = [
    records.queue(b"q", None, [b"e"], None, None),
    *[records.published_one(b"q", seq, False, TAILS[seq % 3]) for seq in range(6)],
    records.delivered(b"q", [0, 1]), records.gone(b"q", [0]), records.requeued(b"q", [SimpleNamespace(seq=1, retry=1)]),
    records.delayed(5000, TAILS[0]), records.schedule(b"s", b'{"every": 5}'),
    records.SNAPSHOT_BEGIN, records.queue(b"q", None, [b"e"], None, None),
    records.live(b"q", 1, 1, False, TAILS[1]), records.live(b"q", 4, 0, False, TAILS[1]), records.next_seq(b"q", 6),
    records.SNAPSHOT_END,
    *[records.published_one(b"r", seq, seq == 2, TAILS[0]) for seq in range(4)], records.delivered(b"r", [1]),
    records.SNAPSHOT_BEGIN, records.queue(b"r", None, [b"e"], None, None),
    records.takeover(2, b"node b"),
    records.published_one(b"q", 6, False, TAILS[2]), records.parked(b"q", 99, [SimpleNamespace(seq=4, retry=2)]),
]


@pytest.mark.parametrize("size", [1, 2, 3, 5, len(STREAM)])
def test_batches_replay_as_their_records_one_after_the_other(size):
    batches = [STREAM[i:i + size] for i in range(0, len(STREAM), size)]
    batches.insert(1, [])  # a read of a heartbeat alone: no records
    expected = whole_state(recover(STREAM))
    assert expected[0][b"q"][0] == {1: (TAILS[1], 1, False), 4: (TAILS[1], 2, False), 6: (TAILS[2], 0, False)}
    assert set(expected[0]) == {b"q", b"r"} and expected[0][b"r"][0][2] == (TAILS[0], 0, True)
    assert whole_state(recover_batches(iter(batches))) == expected


def test_a_log_that_ends_inside_a_snapshot_read_in_batches_is_the_state_before_it():
    cut = STREAM.index(records.SNAPSHOT_END)
    batches = [STREAM[:cut - 2], STREAM[cut - 2:cut]]  # SB in the first read, its end never stored
    assert whole_state(recover_batches(batches)) == whole_state(recover(STREAM[:STREAM.index(records.SNAPSHOT_BEGIN)]))

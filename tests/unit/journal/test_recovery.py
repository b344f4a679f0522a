"""Replay (server/journal/recovery.py) reads a one-copy publish in place and keeps a message as published as its
bare tail: what it rebuilds must be what the records say, whatever happens to the message after."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mqks.server.journal import records
from mqks.server.journal.recovery import fields, recover

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

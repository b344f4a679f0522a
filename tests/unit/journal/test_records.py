"""Every record kind of the write-ahead log (server/journal/records.py) round-trips through its encode and decode,
including the shapes that trip a parser: a tail with spaces, an empty body, a queue held at once, many copies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mqks.server.journal import records

pytestmark = pytest.mark.timeout(10)

TAILS = [b" id=1,event=e body", b" id=2,event=e ", b" id=3,event=e two  spaces  inside", b" id=4,event=e -1 -2"]


def msg(seq: int, retry: int) -> SimpleNamespace:
    return SimpleNamespace(seq=seq, retry=retry)


@pytest.mark.parametrize("seconds", [None, 0.5, 30.0])
@pytest.mark.parametrize("limits", [(None, None), (3, None), (None, 1000), (0, 1)])
def test_a_queue_record_round_trips_its_events_and_settings(seconds, limits):
    events = [b"orders.*", b"audit", b"a.b.c"]
    line = records.queue(b"q1", seconds, events, *limits)
    assert line[:1] == records.QUEUE
    assert records.decode_queue(line) == (b"q1", seconds, events,
                                          {"max_retries": limits[0], "max_length": limits[1]})


def test_a_queue_with_no_events_and_a_deleted_queue_round_trip():
    assert records.decode_queue(records.queue(b"q", None, [], None, None)) == (
        b"q", None, [], {"max_retries": None, "max_length": None})
    line = records.queue_deleted(b"q-9")
    assert line[:1] == records.QUEUE_DELETED and records.decode_queue_deleted(line) == b"q-9"


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("copies", [[(b"q", 1, False)], [(b"q", 7, True)],
                                    [(b"a", 1, False), (b"b", 2, True), (b"c", 30, False)],
                                    [(b"q%d" % i, i, i % 2 == 0) for i in range(50)]])
def test_a_publish_round_trips_every_copy_and_its_tail_written_once(copies, tail):
    line = records.published([records.ref(name, seq, held) for name, seq, held in copies], tail)
    assert line.count(tail) == 1
    assert records.decode_published(line) == (copies, tail)
    if len(copies) == 1:  # the one-copy path writes the same bytes
        assert records.published_one(*copies[0], tail) == line


@pytest.mark.parametrize("encode, kind", [(records.delivered, records.DELIVERED), (records.gone, records.GONE)])
def test_held_and_gone_round_trip_their_seqs(encode, kind):
    line = encode(b"q", [1, 2, 300])
    assert line[:1] == kind and records.decode_seqs(line) == (b"q", [1, 2, 300])
    held = records.delivered_one(b"q", 5, True)
    assert held[:1] == records.DELIVERED and records.decode_seqs(held) == (b"q", [5])
    gone = records.delivered_one(b"q", 5, False)
    assert gone[:1] == records.GONE and records.decode_seqs(gone) == (b"q", [5])


def test_requeued_and_parked_round_trip_absolute_retry_counts():
    pairs = [(1, 0), (2, 5), (40, 1)]
    line = records.requeued(b"q", [msg(*pair) for pair in pairs])
    assert line[:1] == records.REQUEUED and records.decode_requeued(line) == (b"q", pairs)
    line = records.parked(b"q", 1_800_000_000_123, [msg(*pair) for pair in pairs])
    assert line[:1] == records.PARKED and records.decode_parked(line) == (b"q", 1_800_000_000_123, pairs)


@pytest.mark.parametrize("tail", TAILS)
def test_delayed_publishes_and_dead_letters_keep_their_tail(tail):
    line = records.delayed(1_800_000_000_000, tail)
    assert line[:1] == records.DELAYED and records.decode_delayed(line) == (1_800_000_000_000, tail)
    line = records.delayed_fired(1_800_000_000_000)
    assert line[:1] == records.DELAYED_FIRED and records.decode_delayed_fired(line) == 1_800_000_000_000
    line = records.dead_letter(b"dead", 12, 3, tail)
    assert line[:1] == records.DEAD_LETTER and records.decode_dead_letter(line) == (b"dead", 12, 3, tail)


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("held", [False, True])
def test_a_snapshots_records_round_trip(tail, held):
    line = records.next_seq(b"q", 1234)
    assert line[:1] == records.NEXT_SEQ and records.decode_next_seq(line) == (b"q", 1234)
    line = records.live(b"q", 9, 2, held, tail)
    assert line[:1] == records.LIVE and records.decode_live(line) == (b"q", 9, 2, held, tail)


def test_schedules_round_trip_their_json():
    state = b'{"event": "tick", "every": 5, "count": null, "next": 1800000000000}'
    line = records.schedule(b"nightly", state)
    assert line[:1] == records.SCHEDULE and records.decode_schedule(line) == (b"nightly", state)
    line = records.schedule_removed(b"nightly")
    assert line[:1] == records.SCHEDULE_REMOVED and records.decode_schedule_removed(line) == b"nightly"


def test_a_takeover_round_trips_its_epoch_and_an_owner_with_spaces():
    line = records.takeover(7, b"node-a:25000 pid 4242")
    assert line == b"W 7 node-a:25000 pid 4242"  # what a standby's replayer and the stream's other readers read
    assert line[:1] == records.WRITER and records.decode_takeover(line) == (7, b"node-a:25000 pid 4242")


def test_no_record_holds_a_newline_and_each_kind_is_its_first_byte():
    """The log splits records on newlines and dispatches on the first byte: both must hold for every kind."""
    made = [records.queue(b"q", None, [b"e"], 1, 2), records.queue_deleted(b"q"),
            records.published([records.ref(b"q", 1, False)], TAILS[0]), records.delivered(b"q", [1]),
            records.gone(b"q", [1]), records.requeued(b"q", [msg(1, 1)]), records.parked(b"q", 5, [msg(1, 1)]),
            records.delayed(5, TAILS[0]), records.delayed_fired(5), records.schedule(b"s", b"{}"),
            records.schedule_removed(b"s"), records.dead_letter(b"q", 1, 1, TAILS[0]), records.next_seq(b"q", 1),
            records.live(b"q", 1, 0, False, TAILS[0]), records.takeover(1, b"node a")]
    kinds = [records.QUEUE, records.QUEUE_DELETED, records.PUBLISHED, records.DELIVERED, records.GONE,
             records.REQUEUED, records.PARKED, records.DELAYED, records.DELAYED_FIRED, records.SCHEDULE,
             records.SCHEDULE_REMOVED, records.DEAD_LETTER, records.NEXT_SEQ, records.LIVE, records.WRITER]
    assert [line[:1] for line in made] == kinds
    assert not [line for line in made if b"\n" in line]
    assert len(set(kinds)) == len(kinds)

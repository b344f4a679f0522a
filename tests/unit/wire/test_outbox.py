"""The outbox (server/wire/outbox.py): a delivery is two pieces, its newline going out with the next piece, and
whatever is read through `pieces()` is whole lines, in order, however deliveries, replies and relayed blocks
interleave."""

from __future__ import annotations

import pytest

from mqks.server.wire.outbox import Outbox

pytestmark = pytest.mark.timeout(10)


def deliver(outbox: Outbox, consumer_id: bytes, tail: bytes) -> None:
    outbox.deliver(consumer_id, b"\n" + consumer_id, tail, len(consumer_id) + len(tail) + 1)


def test_deliveries_replies_and_relayed_blocks_come_out_as_whole_lines_in_order():
    outbox = Outbox([])
    deliver(outbox, b"c1", b" ok m1 event=e one")
    deliver(outbox, b"c2", b" ok m2 event=e two")
    outbox.write(b"p ok \n")
    deliver(outbox, b"c1", b" ok m3 event=e three")
    outbox.take(b"c9 ok m4 event=e relayed\n")
    deliver(outbox, b"c1", b" ok m5 event=e ")
    assert b"".join(outbox.pieces()) == (b"c1 ok m1 event=e one\nc2 ok m2 event=e two\np ok \n"
                                         b"c1 ok m3 event=e three\nc9 ok m4 event=e relayed\nc1 ok m5 event=e \n")


def test_a_run_of_deliveries_is_two_pieces_each_and_one_newline_at_the_end():
    outbox = Outbox([])
    for n in range(100):
        deliver(outbox, b"c1", b" ok m%d event=e d" % n)
    assert len(outbox.out) == 200
    pieces = outbox.pieces()
    assert len(pieces) == 201 and b"".join(pieces).count(b"\n") == 100
    assert outbox.pieces() is pieces and len(pieces) == 201  # asked again: nothing added twice


def test_the_bytes_owed_count_each_delivery_with_its_newline_and_a_flush_is_asked_once():
    pending: list[Outbox] = []
    outbox = Outbox(pending)
    deliver(outbox, b"c1", b" ok m1 event=e one")
    deliver(outbox, b"c1", b" ok m2 event=e two")
    assert outbox.out_bytes == len(b"".join(outbox.pieces())) and pending == [outbox]


def test_a_discarded_outbox_starts_its_next_delivery_as_a_new_line():
    outbox = Outbox([])
    deliver(outbox, b"c1", b" ok m1 event=e one")
    outbox.discard()
    deliver(outbox, b"c1", b" ok m2 event=e two")
    assert b"".join(outbox.pieces()) == b"c1 ok m2 event=e two\n"

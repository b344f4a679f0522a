"""The links' reads of one turn of the loop share one flush (server/workers/peers.py TurnFlush): the answers two
owners relayed in the same turn reach their client in one write, not a write per link read. The Process, Peers, the
links and the client's Outbox are the real ones; only the links' other ends are this file's."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import gevent
import pytest
from gevent.event import Event

from mqks.server.dispatch.process import Process
from mqks.server.wire.outbox import Outbox
from mqks.server.workers.frames import Frame
from mqks.server.workers.links import PeerLink
from mqks.server.workers.peers import Peers, TurnFlush
from mqks.server.workers.relay import RelaySession

pytestmark = pytest.mark.timeout(10)


def test_two_owners_answers_read_in_one_turn_reach_the_client_in_one_write(tmp_path):
    process = Process(worker=0, worker_count=3)
    peers = Peers(process, str(tmp_path))
    writes: list[bytes] = []
    flushed = Event()

    def flush() -> None:
        writes.append(b"".join(bytes(piece) for piece in outbox.pieces()))
        outbox.pieces().clear()
        outbox.out_bytes = 0
        flushed.set()

    outbox = Outbox(process.pending, 1 << 20, flush)
    connection = SimpleNamespace(closed=False, outbox=outbox, max_output_bytes=1 << 20, close_unread=lambda: None)
    key = RelaySession(connection, peers).peer_key()  # type: ignore[arg-type]
    pairs = [socket.socketpair() for _ in (1, 2)]
    readers = []
    try:
        for owner, (ours, theirs) in enumerate(pairs, start=1):
            answer = b"p%d ok \n" % owner
            theirs.sendall(b"%c%b %d\n%b" % (Frame.OUTPUT, key, len(answer), answer))
            link = peers.links[owner] = PeerLink(gevent.socket.socket(fileno=ours.detach()), peers, owner)
            readers.append(gevent.spawn(link.read_loop))
        assert flushed.wait(5), "the answers were never flushed"
        assert writes == [b"p1 ok \np2 ok \n"]  # a flush per read wrote b"p1 ok \n" alone first
    finally:
        gevent.killall(readers)
        peers.turn_flush.stop()
        for _, theirs in pairs:
            theirs.close()


def test_a_turn_flush_owed_many_times_in_a_turn_flushes_once_after_them_and_again_in_a_later_turn():
    flushes: list[int] = []
    owed = [0]
    turn = TurnFlush(lambda: flushes.append(owed[0]))
    try:
        for _ in range(3):
            owed[0] += 1
            turn.owe()
        assert flushes == []  # not before this greenlet yields
        gevent.sleep(0)
        assert flushes == [3]
        owed[0] += 1
        turn.owe()
        gevent.sleep(0)
        assert flushes == [3, 4]
    finally:
        turn.stop()

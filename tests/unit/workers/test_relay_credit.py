"""A client's worker credits an owner's relayed output (server/workers/relay.py RelaySession.give_credit) once it owes
a quarter of the relay window, not after every batch: the owner pauses only with a whole window uncredited, so it
never waits on a credit held back, and a batch of answers costs no W frame back. The Process, Peers, the link and
the client's Outbox are the real ones; only the link socket's other end is this file's."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from mqks.server.dispatch.process import Process
from mqks.server.wire.outbox import Outbox
from mqks.server.workers.frames import Frame, FrameReader
from mqks.server.workers.links import PeerLink
from mqks.server.workers.peers import Peers
from mqks.server.workers.relay import CREDIT_SHARE, RelaySession

pytestmark = pytest.mark.timeout(10)

WINDOW = 4000


@pytest.fixture
def link_pair():
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    yield ours, theirs
    ours.close()
    theirs.close()


def credits_sent(link: PeerLink, theirs: socket.socket) -> list[tuple[bytes, int]]:
    """The W frames the owner's end reads once the link is flushed: (session key, bytes credited)."""
    link.flush()
    try:
        data = theirs.recv(1 << 16)
    except BlockingIOError:
        return []
    return [(key, int(payload)) for kind, key, payload in FrameReader().feed(data) if kind == Frame.CREDIT]


def test_an_owner_is_credited_once_a_quarter_of_the_window_is_owed_and_then_all_of_it(tmp_path, link_pair):
    process = Process(worker=0, worker_count=3)
    peers = Peers(process, str(tmp_path), relay_window=WINDOW)
    link = peers.links[1] = PeerLink(link_pair[0], peers, 1)
    connection = SimpleNamespace(closed=False, outbox=Outbox(process.pending, 1 << 20, lambda: None),
                                 max_output_bytes=1 << 20, close_unread=lambda: None)
    session = RelaySession(connection, peers)  # type: ignore[arg-type]
    key = session.peer_key()
    answers = b"p1 ok \n" * 50  # a batch of confirms relayed back: 350 bytes
    owed = 0
    while owed + len(answers) < WINDOW // CREDIT_SHARE:
        session.take(answers, 1)
        owed += len(answers)
        session.give_credit()  # the client read it all
        assert credits_sent(link, link_pair[1]) == []  # a W per batch was a frame per batch of answers
    session.take(answers, 1)
    session.take(b"x" * 10, 2)  # another owner's bytes: owed too, below its share
    session.give_credit()
    assert credits_sent(link, link_pair[1]) == [(key, owed + len(answers))]
    assert session.owed_credit == {2: 10}
    session.give_credit()
    assert credits_sent(link, link_pair[1]) == []  # nothing owed to worker 1 any more

"""A link between cluster nodes is TLS (issue 42). When the link ends under its reader (its peer's group moved and
`Peers.readdress` shuts it, from another greenlet), the reader and the writer see a lost link and return, so
`Peers.keep_linked` dials the new owner. A TLS socket shut under its reader raised ValueError instead, which
ended the linking for good: node A never reached the group again (CI, test_cluster_tls under load)."""

from __future__ import annotations

import gevent
import gevent.socket
import pytest
from gevent import ssl as gevent_ssl
from tls_certs import Certs

from mqks.server.dispatch.process import Process
from mqks.server.edges.sessions import link_tls_contexts
from mqks.server.workers.links import PeerLink
from mqks.server.workers.peers import Peers

pytestmark = pytest.mark.timeout(30)


def tls_pair(certs: Certs) -> tuple[gevent_ssl.SSLSocket, gevent_ssl.SSLSocket]:
    """Both ends of a socket pair after the mutual TLS handshake of two nodes' link (the nodes' own contexts)."""
    accepting, dialling = link_tls_contexts(certs.server_cert, certs.server_key, certs.ca)
    dialling.check_hostname = False  # a socket pair has no host to check
    ours, theirs = gevent.socket.socketpair()
    asker = dialling.wrap_socket(ours, do_handshake_on_connect=False)
    owner = accepting.wrap_socket(theirs, server_side=True, do_handshake_on_connect=False)
    gevent.joinall([gevent.spawn(asker.do_handshake), gevent.spawn(owner.do_handshake)], timeout=10,
                   raise_error=True)
    return asker, owner


def test_a_tls_link_shut_under_its_reader_and_writer_is_lost_not_crashed(tmp_path, certs: Certs):
    """The reader fails only when the shut comes while bytes arrive (about two rounds in five on this machine):
    the owner streams frames, and the link is shut at a different moment in each of 40 rounds."""
    failures = []
    for round_no in range(40):
        process = Process(worker=0, worker_count=2)
        peers = Peers(process, str(tmp_path))
        process.link(peers)
        asker, owner = tls_pair(certs)
        try:
            link = PeerLink(asker, peers, 1)
            reader = gevent.spawn(link.read_loop)
            writer = gevent.spawn(link.write_loop)
            streaming = gevent.spawn(stream_frames, owner)
            gevent.sleep(round_no * 0.00025)
            link.lost("its owner moved")  # what Peers.readdress does when the map names a new owner
            gevent.joinall([reader, writer], timeout=10)
            streaming.kill()
            assert reader.dead and writer.dead
            failures += [repr(greenlet.exception) for greenlet in (reader, writer) if greenlet.exception]
            assert link.closed and peers.links[1] is None
        finally:
            asker.close()
            owner.close()
    assert failures == []


def stream_frames(sock: gevent_ssl.SSLSocket) -> None:
    """Frames the asker's reader takes (the owner forgetting its bindings), as fast as they go, until shut."""
    try:
        while True:
            sock.sendall(b"Z- 0\n" * 10)
            gevent.sleep(0)
    except OSError:
        pass

"""The links between workers (server/workers/links.py, forwarding.py, peers.py), in process over a socket pair: each
side handles every kind of frame the other sends, a confirmed publish forwarded to this worker is answered on the
link's confirms under its fan-in id, and a worker that goes before it answered fails its fan-ins, not the client's
wait. The Process, Peers, links and outboxes are the real ones; only the socket's other end is this file's."""

from __future__ import annotations

import socket
import time
from collections import deque

import pytest

from mqks.server.dispatch.process import Process
from mqks.server.wire.outbox import Outbox
from mqks.server.workers.forwarding import FanIn
from mqks.server.workers.frames import Frame
from mqks.server.workers.links import IncomingLink, PeerLink
from mqks.server.workers.peers import Peers
from mqks.server.workers.relay import RelaySession

from ..dispatch.test_dispatch import Session  # a client as a handler sees it, over a real Process and Outbox

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
def peers(tmp_path):
    process = Process(worker=0, worker_count=2)
    peers = Peers(process, str(tmp_path))
    process.link(peers)
    return peers


@pytest.fixture
def pair():
    ours, theirs = socket.socketpair()
    yield ours, theirs
    ours.close()
    theirs.close()


def written(outbox: Outbox) -> bytes:
    return b"".join(bytes(piece) for piece in outbox.pieces())


def test_each_side_of_a_link_handles_every_kind_the_other_side_sends(peers, pair):
    asker_reads = set(PeerLink(pair[0], peers, 1).frame_handlers())
    owner_reads = set(IncomingLink(pair[1], peers, 1).frame_handlers())
    assert asker_reads | owner_reads == set(Frame)
    assert not asker_reads & owner_reads  # a kind goes one way only


def test_a_forwarded_confirmed_publish_is_answered_under_its_fan_in_id(peers, pair):
    broker = peers.process.broker
    broker.rebind(broker.queue(b"q"), [b"e"])
    full = broker.queue(b"full")
    broker.rebind(full, [b"e"])
    link = IncomingLink(pair[1], peers, 1)
    link.on_confirmed(b"-", b"7 e ok m1 event=e data\n")
    assert written(link.confirms) == b"7 ok \n"  # in memory: at once
    assert broker.queues[b"q"].depth() == 1 and broker.published == 0  # counted by the client's worker
    full.max_length = 1
    link.confirms.discard()
    link.on_confirmed(b"-", b"8 e ok m2 event=e data\n")
    answer = written(link.confirms)
    assert answer.startswith(b"8 error ") and b"queue full is full (--max-length=1)" in answer
    assert broker.queues[b"q"].depth() == 2  # every other bound queue has it


def test_a_worker_lost_before_it_answered_fails_the_fan_in_with_its_number(peers, pair):
    client = Outbox(peers.process.pending)
    fanin = FanIn(client, b"p1", 2, [1])
    peers.fanins[b"1"] = fanin
    link = PeerLink(pair[0], peers, 1)
    fanin.write(b"p1 ok \n")  # this worker's part
    assert written(client) == b""
    peers.link_lost(link, "closed by the peer")
    assert written(client).startswith(b"p1 error ") and b"worker 1 stopped before it had the message" in written(client)
    assert peers.fanins == {}


def test_a_cluster_links_tcp_socket_fails_within_seconds_once_its_peers_host_stops_answering():
    """Issue 56: a link to a host cut off by a partition kept forwarded confirmed publishes waiting for minutes."""
    import socket

    from mqks.server.workers.links import DEAD_PEER_SECONDS, notice_dead_peer

    with socket.socket() as tcp, socket.socket(socket.AF_UNIX) as unix:
        notice_dead_peer(tcp)
        notice_dead_peer(unix)  # a Unix socket's peer is on this host: nothing to set, nothing raised
        assert tcp.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            assert tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == DEAD_PEER_SECONDS * 1000
            idle = tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
            probes = tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)
            interval = tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
            assert idle + probes * interval <= DEAD_PEER_SECONDS


def test_a_group_whose_link_is_lost_is_routed_to_by_its_owners_last_bindings_until_the_map_names_a_new_owner(
        tmp_path, pair):
    """Issue 56: with a cut-off node's links lost, every confirmed publish of the cluster was refused until its groups
    had new owners. Now, while the map still names the owner whose bindings this worker has, only a publish that
    needs it fails (its part: the client tries again). A new owner's clients may bind before it links here (CI lost
    confirmed publishes when that was not watched): from the map's new epoch on, nothing is confirmed until its
    bindings come. Outside a cluster (no epochs), a lost link's bindings are never trusted."""
    from mqks.server.dispatch.actions import run_lines

    process = Process(worker=0, worker_count=3)
    peers = Peers(process, str(tmp_path))
    process.link(peers)
    epochs = {1: 4, 2: 7}  # the map: each group's owner epoch
    broker = process.broker
    broker.rebind(broker.queue(b"ours"), [b"mine"])

    def publish(*lines: bytes) -> tuple[Session, bytes]:
        session = Session(process)
        run_lines(session, list(lines), deque())
        return session, written(session.outbox)

    session, _ = publish(b"1 publish --confirm mine x")
    assert session.errors and "not linked here" in session.errors[0][1]  # nothing known of groups 1 and 2

    links = {}
    for worker, events in ((1, b"q1 theirs"), (2, b"q2 gone")):
        links[worker] = PeerLink(pair[0], peers, worker)
        links[worker].owner_epoch = epochs[worker]
        links[worker].answered_at = time.monotonic()  # as dialled: the bindings answer the hello
        links[worker].on_forget_bindings(b"-", b"")
        links[worker].on_bindings(b"-", events + b"\n")
    assert peers.unlinked == 0
    peers.trusts.seconds = 60.0  # as a cluster's group sets it (a few leases), counted from the last answered mark
    links[2].lost("cut off")  # its host is cut off: its owner's bindings as it last sent them stay
    assert peers.routing_unknown()  # not a cluster yet: never trusted
    peers.owner_epoch = epochs.get
    assert peers.unlinked == 1 and not peers.routing_unknown()
    _, answers = publish(b"2 publish --confirm mine x", b"3 publish --confirm gone y")
    assert b"2 ok" in answers and broker.queues[b"ours"].depth() == 1  # the first was refused: nothing was put
    assert b"3 error" in answers and b"worker 2, which owns a bound queue" in answers  # the lost group's part
    peers.trusts.until[2] = time.monotonic() - 1  # the trust ran out before a new owner was read
    session, _ = publish(b"3a publish --confirm mine x")
    assert session.errors and "worker 2 is not linked here" in session.errors[0][1]
    peers.trusts.until[2] = time.monotonic() + 60

    epochs[2] = 8  # a new owner took group 2 over: its clients may have bound queues this worker does not know
    session, _ = publish(b"4 publish --confirm mine x")
    assert session.errors and "worker 2 is not linked here" in session.errors[0][1]
    replaced = PeerLink(pair[0], peers, 2)
    replaced.owner_epoch = 8
    replaced.on_forget_bindings(b"-", b"")
    replaced.on_bindings(b"-", b"q2 gone\n")  # the new owner's bindings: linked, and known at its epoch
    assert peers.unlinked == 0 and peers.bindings_epoch[2] == 8
    links[1].lost("cut off")
    assert not peers.routing_unknown()


def test_a_clients_confirmed_publishes_to_one_owner_go_in_its_sessions_run_in_order_and_a_sync_mark_ends_the_run(
        peers, pair):
    """Pipelined lines of one session join the run open on the link (Forwarder.publish_confirmed's short way); another
    session's line opens its own run, and once a ping's sync mark went, the next line makes the owner owed a mark
    again (a later ping waits for it)."""
    link = PeerLink(pair[0], peers, 1)
    peers.links[1] = link
    peers.replica.update(1, b"q e\n")  # worker 1 owns the only queue bound to e
    forwarder = peers.process.forwarder
    first, second = Session(peers.process), Session(peers.process)
    first.relay, second.relay = RelaySession(first, peers), RelaySession(second, peers)

    def publish(session: Session, rid: bytes) -> None:
        assert forwarder.routes_elsewhere(b"e")
        forwarder.publish_confirmed(session, rid, b"e", b" ok %b event=e data" % rid)

    publish(first, b"p0")
    publish(first, b"p1")
    publish(second, b"p2")
    publish(first, b"p3")
    assert first.relay.remote == first.relay.unsynced == {1}
    assert first.relay.mark_other_workers()
    assert first.relay.unsynced == set()
    publish(first, b"p4")
    assert first.relay.unsynced == {1}
    link.flush()
    one, two = first.relay.key, second.relay.key

    def run(key: bytes, *rids: bytes) -> bytes:
        payload = b"".join(b"%b publish --confirm e data\n" % rid for rid in rids)
        return b"S%b %d\n%b" % (key, len(payload), payload)

    expected = (run(one, b"p0", b"p1") + run(two, b"p2") + run(one, b"p3") + b"M%b 0\n" % one + run(one, b"p4"))
    assert pair[1].recv(1 << 16) == expected


def test_an_owner_refuses_new_bindings_while_a_group_without_a_link_here_may_route_by_its_old_ones(tmp_path):
    """A router that lost its link confirms publishes by the bindings it had (for a few leases: above); a queue bound
    here meanwhile would miss them, so this owner refuses an added event ("try again": clients retry) until the
    router links again, its group's owner changes, or the promise runs out. Taking a group over promises a lease to
    every group not linked yet (they may still route by the previous owner's bindings)."""
    import gevent
    import gevent.socket

    from mqks.server.wire.protocol import ProtocolError

    process = Process(worker=0, worker_count=3)
    peers = Peers(process, str(tmp_path))
    process.link(peers)
    epochs = {1: 4, 2: 7}
    peers.owner_epoch = epochs.get
    peers.promises.seconds = 60.0
    broker = process.broker
    queue = broker.queue(b"q")
    assert broker.rebind(queue, [b"a"])  # nothing promised: bound at once
    ours, theirs = gevent.socket.socketpair()
    link = IncomingLink(ours, peers, 1)
    peers.incoming.add(link)
    served = gevent.spawn(link.serve)
    theirs.close()  # group 1's link here is lost
    served.join(5)
    assert served.dead and link not in peers.incoming
    with pytest.raises(ProtocolError, match=r"worker 1 may still route publishes .* try again$"):
        broker.rebind(queue, add=[b"b"])
    assert list(queue.events) == [b"a"]  # refused before anything changed
    from mqks.server.dispatch.actions import run_lines

    new = next(b"new%d" % i for i in range(100) if peers.owner(b"new%d" % i) == 0)
    for line in (b"c consume --confirm %b e" % new, b"r rebind --confirm %b e" % new):
        session = Session(process)
        run_lines(session, [line], deque())
        assert [reason for _, reason in session.errors] == [peers.binding_refusal()]
        assert new not in broker.queues  # a refused line leaves no empty queue behind
    assert broker.rebind(queue, remove=[b"a"])  # an event removed misses nothing
    epochs[1] = 5  # group 1 has a new owner: the process that trusted our bindings no longer serves it
    assert broker.rebind(queue, add=[b"b"])

    peers.promises.lease_seconds = 30.0
    peers.promises.took_over([1, 2])
    with pytest.raises(ProtocolError, match=r"worker 1, 2 may still route"):
        broker.rebind(queue, add=[b"c"])
    again, other_end = gevent.socket.socketpair()
    try:
        peers.incoming.add(IncomingLink(again, peers, 1))  # group 1 linked here: it has our bindings, and acks changes
        with pytest.raises(ProtocolError, match=r"worker 2 may still route"):
            broker.rebind(queue, add=[b"c"])
        peers.promises.until[2] = (time.monotonic() - 1, 7)  # its promise ran out
        assert broker.rebind(queue, add=[b"c"]) and peers.promises.until == {}
    finally:
        again.close()
        other_end.close()


def test_a_dial_to_an_owners_old_address_is_given_up_once_the_map_names_another(tmp_path):
    """A link to a host cut off is lost, and its keeper dials the owner's address again: a connect that waits out
    its timeout (5 s). The map then names a new owner: the dial under way is given up and the new one dialled at
    once (the partition bench's routers linked to new owners up to 5 s late before)."""
    import gevent
    import gevent.event
    import gevent.socket

    process = Process(worker=0, worker_count=2)
    peers = Peers(process, str(tmp_path))
    process.link(peers)
    addresses = {1: "old"}
    peers.address_of = addresses.get
    dialled: list[str] = []
    cut_off = gevent.event.Event()  # never set: the old host does not answer
    ours, theirs = gevent.socket.socketpair()

    def dial(worker: int):
        dialled.append(addresses[worker])
        if addresses[worker] == "old":
            cut_off.wait()
            raise OSError("timed out")
        return ours

    peers.dial = dial
    keeper = gevent.spawn(peers.keep_linked, 1)
    try:
        deadline = time.monotonic() + 5
        while dialled != ["old"] and time.monotonic() < deadline:
            gevent.sleep(0.01)
        assert dialled == ["old"]
        addresses[1] = "new"
        peers.readdress(1)
        while "new" not in dialled and time.monotonic() < deadline:
            gevent.sleep(0.01)
        assert dialled == ["old", "new"]
        assert theirs.recv(64).startswith(b"- _link 0")  # the new owner got the link's hello
    finally:
        keeper.kill()
        ours.close()
        theirs.close()


def test_a_change_a_router_never_acked_holds_output_until_it_links_again_or_may_no_longer_route(tmp_path):
    """The owner binds while the router's link still looks alive; the link then goes before the router acked the
    change, and the router routes by what it had. Client output (the consume's answer) waits until the router has
    linked again and acked a change of none sent after its dump, or its owner changed, or its promise ran out."""
    import gevent
    import gevent.socket

    from mqks.server.workers.frames import FrameReader

    process = Process(worker=0, worker_count=2)
    peers = Peers(process, str(tmp_path))
    process.link(peers)
    epochs = {1: 4}
    peers.owner_epoch = epochs.get
    peers.promises.seconds = 60.0
    broker = process.broker

    def deadline_wait(condition) -> bool:
        deadline = time.monotonic() + 5
        while not condition() and time.monotonic() < deadline:
            gevent.sleep(0.01)
        return condition()

    def bind_then_lose(queue: bytes) -> None:
        ours, theirs = gevent.socket.socketpair()
        link = IncomingLink(ours, peers, 1)
        link.acked = peers.epoch  # linked long ago: its dump applied
        peers.incoming.add(link)
        served = gevent.spawn(link.serve)
        assert broker.rebind(broker.queue(queue), [queue + b".e"])  # allowed: the router is linked
        assert peers.holds_output()  # until it acks
        theirs.close()  # its link goes before it acked
        served.join(5)
        assert served.dead and peers.unacked_losses == {1}

    bind_then_lose(b"q1")
    peers.check_barrier()
    assert peers.holds_output()  # the router may route by what it had: the answer waits
    again, router_end = gevent.socket.socketpair()
    accepted = gevent.spawn(peers.accept_link, again, 1)
    reader, frames = FrameReader(), []
    with gevent.Timeout(5):
        while len(frames) < 3:
            frames.extend(reader.feed(router_end.recv(65536)))
    kinds = [(chr(kind), key) for kind, key, _ in frames[:3]]
    assert kinds == [("Z", b"-"), ("B", b"-"), ("B", b"%d" % peers.epoch)] and b"q1 q1.e" in frames[1][2]
    peers.check_barrier()
    assert peers.holds_output()  # linked again, its dump not acked yet
    router_end.sendall(b"K%d 0\n" % peers.epoch)
    assert deadline_wait(lambda: not peers.holds_output())
    accepted.kill()
    router_end.close()

    bind_then_lose(b"q2")
    epochs[1] = 5  # the router's group has a new owner: the process that routed by it no longer serves it
    peers.check_barrier()
    assert not peers.holds_output()

    epochs[1] = 6
    peers.promises.promise(1, time.monotonic() + 60)
    bind_then_lose(b"q3")
    peers.promises.until[1] = (time.monotonic() - 1, 6)  # its promise ran out
    peers.check_barrier()
    assert not peers.holds_output()

"""The client with a broker of several worker processes: consumes and acks on the owner, replay by a new map.

Three layers: the routing decision from a `hello` answer (pure); the client against a real
single-process mqksd behind proxies that add a slot map to its hello (so the client's links
are checked line by line); and the client against `mqksd --workers N` itself.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import gevent
import gevent.server
import gevent.socket
import pytest
import ujson
from conftest import BrokerProcess
from gevent.event import Event
from helpers import Inbox, free_port, make_client, queue_owned_by
from tls_certs import make_certs
from waiting import wait_until

from mqks.client import Client
from mqks.client.placement import Placement, Route
from mqks.server.dispatch.slots import SLOTS, owner_of, slot_ranges

WAIT_SECONDS = 10.0
TOKEN = "workers-s3cret-0123456789"
NO_SLOT_MAP = "mqksd --workers 2 answered hello without a slot map or direct addresses"


def hello(workers: int, ports: list[int], host: str = "127.0.0.1", **extra: Any) -> dict[str, Any]:
    """A hello answer as the multi-process broker gives it (server/dispatch/slots.py's map)."""
    return {"version": "x", "workers": workers, "worker": 0, "slots": SLOTS, "slot_map": slot_ranges(workers),
            "direct": [{"worker": worker, "host": host, "port": port, "unix": None}
                       for worker, port in enumerate(ports)], **extra}


# -- the routing decision, from a hello answer alone ------------------------------------------------------------


def test_no_slot_map_means_one_connection_for_all() -> None:
    assert Placement.from_hello(None) is None
    assert Placement.from_hello({"version": "x", "workers": 2}) is None  # today's hello: shards in one process
    assert Placement.from_hello(hello(1, [40001])) is None  # one worker: nothing to route


@pytest.mark.parametrize("broken", [
    {"slot_map": [[0, 100, 0], [200, SLOTS - 1, 1]]},  # a gap: some queue would have no owner
    {"slot_map": [[0, SLOTS - 1, 0], [0, SLOTS - 1, 1]]},  # overlapping rows
    {"slot_map": [[0, 8191, 0], [8192, SLOTS - 1, 7]]},  # an owner past the worker count
    {"slot_map": "0-16383"},
    {"slots": 0},
    {"workers": True},
    {"direct": None},
])
def test_a_malformed_slot_map_falls_back_to_one_connection(broken: dict[str, Any]) -> None:
    assert Placement.from_hello({**hello(2, [40001, 40002]), **broken}) is None


@pytest.mark.parametrize("workers", [2, 3, 16])
def test_the_owner_is_the_servers(workers: int) -> None:
    placement = Placement.from_hello(hello(workers, [40000 + w for w in range(workers)]))
    assert placement is not None
    for n in range(2000):
        queue = f"queue-{n}".encode()
        assert placement.owner(queue) == owner_of(queue, workers)


def test_a_consume_goes_to_the_owners_direct_port() -> None:
    placement = Placement.from_hello(hello(2, [40001, 40002]))
    assert placement is not None
    for worker in (0, 1):
        queue = queue_owned_by(worker, 2).encode()
        assert placement.route(queue, "127.0.0.1", tls=False) == Route(worker, "127.0.0.1", 40001 + worker)


def test_with_tls_only_the_tls_port_will_do() -> None:
    info = hello(2, [40001, 40002])
    info["direct"][0]["tls_port"] = 41001
    placement = Placement.from_hello(info)
    assert placement is not None
    q0, q1 = queue_owned_by(0, 2).encode(), queue_owned_by(1, 2).encode()
    assert placement.route(q0, "broker.example", tls=True) == Route(0, "127.0.0.1", 41001)
    assert placement.route(q1, "broker.example", tls=True) is None  # no tls_port: the public link
    assert placement.route(q1, "broker.example", tls=False) == Route(1, "127.0.0.1", 40002)


def test_a_wildcard_host_is_dialled_at_the_public_host_and_a_unix_socket_only_on_loopback() -> None:
    info = hello(2, [40001, 40002], host="0.0.0.0")
    info["direct"][1]["unix"] = "/tmp/mqks-x/worker-1.sock"
    placement = Placement.from_hello(info)
    assert placement is not None
    q1 = queue_owned_by(1, 2).encode()
    assert placement.route(q1, "broker.example", tls=False) == Route(1, "broker.example", 40002)
    assert placement.route(q1, "127.0.0.1", tls=False) == Route(1, "127.0.0.1", 40002, "/tmp/mqks-x/worker-1.sock")
    assert placement.route(q1, "127.0.0.1", tls=True) is None


def test_an_entry_without_a_port_or_a_worker_routes_to_the_public_link() -> None:
    info = hello(2, [40001, 40002])
    info["direct"] = [{"worker": 0, "host": "127.0.0.1", "port": None}, {"host": "127.0.0.1", "port": 40002}]
    placement = Placement.from_hello(info)
    assert placement is not None
    assert placement.route(queue_owned_by(0, 2).encode(), "127.0.0.1", tls=False) is None
    assert placement.route(queue_owned_by(1, 2).encode(), "127.0.0.1", tls=False) is None


# -- the client's links, against one real broker behind proxies that fake a multi-worker hello -----------------


class HelloProxy:
    """A TCP proxy to a real broker that merges `extra` into every hello answer, and records the lines it passes."""

    def __init__(self, upstream_port: int, unix: str | None = None) -> None:
        self.upstream_port = upstream_port
        self.extra: dict[str, Any] = {}
        self.lines: list[bytes] = []  # client -> broker, every connection
        self.socks: list[gevent.socket.socket] = []
        listener: Any = ("127.0.0.1", 0)
        if unix is not None:
            listener = gevent.socket.socket(gevent.socket.AF_UNIX, gevent.socket.SOCK_STREAM)
            listener.bind(unix)
            listener.listen()
        self.server = gevent.server.StreamServer(listener, self._handle)
        self.server.start()
        self.port: int = 0 if unix is not None else self.server.server_port

    def actions(self, action: bytes) -> list[bytes]:
        return [line for line in self.lines if line.split(b" ", 2)[1:2] == [action]]

    def drop(self) -> None:
        """Close every proxied connection, as a broker restart would."""
        for sock in self.socks:
            sock.close()
        self.socks = []

    def close(self) -> None:
        self.server.stop()
        self.drop()

    def _handle(self, sock: gevent.socket.socket, _address: object) -> None:
        try:
            upstream = gevent.socket.create_connection(("127.0.0.1", self.upstream_port))
        except OSError:
            sock.close()
            return
        self.socks += [sock, upstream]
        hello_rids: set[bytes] = set()

        def up() -> None:
            for line in _lines(sock):
                self.lines.append(line)
                rid, _, rest = line.partition(b" ")
                if rest.split(b" ", 1)[0] == b"hello":
                    hello_rids.add(rid)
                upstream.sendall(line + b"\n")

        def down() -> None:
            for line in _lines(upstream):
                rid, _, rest = line.partition(b" ")
                if rid in hello_rids and rest.startswith(b"ok {"):
                    line = rid + b" ok " + ujson.dumps({**ujson.loads(rest[3:]), **self.extra}).encode()
                sock.sendall(line + b"\n")

        try:
            gevent.joinall([gevent.spawn(up), gevent.spawn(down)], count=1)
        finally:
            sock.close()
            upstream.close()


def _lines(sock: gevent.socket.socket) -> Iterator[bytes]:
    tail = b""
    try:
        while chunk := sock.recv(65536):
            lines = (tail + chunk).split(b"\n")
            tail = lines.pop()
            yield from lines
    except OSError:
        return


@pytest.fixture
def proxies(make_broker: Callable[..., BrokerProcess]) -> Iterator[tuple[BrokerProcess, list[HelloProxy]]]:
    """A real broker and four proxies to it: [public, worker 0, worker 1, worker 2]."""
    broker = make_broker()
    started = [HelloProxy(broker.port) for _ in range(4)]
    yield broker, started
    for proxy in started:
        proxy.close()


def fake_workers(proxies: list[HelloProxy], workers: int) -> None:
    """Make every proxy's hello say `workers` workers (1: today's hello), reached at proxies 1..workers."""
    extra = hello(workers, [proxy.port for proxy in proxies[1 : workers + 1]]) if workers > 1 else {}
    extra.pop("version", None)
    for proxy in proxies:
        proxy.extra = extra


def consumed_at(proxy: HelloProxy, queue: str) -> bool:
    return any(line.split(b" ")[3:4] == [queue.encode()] for line in proxy.actions(b"consume"))


def test_consumes_and_acks_go_to_the_owners_link_and_publishes_to_the_public_one(proxies) -> None:
    _, (public, w0, w1, _) = proxies
    fake_workers(proxies[1], 2)
    client = make_client(public.port)
    try:
        q0, q1, event = queue_owned_by(0, 2), queue_owned_by(1, 2), f"e-{uuid.uuid4().hex[:8]}"
        inbox0, inbox1 = Inbox(ack=True), Inbox(ack=True)
        client.consume(q0, [event], inbox0, manual_ack=True)
        client.consume(q1, [event], inbox1, manual_ack=True)
        for n in range(5):
            client.publish(event, f"m{n}")
        assert [m.data for m in inbox0.wait(5)] == [m.data for m in inbox1.wait(5)] == [f"m{n}" for n in range(5)]
        client.ping()
        wait_until(lambda: len(w0.actions(b"ack")) == 5 and len(w1.actions(b"ack")) == 5, "5 acks on each owner")
        assert consumed_at(w0, q0) and consumed_at(w1, q1)
        assert not consumed_at(public, q0) and not consumed_at(public, q1) and not consumed_at(w0, q1)
        assert len(public.actions(b"publish")) == 5 and not public.actions(b"ack")
        assert not w0.actions(b"publish") and not w1.actions(b"publish")
    finally:
        client.close()


def test_a_broker_without_a_slot_map_gets_everything_on_one_connection(proxies) -> None:
    _, (public, w0, w1, _) = proxies
    client = make_client(public.port)
    try:
        queue, event = queue_owned_by(1, 2), f"e-{uuid.uuid4().hex[:8]}"
        inbox = Inbox(ack=True)
        client.consume(queue, [event], inbox, manual_ack=True)
        client.publish(event, "one")
        inbox.wait(1)
        client.ping()
        wait_until(lambda: public.actions(b"ack"), "the ack on the public connection")
        assert consumed_at(public, queue) and not w0.lines and not w1.lines
    finally:
        client.close()


def test_after_a_restart_with_another_worker_count_consumers_are_replayed_to_their_new_owners(proxies) -> None:
    _, (public, *direct) = proxies
    fake_workers(proxies[1], 2)
    client = make_client(public.port)
    try:
        event = f"e-{uuid.uuid4().hex[:8]}"
        # one queue per (owner with 2 workers, owner with 3): some stay, some move
        queues = [queue_owned_by(0, 2), queue_owned_by(1, 2)]
        queues += [q for q in (queue_owned_by(1, 2) for _ in range(40)) if owner_of(q.encode(), 3) == 2][:1]
        queues += [q for q in (queue_owned_by(0, 2) for _ in range(40)) if owner_of(q.encode(), 3) == 1][:1]
        inboxes = {queue: Inbox(ack=True) for queue in queues}
        reconnected = Event()
        for queue, inbox in inboxes.items():
            client.consume(queue, [event], inbox, manual_ack=True, on_reconnect=lambda old, new: reconnected.set())
        client.publish(event, "before")
        for inbox in inboxes.values():
            inbox.wait(1)

        for workers, sent in ((1, "with one"), (3, "with three")):
            fake_workers(proxies[1], workers)
            for proxy in proxies[1]:
                proxy.lines.clear()
            for proxy in proxies[1]:
                proxy.drop()
            for queue in queues:
                if workers == 1:
                    wait_until(lambda queue=queue: consumed_at(public, queue), f"{queue} replayed on the public link")
                else:
                    owner = direct[owner_of(queue.encode(), workers)]
                    wait_until(lambda owner=owner, queue=queue: consumed_at(owner, queue),
                               f"{queue} replayed on its owner with {workers} workers")
            wait_until(lambda: client.connected, "the client to reconnect")
            client.publish(event, sent, confirm=True)
            for queue, inbox in inboxes.items():
                wait_until(lambda inbox=inbox, sent=sent: [m for m in inbox.messages if m.data == sent],
                           f"{queue} to get {sent!r}")
            if workers == 3:
                for queue in queues:
                    owner = owner_of(queue.encode(), 3)
                    others = [proxy for n, proxy in enumerate(direct) if n != owner]
                    assert not any(consumed_at(proxy, queue) for proxy in [public, *others])
        assert reconnected.is_set()
        # links open lazily: one to each worker that owns one of our queues now
        assert sorted(client._direct) == sorted({owner_of(queue.encode(), 3) for queue in queues})
    finally:
        client.close()


def test_a_direct_port_nobody_answers_falls_back_to_the_public_address(proxies) -> None:
    _, (public, w0, w1, _) = proxies
    fake_workers([public, w0, w1], 2)
    w1.server.stop()  # worker 1's direct port is closed: its consumes go (relayed) through the public port
    client = make_client(public.port, connect_timeout_seconds=1.0)
    try:
        q1, event = queue_owned_by(1, 2), f"e-{uuid.uuid4().hex[:8]}"
        inbox = Inbox()
        client.consume(q1, [event], inbox)
        client.publish(event, "through the front door")
        assert inbox.wait(1)[0].data == "through the front door"
        assert consumed_at(public, q1)
    finally:
        client.close()


def test_a_local_client_prefers_the_owners_unix_socket(proxies, tmp_path) -> None:
    broker, (public, w0, w1, _) = proxies
    path = str(tmp_path / "worker-1.sock")
    w1_unix = HelloProxy(broker.port, unix=path)
    try:
        fake_workers([public, w0, w1, w1_unix], 2)
        for proxy in (public, w0, w1, w1_unix):
            proxy.extra["direct"][1]["unix"] = path
        client = make_client(public.port)
        try:
            q1, event = queue_owned_by(1, 2), f"e-{uuid.uuid4().hex[:8]}"
            inbox = Inbox(ack=True)
            client.consume(q1, [event], inbox, manual_ack=True)
            client.publish(event, "next door")
            assert inbox.wait(1)[0].data == "next door"
            wait_until(lambda: w1_unix.actions(b"ack"), "the ack on the Unix socket")
            assert consumed_at(w1_unix, q1) and not w1.lines
        finally:
            client.close()
    finally:
        w1_unix.close()


# -- the client against mqksd --workers N itself -----------------------------------------------------------------


def multi_process(broker: BrokerProcess) -> Placement:
    """The broker's placement from its hello; a broker of several workers must have one (a test whose
    set-up fails fails: it never skips)."""
    wire = broker.wire()
    try:
        wire.send(b"h hello")
        line = wire.recv_line()
    finally:
        wire.close()
    assert line.startswith(b"h ok "), line
    placement = Placement.from_hello(ujson.loads(line[5:]))
    assert placement is not None, f"{NO_SLOT_MAP}: {line[:300]!r}"
    return placement


def link_worker(client: Client, queue: str) -> int | None:
    """The worker the connection carrying this client's consumer of `queue` landed on (hello's "worker")."""
    for _, session in client._direct.values():
        if any(consumer.queue == queue for consumer in session.by_id.values()):
            assert session.link is not None and session.link.server_info is not None
            return session.link.server_info.get("worker")
    return None


def test_one_client_gets_every_message_of_queues_on_both_workers_and_acks_on_the_owner(make_broker) -> None:
    broker = make_broker("--workers", "2")
    multi_process(broker)
    client = make_client(broker.port)
    try:
        q0, q1, event = queue_owned_by(0, 2), queue_owned_by(1, 2), f"e-{uuid.uuid4().hex[:8]}"
        inbox0, inbox1 = Inbox(ack=True), Inbox(ack=True)
        client.consume(q0, [event], inbox0, manual_ack=True)
        client.consume(q1, [event], inbox1, manual_ack=True)
        count = 50
        for n in range(count):
            client.publish(event, f"m{n}")
        assert [m.data for m in inbox0.wait(count)] == [m.data for m in inbox1.wait(count)] == [
            f"m{n}" for n in range(count)]
        assert (link_worker(client, q0), link_worker(client, q1)) == (0, 1)
        wait_until(lambda: [client.stats(worker=w)["acked"] for w in (0, 1)] == [count, count],
                   f"{count} acks on each owner")
    finally:
        client.close()


def test_consumers_follow_their_queues_through_restarts_with_one_then_three_workers(make_broker) -> None:
    broker = make_broker("--workers", "2")
    multi_process(broker)
    port = broker.port
    client = make_client(port)
    try:
        event = f"e-{uuid.uuid4().hex[:8]}"
        queues = [queue_owned_by(0, 2), queue_owned_by(1, 2)]
        queues += [q for q in (queue_owned_by(1, 2) for _ in range(40)) if owner_of(q.encode(), 3) == 2][:1]
        inboxes = {queue: Inbox(ack=True) for queue in queues}
        for queue, inbox in inboxes.items():
            client.consume(queue, [event], inbox, manual_ack=True)
        client.publish(event, "with two", confirm=True)
        for inbox in inboxes.values():
            inbox.wait(1)
        for workers in (1, 3):
            broker.kill()
            broker = make_broker("--workers", str(workers), port=port)  # in memory: the replay re-declares
            sent = f"with {workers}"
            # the replay re-creates the queues and their bindings: publish until each has had one
            wait_until(lambda sent=sent: client.publish(event, sent, confirm=True) and all(
                any(m.data == sent for m in inbox.messages) for inbox in inboxes.values()),
                f"every queue to get {sent!r}", interval=0.2)
            if workers == 3:
                multi_process(broker)
                for queue in queues:
                    assert link_worker(client, queue) == owner_of(queue.encode(), 3), queue
            else:
                assert not client._direct or all(not s.by_id for _, s in client._direct.values())
    finally:
        client.close()


def test_a_publish_right_after_a_reconnect_reaches_every_replayed_consumer(make_broker) -> None:
    # issue 31.9: the public link reconnected and published while the direct links were still
    # replaying their consumers to a restarted in-memory broker: the publish reached no queue
    broker = make_broker("--workers", "2")
    multi_process(broker)
    port = broker.port
    client = make_client(port)
    try:
        event = f"e-{uuid.uuid4().hex[:8]}"
        inboxes = [Inbox(), Inbox()]
        for worker, inbox in enumerate(inboxes):
            client.consume(queue_owned_by(worker, 2), [event], inbox)
        for round_ in range(6):
            reconnects = client.reconnects
            broker.kill()
            broker = make_broker("--workers", "2", port=port)  # in memory: only the replays bind the queues
            wait_until(lambda reconnects=reconnects: client.reconnects > reconnects and client.connected,
                       "the public link to reconnect")
            client.publish(event, f"round {round_}", confirm=True)  # at once: no retry, no second chance
            for inbox in inboxes:
                inbox.wait(round_ + 1)
        assert [[m.data for m in inbox.messages] for inbox in inboxes] == [[f"round {n}" for n in range(6)]] * 2
    finally:
        client.close()


def test_a_spark_executor_fetches_on_the_owner_and_on_the_public_port_without_a_map(proxies, monkeypatch) -> None:
    from mqks.spark import source  # the spark extra is part of the test install: missing, the test fails
    from mqks.spark.options import Endpoint

    _, (public, w0, w1, _) = proxies
    fake_workers(proxies[1], 2)
    monkeypatch.setattr(source, "_CLIENTS", {})
    endpoint = Endpoint("127.0.0.1", public.port, 5.0)
    q1, event = queue_owned_by(1, 2), f"e-{uuid.uuid4().hex[:8]}"
    client = make_client(public.port)
    try:
        client.rebind(q1, [event])
        client.publish(event, "for spark", confirm=True)
    finally:
        client.close()
    # the line client blocks (no gevent, as on an executor): a thread of its own lets the proxies run
    in_thread = gevent.get_hub().threadpool.apply
    try:
        fetcher = in_thread(source._fetch_client, (endpoint, q1.encode(), False))
        assert fetcher.port == w1.port
        line = b"f1 fetch %b --max=10 --max-bytes=65536 --lease=spark.t.1.0 --lease-seconds=30 --runs" % q1.encode()
        in_thread(fetcher.send, ([line],))
        block = in_thread(source._answer, (fetcher, b"f1"))
        assert source._answer_count(block, b"f1") == 1 and b" for spark\n" in block
        assert len(w1.actions(b"fetch")) == 1 and not public.actions(b"fetch") and not w0.actions(b"fetch")
        fake_workers(proxies[1], 1)  # a restart with one worker: a fresh hello has no map
        assert in_thread(source._fetch_client, (endpoint, q1.encode(), True)).port == public.port
    finally:
        for line_client in source._CLIENTS.values():
            line_client.close()


def test_direct_links_speak_tls_with_the_token_when_the_public_link_does(make_broker, tmp_path) -> None:
    certs = make_certs(tmp_path)
    (tmp_path / "tokens").write_text(TOKEN + "\n")
    tls_port = free_port()
    make_broker("--workers", "2", *certs.server_args(tls_port), "--auth-token-file", str(tmp_path / "tokens"))
    client = make_client(tls_port, tls=certs.client_context(), token=TOKEN)
    try:
        assert Placement.from_hello(client.server_info) is not None, f"{NO_SLOT_MAP}: {client.server_info}"
        q0, q1, event = queue_owned_by(0, 2), queue_owned_by(1, 2), f"e-{uuid.uuid4().hex[:8]}"
        inbox0, inbox1 = Inbox(ack=True), Inbox(ack=True)
        client.consume(q0, [event], inbox0, manual_ack=True)
        client.consume(q1, [event], inbox1, manual_ack=True)
        client.publish(event, "secret")
        assert inbox0.wait(1)[0].data == inbox1.wait(1)[0].data == "secret"
        for worker, (route, session) in client._direct.items():
            assert session.link is not None and session.link.server_info is not None
            info = session.link.server_info
            assert (info["tls"], info["authenticated"], info["worker"]) == (True, True, worker)
            assert route.unix is None  # never a Unix socket under TLS
    finally:
        client.close()

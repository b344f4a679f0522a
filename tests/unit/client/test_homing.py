"""The routing of consumers to a direct link per worker (client/linking.py's ClientBase), shared by both clients:
a route opens one session per worker on a link started in the background, with the public addresses as fallbacks
(the one in use first); a new map retires a moved worker's link, its consumers wait to be placed, and the rehoming
pass puts each on its owner's link through the transport's hooks; a request refused for now is asked again after
a pause that doubles, within its deadline. In process: a transport whose hooks record what they are asked, links
that never connect."""

from __future__ import annotations

import time
from typing import Any

import pytest

from mqks.client.consuming import ConsumerState, Registry
from mqks.client.errors import MqksConnectionError, MqksError, MqksTimeoutError, not_done_try_again
from mqks.client.linking import ClientBase, Retries
from mqks.client.placement import Homes
from mqks.common.slots import owner_of

pytestmark = pytest.mark.timeout(10)


class FakeLink:
    """A link as ClientBase reads it; begin() only notes that it was asked to connect."""

    def __init__(self, host: str, port: int, session: Any, new_rid: Any, *, fallbacks: Any = (), unix: Any = None,
                 tls_hostname: str | None = None, **options: Any) -> None:
        self.host, self.port, self.unix, self.tls_hostname = host, port, unix, tls_hostname
        self.addresses = [(host, port), *fallbacks]
        self.address_index = 0
        self.tls = None
        self.closed = self.began = self.connected = False
        self.server_info: dict[str, Any] | None = None
        self.conn = None

    def begin(self) -> None:
        self.began = True


class Transport(ClientBase):
    """ClientBase with hooks that record: what the gevent and asyncio clients do in greenlets and tasks."""

    _link_class = FakeLink
    _session_class = Registry

    def _set_up(self) -> None:
        self._consumers = Registry(f"{self.host}:{self.port}", self._new_rid, on_connect=self._on_connect)
        self._link = FakeLink(self.host, self.port, self._consumers, self._new_rid, fallbacks=self.settings.fallbacks)
        self._consumers.link = self._link
        self._homes = Homes(self._consumers, lambda: (self._link.host, False))
        self._homeless = []
        self._rehome_again = False
        self.closed_later: list[FakeLink] = []
        self.rehomes_started = 0
        self.rehoming = False
        self.moved: list[tuple[Any, Any]] = []

    def _close_later(self, link: Any) -> None:
        self.closed_later.append(link)

    def _rehome_running(self) -> bool:
        return self.rehoming

    def _start_rehome(self) -> None:
        self.rehomes_started += 1
        self.rehoming = True

    def _move(self, session: Any, consumer: Any) -> None:
        self.moved.append((session, consumer))

    def _moving(self) -> bool:
        return bool(self.moved)


def hello(ports: list[int]) -> dict[str, Any]:
    """A hello of a broker whose workers listen on `ports`, one each, slots split evenly."""
    workers, slots = len(ports), 16384
    return {"workers": workers, "slots": slots,
            "slot_map": [[w * slots // workers, (w + 1) * slots // workers - 1, w] for w in range(workers)],
            "direct": [{"worker": w, "host": "0.0.0.0", "port": port} for w, port in enumerate(ports)]}


class Consumer(ConsumerState):
    def wake(self) -> None:
        pass


def new_consumer(client: Transport, queue: str) -> Consumer:
    consumer = Consumer(client._new_rid().decode(), queue, ["e"], add=False, manual_ack=False,
                             delete_queue_when_unused=None, prefetch=0, json=False)
    consumer.active = True
    return consumer


def test_a_route_opens_one_session_per_worker_with_the_public_addresses_as_fallbacks():
    client = Transport("10.0.0.1", 25000, fallbacks=[("10.0.0.2", 25000)])
    client._link.address_index = 1  # connected to the fallback: it comes first
    client._on_connect(client._consumers)  # a hello without a map: one link for all
    assert client._session_for(client._homes.route(b"q")) is client._consumers
    client._link.server_info = hello([25001, 25002])
    client._on_connect(client._consumers)
    route = client._homes.route(b"q")
    assert route is not None and route.port == 25001 + owner_of(b"q", 2) and route.host == "10.0.0.1"
    session = client._session_for(route)
    link = session.link
    assert session.worker == route.worker and link.began and link.tls_hostname == "10.0.0.1"
    assert link.addresses == [(route.host, route.port), ("10.0.0.2", 25000), ("10.0.0.1", 25000)]
    assert client._session_for(route) is session and client._homes.direct == {route.worker: (route, session)}


def test_a_new_map_retires_a_moved_workers_link_and_rehoming_puts_its_consumers_on_the_new_one():
    client = Transport("127.0.0.1", 25000)
    client._link.server_info = hello([25001, 25002])
    client._on_connect(client._consumers)
    assert client.rehomes_started == 1  # a new map: a pass, which finds nothing to move
    client._rehome()
    client.rehoming = False
    assert client.moved == [] and client._homes.direct == {}
    consumer = new_consumer(client, "q")
    old = client._session_for(client._homes.route(b"q"))
    old.start(consumer)
    assert client._consumers_placed() is False  # its link has not connected yet
    old.link.connected = True
    assert client._consumers_placed()

    client._link.server_info = hello([26001, 26002])  # the broker restarted on other ports
    client._on_connect(client._consumers)
    assert client.rehomes_started == 2 and not client._consumers_placed()
    client._schedule_rehome()  # while a pass runs: it only asks for another
    assert client.rehomes_started == 2 and client._rehome_again

    client._rehome()
    assert client.closed_later == [old.link] and old.by_id == {}
    new = client._homes.direct[owner_of(b"q", 2)][1]
    assert new is not old and new.link.port == 26001 + owner_of(b"q", 2) and new.link.began
    assert client.moved == [(new, consumer)] and new.by_id[consumer.id] is consumer and client._homeless == []


def test_a_deleted_queue_ends_its_consumers_wherever_they_wait():
    client = Transport("127.0.0.1", 25000)
    waiting, other = new_consumer(client, "q"), new_consumer(client, "r")
    client._consumers.start(waiting)
    client._consumers.release(waiting)
    client._homeless = [waiting, other]
    client._forget_queue("q")
    assert client._homeless == [other] and client._consumers.find(waiting.id) is None


def test_retries_pause_longer_each_time_until_the_deadline_and_only_for_a_refusal_for_now():
    now = time.monotonic()
    retries = Retries(now + 1.5)
    refused = MqksError("group 0 has no owner reachable from here (failing over): try again")
    assert [retries.pause_after(refused) for _ in range(2)] == [0.5, 1.0]
    with pytest.raises(MqksError) as raised:
        retries.pause_after(refused)  # 2 s more would pass the deadline
    assert raised.value is refused
    long = Retries(now + 60)
    assert [long.pause_after(refused) for _ in range(4)] == [0.5, 1.0, 2.0, 2.0]  # capped
    for error in (MqksError("unknown queue"), MqksTimeoutError("no answer"), MqksConnectionError("lost")):
        with pytest.raises(type(error)):
            Retries(now + 60).pause_after(error)
    with pytest.raises(MqksError):  # a publish some queues took is never sent again
        Retries(now + 60).pause_after(MqksError("owner restarting: partly published"), not_done_try_again)

"""The gevent <-> nats-py bridge (server/nats_io/nats_bridge.py) against a real three-node JetStream cluster:
a coroutine run from a greenlet answers in that greenlet while the hub goes on; NATS missing at start is one
clear error. The replicated log built on it is tested in test_replicated_log.py.
"""

from __future__ import annotations

import gevent
import pytest
from helpers import free_port
from waiting import wait_until

pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")

from mqks.server.nats_io.nats_bridge import BridgeError, NatsBridge

pytestmark = pytest.mark.timeout(120)


def test_run_answers_in_the_calling_greenlet_while_the_hub_goes_on(nats_cluster):
    import asyncio

    _, urls = nats_cluster
    bridge = NatsBridge(urls)
    bridge.start()
    ticks: list[int] = []

    def tick() -> None:
        while True:
            ticks.append(1)
            gevent.sleep(0.01)

    ticker = gevent.spawn(tick)
    try:
        async def round_trip(nc):
            await asyncio.sleep(0.3)  # the asyncio thread is busy: the hub must not be
            async def echo(msg):
                await nc.publish(msg.reply, msg.data.upper())

            sub = await nc.subscribe("bridge.echo", cb=echo)
            answer = await nc.request("bridge.echo", b"hello", timeout=5)
            await sub.unsubscribe()
            return answer.data

        assert bridge.run(round_trip, timeout=30) == b"HELLO"
        assert len(ticks) >= 10, ticks  # the ticker ran while run() waited
        with pytest.raises(ZeroDivisionError):  # an error in the coroutine comes back to the caller
            bridge.run(lambda nc: _raise(), timeout=30)
    finally:
        ticker.kill()
        bridge.close()
    with pytest.raises(BridgeError, match="closed"):
        bridge.run(lambda nc: asyncio.sleep(0))


async def _raise() -> None:
    raise ZeroDivisionError


def test_no_nats_at_start_is_one_clear_error():
    port = free_port()
    bridge = NatsBridge([f"nats://127.0.0.1:{port}"], connect_timeout=1.0)
    with pytest.raises(BridgeError, match=f"cannot reach NATS at nats://127.0.0.1:{port}"):
        bridge.start()


def test_a_scope_ends_its_own_subscriptions_and_tasks_and_leaves_the_connection_to_the_others(nats_cluster):
    import asyncio

    from mqks.server.nats_io.nats_bridge import SharedNats

    _, urls = nats_cluster
    shared = SharedNats(urls)
    ending, staying = shared.scope(), shared.scope()
    ending.start()
    staying.start()
    assert ending.bridge is staying.bridge  # one connection
    heard: dict[str, list[bytes]] = {"ending": [], "staying": []}
    spawned_ran: list[str] = []

    def listen(name: str):
        async def subscribe(nc) -> None:
            async def hear(msg) -> None:
                heard[name].append(msg.data)
            await nc.subscribe("scope.test", cb=hear)
        return subscribe

    async def forever(nc) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            spawned_ran.append("cancelled")

    try:
        ending.run(listen("ending"), timeout=30)
        staying.run(listen("staying"), timeout=30)
        ending.spawn(forever)

        async def publish(nc) -> None:
            await nc.publish("scope.test", b"one")
            await nc.flush()
        staying.run(publish, timeout=30)
        wait_until(lambda: heard["ending"] == [b"one"] and heard["staying"] == [b"one"],
                   "both subscriptions to hear the first")
        async def js_reader(nc) -> None:  # JetStream's subscriptions, made through the scope's client, are its own
            js = nc.jetstream()
            await js.add_stream(name="scopetest", subjects=["scope.js"], num_replicas=1)
            await js.pull_subscribe("scope.js", durable=None, stream="scopetest")
        ending.run(js_reader, timeout=30)
        assert len(ending.subscriptions) == 2
        ending.close()
        assert spawned_ran == ["cancelled"] and ending.subscriptions == []
        with pytest.raises(BridgeError, match="closed"):
            ending.run(publish)
        staying.run(publish, timeout=30)  # the connection serves the other group on
        wait_until(lambda: heard["staying"] == [b"one", b"one"], "the staying subscription to hear the second")
        assert heard["ending"] == [b"one"]  # its subscription went with it
    finally:
        shared.close()


"""The gevent <-> nats-py bridge (server/journal/nats_bridge.py) against a real three-node JetStream cluster:
a coroutine run from a greenlet answers in that greenlet while the hub goes on; NATS missing at start is one
clear error. The replicated log built on it is tested in test_replicated_log.py.
"""

from __future__ import annotations

import gevent
import pytest
from helpers import free_port

pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")

from mqks.server.journal.nats_bridge import BridgeError, NatsBridge

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

"""The gevent <-> nats-py bridge (server/journal/nats_bridge.py) against a real three-node JetStream cluster:
pipelined frames keep their order and each gets its PubAck in the hub; a server error (a wrong expected
last sequence) comes back as an error, not as a hang; NATS missing at start is one clear error.
"""

from __future__ import annotations

import asyncio
import time

import gevent
import pytest
from helpers import free_port

pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")

from mqks.server.journal.nats_bridge import BridgeError, NatsBridge, PubAck

pytestmark = pytest.mark.timeout(120)

WAIT_SECONDS = 30.0


def wait_greenlet(condition, what: str, timeout: float = WAIT_SECONDS) -> None:
    """Poll while the hub runs (the PubAcks arrive through it)."""
    with gevent.Timeout(timeout, AssertionError(f"timed out after {timeout:g}s waiting for {what}")):
        while not condition():
            gevent.sleep(0.01)


def make_stream(bridge: NatsBridge, name: str) -> None:
    """An R3 file stream as the log will make it, once it has a leader (it takes no write before)."""

    async def add(nc):
        js = nc.jetstream(timeout=5)
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            try:
                await js.add_stream(name=name, subjects=[f"{name}.frames"], num_replicas=3, storage="file",
                                    discard="new", allow_rollup_hdrs=True)
                info = await js.stream_info(name)
                if info.cluster is not None and info.cluster.leader:
                    return
            except Exception:  # a timeout while the cluster settles: ask again
                pass
            assert time.monotonic() < deadline, f"stream {name} has no leader after {WAIT_SECONDS:g} s"
            await asyncio.sleep(0.2)

    bridge.run(add, timeout=WAIT_SECONDS + 10)


def test_pipelined_frames_keep_their_order_and_each_gets_its_puback(nats_cluster):
    _, urls = nats_cluster
    acks: list[PubAck] = []
    deliveries: list[int] = []
    bridge = NatsBridge(urls, lambda batch: (acks.extend(batch), deliveries.append(len(batch))))
    bridge.start()
    try:
        make_stream(bridge, "BRIDGE1")
        sent: list[int] = []
        for batch in range(20):  # 20 group commits of 100 frames, none waiting for the last one's acks
            sent += bridge.publish([("BRIDGE1.frames", b"frame %d" % (batch * 100 + i), None) for i in range(100)])
        wait_greenlet(lambda: len(acks) == 2000, "2,000 PubAcks")
        assert sorted(ack.frame for ack in acks) == sent
        by_frame = {ack.frame: ack for ack in acks}
        assert [by_frame[frame].seq for frame in sent] == list(range(1, 2001))  # stored in the order sent
        assert not any(ack.error for ack in acks)
        assert len(deliveries) < 2000  # acks reach the hub in batches, not one wake-up each

        async def read(nc):
            js = nc.jetstream(timeout=10)
            return [(await js.get_msg("BRIDGE1", seq)).data for seq in (1, 1000, 2000)]

        assert bridge.run(read, timeout=WAIT_SECONDS) == [b"frame 0", b"frame 999", b"frame 1999"]
    finally:
        bridge.close()


def test_a_wrong_expected_last_sequence_comes_back_as_an_error(nats_cluster):
    _, urls = nats_cluster
    acks: list[PubAck] = []
    bridge = NatsBridge(urls, acks.extend)
    bridge.start()
    try:
        make_stream(bridge, "BRIDGE2")
        bridge.publish([("BRIDGE2.frames", b"first", {"Nats-Expected-Last-Sequence": "0"})])
        wait_greenlet(lambda: len(acks) == 1, "the first PubAck")
        assert acks[0].seq == 1 and not acks[0].error
        # a rival wrote in between: this writer still expects 0
        bridge.publish([("BRIDGE2.frames", b"stale", {"Nats-Expected-Last-Sequence": "0"})])
        wait_greenlet(lambda: len(acks) == 2, "the second PubAck")
        assert acks[1].error_code == 10071 and acks[1].seq == 0, acks[1]
    finally:
        bridge.close()


def test_no_nats_at_start_is_one_clear_error():
    port = free_port()
    bridge = NatsBridge([f"nats://127.0.0.1:{port}"], lambda batch: None, connect_timeout=1.0)
    with pytest.raises(BridgeError, match=f"cannot reach NATS at nats://127.0.0.1:{port}"):
        bridge.start()

"""The watch of the owners' entries (server/cluster/map.py's OwnerWatch) over nats-py's own message objects, in
process: each entry reaches the hub in delivery order, heartbeats and deleted entries are heard but carry
nothing, and a skipped delivery ends the watch (a new one sends every entry again). No NATS: the messages are
built as NATS delivers them (the JetStream reply subject carries the sequences)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

pytest.importorskip("nats")
from nats.aio.msg import Msg

from mqks.server.cluster.map import RETRY_SECONDS, WATCH_HEARTBEAT_SECONDS, OwnerWatch
from mqks.server.edges.config import Config

pytestmark = pytest.mark.timeout(10)

BUCKET = "mqks-c1"


class Bridge:
    """The NatsBridge's one call OwnerWatch makes: hand a callable to the hub (here: run it now)."""

    def to_hub(self, callback):
        callback()


def delivery(group: int, delivered: int, value: dict | None) -> Msg:
    """The message NATS pushes for entry `owner.{group}`: stream seq 100 + delivered, consumer seq `delivered`."""
    reply = f"$JS.ACK.KV_{BUCKET}.watch.1.{100 + delivered}.{delivered}.1700000000000000000.0"
    data = json.dumps(value).encode() if value is not None else b""
    return Msg(None, subject=f"$KV.{BUCKET}.owner.{group}", reply=reply, data=data)  # type: ignore[arg-type]


def heartbeat() -> Msg:
    return Msg(None, subject="_INBOX.x", data=b"", headers={"Status": "100", "Description": "Idle Heartbeat"})  # type: ignore[arg-type]


def test_entries_reach_the_hub_in_order_and_heartbeats_and_deletes_carry_nothing():
    learned: list[tuple[int, dict]] = []
    watch = OwnerWatch(Bridge(), lambda group, entry: learned.append((group, entry)))

    async def feed():
        await watch.on_message(delivery(3, 1, {"node": "a", "epoch": 1}))
        await watch.on_message(heartbeat())
        await watch.on_message(delivery(7, 2, {"node": "b", "epoch": 2}))
        await watch.on_message(delivery(3, 3, None))  # a deleted entry
        await watch.on_message(delivery(3, 4, {"node": "c", "epoch": 3}))

    asyncio.run(feed())
    assert learned == [(3, {"node": "a", "epoch": 1}), (7, {"node": "b", "epoch": 2}), (3, {"node": "c", "epoch": 3})]
    assert watch.heard.is_set() and not watch.skipped


def test_a_skipped_delivery_ends_the_watch_and_nothing_after_it_is_learned():
    learned: list[int] = []
    watch = OwnerWatch(Bridge(), lambda group, entry: learned.append(group))

    async def feed():
        await watch.on_message(delivery(1, 1, {"node": "a"}))
        await watch.on_message(delivery(2, 3, {"node": "b"}))  # delivery 2 never came

    asyncio.run(feed())
    assert learned == [1] and watch.skipped


def test_an_entry_that_is_not_json_is_skipped_and_the_watch_goes_on():
    learned: list[int] = []
    watch = OwnerWatch(Bridge(), lambda group, entry: learned.append(group))
    garbled = delivery(4, 1, None)
    garbled.data = b"{not json"

    async def feed():
        await watch.on_message(garbled)
        await watch.on_message(delivery(5, 2, {"node": "a"}))

    asyncio.run(feed())
    assert learned == [5] and not watch.skipped


def test_a_watch_deaf_since_its_nats_server_was_cut_off_is_made_anew_well_within_a_lease():
    """Issue 56: the watch's consumer lived on the cut host's NATS server; two silent heartbeats of 10 s later the
    nodes learned the new owners of the cut node's groups, 7 s after the takeovers. Made anew within half the
    default lease, the watch hears the new owners' entries as they are put."""
    default_lease = next(f.default for f in dataclasses.fields(Config) if f.name == "lease_seconds")
    assert isinstance(default_lease, float)
    assert default_lease / 2 > 2 * WATCH_HEARTBEAT_SECONDS + RETRY_SECONDS

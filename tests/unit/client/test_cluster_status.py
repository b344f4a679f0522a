"""`mqks cluster status` (client/cluster.py) against a JetStream that answers 503 while NATS elects its leader: asked
again within the timeout, and past it a message that says so, not nats-py's error. In process: NATS is a fake that
answers as nats-py raises."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")

from nats.js.errors import NotFoundError, ServiceUnavailableError

from mqks.client import cluster

pytestmark = pytest.mark.timeout(10)

URLS = ["nats://127.0.0.1:4222"]


class Electing:
    """A JetStream that answers 503 to its first `unavailable` listings, then has no streams and no bucket."""

    def __init__(self, unavailable: int) -> None:
        self.unavailable = unavailable
        self.listings = 0
        self.closed = False

    def jetstream(self, timeout: float) -> Electing:
        return self

    async def streams_info(self) -> list[Any]:
        self.listings += 1
        if self.listings <= self.unavailable:
            raise ServiceUnavailableError(code=503, description="JetStream system temporarily unavailable")
        return []

    async def stream_info(self, name: str, subjects_filter: str | None = None) -> Any:
        raise NotFoundError(code=404, err_code=10059, description="stream not found")

    async def close(self) -> None:
        self.closed = True


def status_of(nats: Electing, monkeypatch: pytest.MonkeyPatch, timeout: float) -> str:
    """The ValueError read_cluster ends with (there is no cluster either way)."""
    async def connect(urls: list[str], access: Any) -> Electing:
        return nats

    monkeypatch.setattr(cluster, "connect", connect)
    monkeypatch.setattr(cluster, "RETRY_SECONDS", 0.001)
    with pytest.raises(ValueError) as raised:
        asyncio.run(cluster.read_cluster(URLS, "shop", timeout=timeout))
    assert nats.closed
    return str(raised.value)


def test_a_503_is_asked_again_until_jetstream_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    nats = Electing(unavailable=3)
    reason = status_of(nats, monkeypatch, timeout=5.0)
    assert nats.listings == 4
    assert reason.startswith("no cluster 'shop' on the NATS servers at nats://127.0.0.1:4222 yet: are its nodes "
                             "started"), reason


def test_a_503_that_lasts_past_the_timeout_says_nats_is_electing_a_leader(monkeypatch: pytest.MonkeyPatch) -> None:
    nats = Electing(unavailable=10**6)
    reason = status_of(nats, monkeypatch, timeout=0.05)
    assert nats.listings > 1
    assert reason == ('the NATS servers at nats://127.0.0.1:4222 answered "JetStream system temporarily unavailable" '
                      "for 0.05 s: NATS is electing a JetStream leader, which takes a majority of its servers (some "
                      "just started, or were lost); try again in a moment")


def standby(node: str, lag: int, seen: float, capped: bool = False, down: bool = False) -> dict[str, Any]:
    return {"node": node, "lag": lag, "lag_capped": capped, "seen_seconds_ago": seen, "down": down}


def test_the_table_fits_80_columns_and_says_how_old_each_lag_is() -> None:
    """Issue 55: a single unnamed NATS server's 56-character id made the rows wrap; a lag up to 20 s old, capped at
    100, read as a standby far behind now."""
    from mqks.client.cli import render_cluster

    unnamed = "NCXY7JQZ3EXAMPLEEXAMPLEEXAMPLEEXAMPLEEXAMPLEEXAMPLEEXAMP"
    rows = [{"group": 0, "owner": "a", "epoch": 3, "address": "127.0.0.1:41631", "answering": "a", "pinned": None,
             "leader": unnamed, "last_seq": 1234567, "standbys": [standby("b", 100, 4.2, capped=True),
                                                                  standby("c", 2, 17.6)]},
            {"group": 1, "owner": "b", "epoch": 1, "address": "127.0.0.1:40113", "answering": "b", "pinned": "b",
             "leader": unnamed, "last_seq": 12, "standbys": [standby("a", 0, 9.0), standby("c", 0, 45.0, down=True)]}]
    table = render_cluster(rows)
    assert table.splitlines() == [
        "GROUP  OWNER  EPOCH  ADDRESS          ANSWERS  LEADER    LAST SEQ  STANDBY LAG",
        "    0  a          3  127.0.0.1:41631  yes      NCXY7J..   1234567  b 100+, c 2",
        "    1  b          1  127.0.0.1:40113  yes      NCXY7J..        12  a 0, c down",
        "STANDBY LAG in frames, as reported a 9 s, b 4 s, c 45 s ago",
        "pinned (mqks cluster unpin lets them go): group 1 to b",
    ]
    assert max(len(line) for line in table.splitlines()) <= 80

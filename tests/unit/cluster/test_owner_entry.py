"""An owner's entry in the cluster map (server/cluster/map.py's ClusterMap._put): put by the group's current owner
only. A conditional update on the entry's revision after a look at its epoch, retried while NATS does not answer and
the process still owns the group. In process, over a fake bucket with JetStream KV's revision rules."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from mqks.server.cluster import map as cluster_map_module
from mqks.server.cluster.candidacy import Candidacy
from mqks.server.cluster.map import ClusterMap

pytestmark = pytest.mark.timeout(10)


class Bucket:
    """A KV bucket: each put a new revision; `update(last=)` refused unless `last` is the key's revision.
    `before_update` runs first (another node's put landing between the look and the update); `failures` fail the next
    calls."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[int, bytes]] = {}
        self.revision = 0
        self.before_update: Any = None
        self.failures = 0

    def put_now(self, key: str, about: dict[str, Any]) -> None:
        self.revision += 1
        self.entries[key] = (self.revision, json.dumps(about).encode())

    def about(self, key: str) -> dict[str, Any]:
        return json.loads(self.entries[key][1])

    def _fail(self) -> None:
        if self.failures:
            self.failures -= 1
            raise TimeoutError("nats: timeout")

    async def get(self, key: str) -> SimpleNamespace:
        self._fail()
        if key not in self.entries:
            raise KeyNotFoundError
        revision, value = self.entries[key]
        return SimpleNamespace(revision=revision, value=value)

    async def create(self, key: str, value: bytes) -> int:
        self._fail()
        if key in self.entries:
            raise KeyWrongLastSequenceError
        self.revision += 1
        self.entries[key] = (self.revision, value)
        return self.revision

    async def update(self, key: str, value: bytes, last: int) -> int:
        self._fail()
        if self.before_update is not None:
            self.before_update()
            self.before_update = None
        if self.entries.get(key, (0, b""))[0] != last:
            raise KeyWrongLastSequenceError
        self.revision += 1
        self.entries[key] = (self.revision, value)
        return self.revision


def entry(node: str, epoch: int) -> dict[str, Any]:
    return {"group": 3, "node": node, "epoch": epoch, "host": "127.0.0.1", "port": 1, "link_port": 2}


def put(bucket: Bucket, about: dict[str, Any], still_owner: Any = lambda: True) -> None:
    cluster_map = ClusterMap(SimpleNamespace(), Candidacy("c", about["node"], 3, lease_seconds=12.0), 3,  # type: ignore[arg-type]
                             lambda group: None)

    async def bucket_of(nc: Any) -> Bucket:
        return bucket

    cluster_map._bucket = bucket_of  # type: ignore[method-assign]
    asyncio.run(cluster_map._put(None, about, still_owner))


def test_an_owner_puts_its_entry_over_an_older_owners_and_a_new_groups():
    bucket = Bucket()
    put(bucket, entry("a", 1))
    assert bucket.about("owner.3") == entry("a", 1)
    put(bucket, entry("b", 2))
    assert bucket.about("owner.3") == entry("b", 2)


def test_a_late_put_of_a_fenced_owner_never_replaces_the_newer_owners_entry():
    """Issue 56: a node cut off by a partition retried its put through the heal; it landed after another node had
    taken the group over, and status named the fenced node from then on."""
    bucket = Bucket()
    bucket.put_now("owner.3", entry("b", 5))
    put(bucket, entry("a", 4))
    assert bucket.about("owner.3") == entry("b", 5)


def test_a_newer_owners_put_between_the_look_and_the_update_wins():
    bucket = Bucket()
    bucket.put_now("owner.3", entry("a", 3))
    bucket.before_update = lambda: bucket.put_now("owner.3", entry("b", 5))
    put(bucket, entry("a", 4))
    assert bucket.about("owner.3") == entry("b", 5)


def test_retries_end_once_the_process_no_longer_owns_the_group(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(cluster_map_module, "RETRY_SECONDS", 0.001)
    bucket = Bucket()
    bucket.put_now("owner.3", entry("a", 3))
    bucket.failures = 1000  # NATS does not answer
    looks: list[int] = []

    def still_owner() -> bool:
        looks.append(1)
        return len(looks) < 4  # fenced after three tries

    put(bucket, entry("a", 4), still_owner)
    assert bucket.about("owner.3") == entry("a", 3) and len(looks) == 4

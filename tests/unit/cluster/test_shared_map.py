"""The map as a node process's groups share it (server/cluster/map.py's SharedMap): one watch of the owners'
entries for every group's map, and one report of every standby's position, put when a standby is new, soon after
a change, and periodically while nothing changes. In process, over a bridge that records what it is asked."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import gevent
import pytest

pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")

from mqks.server.cluster.candidacy import Candidacy
from mqks.server.cluster.map import ClusterMap, SharedMap, watch_owners

pytestmark = pytest.mark.timeout(10)


class Bridge:
    """The process's NATS bridge as SharedMap uses it: what it spawns is recorded, not run."""

    def __init__(self) -> None:
        self.spawned: list[Any] = []

    def spawn(self, make: Any) -> None:
        self.spawned.append(make)

    def puts(self) -> list[dict[int, int]]:
        return [make.keywords["positions"] for make in self.spawned
                if isinstance(make, functools.partial) and "positions" in make.keywords]


def shared_map(report_seconds: float = 10.0, idle_report_seconds: float = 20.0) -> tuple[SharedMap, Bridge]:
    bridge = Bridge()
    shared = SimpleNamespace(started=lambda: bridge)
    return SharedMap(shared, "mqks-c", "a", 0, 3, report_seconds, idle_report_seconds), bridge  # type: ignore[arg-type]


def group_map(shared: SharedMap, group: int, changes: list[tuple[int, int]]) -> ClusterMap:
    return ClusterMap(SimpleNamespace(), Candidacy("c", "a", group, lease_seconds=12.0), 3,  # type: ignore[arg-type]
                      lambda changed: changes.append((group, changed)), shared)


def entry(node: str, epoch: int) -> dict[str, Any]:
    return {"node": node, "epoch": epoch, "host": "127.0.0.1", "port": 1, "link_port": 2}


def test_one_watch_serves_every_groups_map_and_a_late_map_learns_what_is_known():
    shared, bridge = shared_map()
    changes: list[tuple[int, int]] = []
    first = group_map(shared, 0, changes)
    first.watch()
    second = group_map(shared, 1, changes)
    second.watch()
    watches = [make for make in bridge.spawned if make.func is watch_owners]
    assert len(watches) == 1  # not one per group
    shared.learn(3, entry("b", 2))
    assert first.entries[3]["node"] == second.entries[3]["node"] == "b"
    shared.learn(3, entry("c", 1))  # a lower epoch than one known: an old owner's late entry
    assert first.entries[3]["node"] == "b"
    late = group_map(shared, 2, changes)
    late.watch()
    assert late.entries[3]["node"] == "b" and (2, 3) in changes
    second.close()
    shared.learn(4, entry("c", 1))
    assert 4 in first.entries and 4 not in second.entries


def test_when_a_processs_report_goes():
    """At once for a standby not reported yet; within report_seconds of a change; every idle_report_seconds while
    nothing changes (status calls a standby down after 30 s); never while every group is owned here."""
    shared, _ = shared_map(report_seconds=10.0, idle_report_seconds=20.0)
    assert shared.report_due(now=100.0, last_put=-1e9) == float("inf")  # nothing stands by here
    shared.positions = {0: 10, 2: 11}
    assert shared.report_due(now=100.0, last_put=95.0) == 100.0  # new: at once
    shared.reported = {0: 10, 2: 11}
    assert shared.report_due(now=100.0, last_put=100.0) == 120.0  # unchanged: the idle period
    shared.positions[2] = 12
    assert shared.report_due(now=101.0, last_put=100.0) == 110.0  # changed: sooner
    del shared.positions[0]
    shared.positions[2] = 11
    assert shared.report_due(now=101.0, last_put=100.0) == 110.0  # one left: a change too
    shared.positions.clear()
    assert shared.report_due(now=101.0, last_put=100.0) == 110.0  # none left: said once
    shared.reported = {}
    assert shared.report_due(now=111.0, last_put=110.0) == float("inf")


def wait_for_puts(bridge: Bridge, count: int) -> list[dict[int, int]]:
    with gevent.Timeout(5):
        while len(bridge.puts()) < count:
            gevent.sleep(0.01)
    return bridge.puts()


def test_a_processs_standbys_go_in_one_put_as_they_change_and_leave():
    shared, bridge = shared_map(report_seconds=0.05, idle_report_seconds=0.1)
    changes: list[tuple[int, int]] = []
    maps = [group_map(shared, group, changes) for group in (0, 2, 4)]
    for seq, cluster_map in enumerate(maps):
        cluster_map.report_standby(seq + 10)
    assert wait_for_puts(bridge, 1)[0] == {0: 10, 2: 11, 4: 12}  # the three in one put
    maps[1].report_standby(20)
    assert {2: 20}.items() <= wait_for_puts(bridge, 2)[1].items()
    maps[0].close()  # the group's Server ended: its standby is reported no more
    with gevent.Timeout(5):
        while 0 in bridge.puts()[-1]:
            gevent.sleep(0.01)
    assert bridge.puts()[-1] == {2: 20, 4: 12}
    maps[2].bridge = SimpleNamespace(spawn=lambda make: None)
    maps[2].start({"node": "a", "epoch": 3})  # group 4's standby took it over: it owns it now
    with gevent.Timeout(5):
        while 4 in bridge.puts()[-1]:
            gevent.sleep(0.01)
    assert bridge.puts()[-1] == {2: 20}
    shared.reporter.kill()  # type: ignore[union-attr]

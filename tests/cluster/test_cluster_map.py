"""The cluster as its operator reads it: `mqks cluster status` over minutes of a default cluster, what NATS keeps
for it (the map's consumers), a status that cannot read NATS, and a cluster name reused with another --groups.

Every test here names its own MQKS cluster on one NATS cluster for the module (none kills a NATS node).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
from cluster_harness import (
    Cluster,
    ClusterNode,
    node_logs_on_failure,  # noqa: F401 (autouse: a failed test prints the nodes' logs)
)
from helpers import MQKS, free_port, unique
from waiting import wait_for

pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")

from mqks.client.cluster import STANDBY_DOWN_SECONDS
from mqks.server.cluster.election import BALANCE_SECONDS

pytestmark = pytest.mark.timeout(300)

# past the map watchers' inactivity threshold (30 s) after the groups settle: a leak shows as growth
WATCH_SECONDS = 45.0
# a node of 16 groups (the default before 2026-11-29) runs 16 groups, each with one watcher of the map: three
# nodes, 48 consumers. A process that handed its group over (balancing) starts again, and its old watcher lingers
# for its 30 s threshold: more right after the groups settle, 48 once that has passed (before issue 39: ~6 more
# every second, without end)
SETTLED_CONSUMERS = 48
CONSUMERS_BOUND = 120


def mqks_cluster(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(MQKS), "cluster", *args], capture_output=True, text=True, timeout=120)


def bucket_consumers(urls: list[str], cluster: str) -> int:
    """How many consumers NATS keeps on the cluster's map (its key-value stream)."""
    import nats

    async def count() -> int:
        nc = await nats.connect(servers=urls, connect_timeout=5)
        try:
            info = await nc.jetstream(timeout=5).stream_info(f"KV_mqks-{cluster}")
            return int(info.state.consumer_count)
        finally:
            await nc.close()
    return asyncio.run(count())


def test_a_default_cluster_status_stays_true_and_its_map_keeps_a_bounded_number_of_consumers(shared_nats_cluster):
    """Three nodes with 16 groups (the default before 2026-11-29: clusters made then keep it), watched with `mqks
    cluster status` called back to back: every call exits 0 and shows all 16 groups owned and answering, and the
    map's consumers stay bounded (before issue 39 they grew by ~6 a second until NATS refused more, and status
    went blind)."""
    _, urls = shared_nats_cluster
    cluster = Cluster(unique("dflt").replace("-", "_"), urls, groups=16, lease=12.0)

    def status() -> list[dict]:
        done = mqks_cluster("status", "--json", "--cluster", cluster.name, "--log", ",".join(urls))
        assert done.returncode == 0, done.stderr
        rows = json.loads(done.stdout)
        assert [row["group"] for row in rows] == list(range(16))
        return rows

    steady: list = [None, 0.0]  # the owners last seen settled, and since when

    def settled(rows: list[dict]) -> bool:
        """Every group owned and answering, spread evenly, and the same owners for longer than a standby's
        balancing period: one look at an even spread can fall between two moves of a chain (a node handing a
        group on while it pulls another), and the next move would be a hand-off under the watch below."""
        owners = [row["owner"] for row in rows]
        counts = [owners.count(node) for node in cluster.nodes]
        if not (all(row["owner"] and row["answering"] == row["owner"] for row in rows)
                and max(counts) - min(counts) <= 1):
            steady[0] = None
            return False
        if steady[0] != owners:
            steady[:] = [owners, time.monotonic()]
        return time.monotonic() - steady[1] > BALANCE_SECONDS + 1

    try:
        wait_for(lambda: settled(status()), "the default cluster's groups owned, spread and steady", 120,
                 interval=1.0)
        counts = []
        deadline = time.monotonic() + WATCH_SECONDS
        while time.monotonic() < deadline:
            rows = status()
            wrong = [row for row in rows if row["owner"] is None or row["answering"] != row["owner"]]
            assert not wrong, f"groups shown unowned or not answering: {wrong}"
            counts.append(bucket_consumers(urls, cluster.name))
            assert counts[-1] <= CONSUMERS_BOUND, f"the map's consumers grew: {counts}"
        print(f"consumers on the map of a default three-node cluster, after each status call: {counts}")
        assert counts[-1] <= SETTLED_CONSUMERS + 3, counts  # a watcher that reset itself may linger a moment
    finally:
        cluster.stop()


def test_status_that_cannot_read_nats_fails_instead_of_showing_no_owner() -> None:
    """A read that fails is an error on stderr with a non-zero exit, never a table of unowned groups."""
    port = free_port()  # nothing listens there
    done = mqks_cluster("status", "--cluster", "nowhere", "--log", f"nats://127.0.0.1:{port}")
    assert done.returncode != 0
    assert done.stdout == ""
    assert "mqks cluster status:" in done.stderr


def test_status_before_any_node_and_with_a_wrong_name_says_what_that_means(shared_nats_cluster):
    """No cluster of that name on these NATS servers (its nodes not started yet, or a wrong --cluster): status, move
    and unpin say so and exit 1. Before issue 55: `NotFoundError: nats: NotFoundError: code=404 err_code=10059
    description='stream not found'`."""
    _, urls = shared_nats_cluster
    name = unique("later").replace("-", "_")

    def refusal(cluster_name: str) -> str:
        return (f"no cluster {cluster_name!r} on the NATS servers at {','.join(urls)} yet: are its nodes started "
                f"(mqksd --cluster {cluster_name} --log ...), and is --cluster {cluster_name} the name they were "
                "given?\n")

    for action in (["status"], ["status", "--json"], ["move", "0", "A"], ["unpin"]):
        done = mqks_cluster(*action, "--cluster", name, "--log", ",".join(urls))
        assert (done.returncode, done.stdout, done.stderr) == (1, "", f"mqks cluster {action[0]}: {refusal(name)}")
    cluster = Cluster(name, urls, nodes=("A",), groups=1, lease=6.0)
    try:
        cluster.wait_owned()
        done = mqks_cluster("status", "--cluster", name, "--log", ",".join(urls))
        assert done.returncode == 0 and done.stdout.startswith("GROUP  OWNER"), done.stderr
        wrong = name + "x"
        done = mqks_cluster("status", "--cluster", wrong, "--log", ",".join(urls))
        assert (done.returncode, done.stdout, done.stderr) == (1, "", f"mqks cluster status: {refusal(wrong)}")
    finally:
        cluster.stop()


def test_a_standby_of_a_killed_node_is_shown_down(shared_nats_cluster):
    """After a kill -9, the dead node's standby rows say `down` (and since when), not a growing lag."""
    _, urls = shared_nats_cluster
    cluster = Cluster(unique("down").replace("-", "_"), urls, groups=2, lease=6.0)
    try:
        cluster.wait_balanced()

        def reported_idle() -> str | None:
            """A node that stands by for every group, each standby reported up in the status: there is something to
            show down after the kill (CI: once the groups spread in seconds, a slow node was killed before its
            standbys ever reported). Read from the status, not chosen before: a node that owned nothing when the
            groups were first owned may be handed one a moment later (a standby asks as soon as it stands by)."""
            done = mqks_cluster("status", "--json", "--cluster", cluster.name, "--log", ",".join(urls))
            rows = json.loads(done.stdout) if done.returncode == 0 else []
            idle = set(cluster.nodes)
            for row in rows:
                idle &= {s["node"] for s in row["standbys"] if not s["down"]}
            return min(idle) if rows and idle else None
        idle = wait_for(reported_idle, "a node standing by for every group, reported", 60, interval=0.5)
        cluster.kill(idle)

        def all_shown_down() -> list[dict] | None:
            """Each of its standbys' rows once all say down: their last reports were up to a report period apart
            (CI: one row was down at 30.3 s while the other, at 30.0 s, was not yet)."""
            done = mqks_cluster("status", "--json", "--cluster", cluster.name, "--log", ",".join(urls))
            assert done.returncode == 0, done.stderr
            standbys = [s for row in json.loads(done.stdout) for s in row["standbys"] if s["node"] == idle]
            return standbys if standbys and all(s["down"] for s in standbys) else None
        standbys = wait_for(all_shown_down, f"node {idle}'s standbys shown down", STANDBY_DOWN_SECONDS + 60,
                            interval=1.0)
        assert len(standbys) == cluster.groups  # one row each, none dropped
        assert all(s["seen_seconds_ago"] > STANDBY_DOWN_SECONDS for s in standbys), standbys
        done = mqks_cluster("status", "--cluster", cluster.name, "--log", ",".join(urls))
        print(done.stdout)
        assert done.stdout.count(f"{idle} down") == cluster.groups, done.stdout  # the table says it too
    finally:
        cluster.stop()


def test_a_cluster_name_reused_with_other_groups_is_refused_until_removed(shared_nats_cluster):
    """A node started with another --groups (or --streams) than the streams of its cluster's name refuses to start
    and says what differs and what to do; `mqks cluster remove` refuses while a node owns the old groups, then
    deletes them, and the new layout starts. The old cluster has a stream per group, as clusters made before
    groups shared streams: a node of today's defaults is refused there too, and told the flags that fit."""
    _, urls = shared_nats_cluster
    name = unique("reuse").replace("-", "_")
    old = Cluster(name, urls, nodes=("A",), groups=2, lease=6.0, streams=2)
    new = None
    try:
        old.wait_owned()
        stray = subprocess.run([sys.executable, "-m", "mqks.server", "--port", str(free_port()),
                                *Cluster.args_for(name, 3, 6.0), "--log", ",".join(urls), "--node", "B"],
                               capture_output=True, text=True, timeout=60)
        assert stray.returncode == 1
        log = stray.stderr
        assert f"cluster {name!r} already has 2 groups in 2 streams" in log and "--groups 3 --streams 1" in log, log
        assert "start it with --groups 2 --streams 2" in log, log
        upgraded = subprocess.run([sys.executable, "-m", "mqks.server", "--port", str(free_port()),
                                   *Cluster.args_for(name, 2, 6.0), "--log", ",".join(urls), "--node", "B"],
                                  capture_output=True, text=True, timeout=60)
        assert upgraded.returncode == 1 and "start it with --groups 2 --streams 2" in upgraded.stderr, upgraded.stderr

        done = mqks_cluster("remove", "--groups", "2", "--cluster", name, "--log", ",".join(urls))
        assert done.returncode != 0 and "still owns" in done.stderr, (done.stdout, done.stderr)
        old.stop()
        done = mqks_cluster("remove", "--groups", "2", "--cluster", name, "--log", ",".join(urls))
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"removed 2 streams: {name}-0-of-2, {name}-1-of-2"

        new = Cluster(name, urls, nodes=("A", "B"), groups=3, lease=6.0)
        new.wait_owned()
        done = mqks_cluster("status", "--json", "--cluster", name, "--log", ",".join(urls))
        assert done.returncode == 0, done.stderr
        rows = json.loads(done.stdout)
        assert [row["stream"] for row in rows] == [f"{name}-g3-s0-of-1"] * 3  # one stream the three groups share
        assert [row["name"] for row in rows] == [f"{name}-{g}-of-3" for g in range(3)]
        done = mqks_cluster("remove", "--groups", "3", "--cluster", name, "--log", ",".join(urls))
        assert done.returncode != 0 and "still owns" in done.stderr, (done.stdout, done.stderr)
    finally:
        old.stop()
        if new is not None:
            new.stop()


def test_a_node_without_groups_joins_with_the_count_its_cluster_has(shared_nats_cluster):
    """A node started without --groups takes its cluster's layout from NATS (2 groups in 2 streams here, neither
    the default), says so, runs its processes with it and is handed a group; a node with an explicit other --groups
    is still refused (test_a_cluster_name_reused_with_other_groups_is_refused_until_removed)."""
    _, urls = shared_nats_cluster
    name = unique("adopt").replace("-", "_")
    cluster = Cluster(name, urls, nodes=("A",), groups=2, lease=6.0, streams=2)
    try:
        cluster.wait_owned()
        joined = cluster.nodes["B"] = ClusterNode("B", "--cluster", name, "--lease", "6.0", "--eval", "--log",
                                                  ",".join(urls), "--node", "B", port=free_port())
        assert f"cluster {name} runs 2 groups in 2 streams: this node too" in joined.log(), joined.log()
        assert f"node B of cluster {name}: 2 slot groups in" in joined.log(), joined.log()
        assert sorted(cluster.wait_balanced().values()) == ["A", "B"]
    finally:
        cluster.stop()


def test_a_node_id_in_use_by_a_running_node_is_refused(shared_nats_cluster):
    """Two nodes started with one --node id would each count the other's groups as their own: the second refuses
    to start and names the node that answers as that id; once that node stopped, the id is free again."""
    _, urls = shared_nats_cluster
    name = unique("same_id").replace("-", "_")
    first = Cluster(name, urls, nodes=("A",), groups=2, lease=6.0)
    try:
        first.wait_owned()

        def start_another_a() -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "mqks.server", "--port", str(free_port()),
                                   *Cluster.args_for(name, 2, 6.0), "--log", ",".join(urls), "--node", "A"],
                                  capture_output=True, text=True, timeout=60)

        stray = start_another_a()
        assert stray.returncode == 1, stray.stderr
        assert f"node id 'A' is in use in cluster {name!r}: node A (" in stray.stderr, stray.stderr
        assert "answers for 2 of its groups; give this node another --node" in stray.stderr, stray.stderr
        first.stop()
        second = Cluster(name, urls, nodes=("A",), groups=2, lease=6.0)  # the same id, once free, starts

        def answered_by_second() -> bool:
            done = mqks_cluster("status", "--json", "--cluster", name, "--log", ",".join(urls))
            return done.returncode == 0 and all(row["answering"] == "A" for row in json.loads(done.stdout))
        try:
            wait_for(answered_by_second, "the second node A to answer for both groups", 90, interval=0.5)
        finally:
            second.stop()
    finally:
        first.stop()

"""The cluster as app.py's `Server` sees it (server/cluster/hooks.py, group.py): named hooks it calls unconditionally,
answered by `ClusterGroup` for a cluster's group and by `NoCluster`, which does nothing, for a broker without one
(issue 57: the Server asked `if self.cluster ...` in 27 places and wrote the log's `handoff_to` itself). In process:
a group over a fake stream log, its map over a fake bridge."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mqks.server.cluster.hooks import Cluster, NoCluster
from mqks.server.edges.config import Config
from mqks.server.workers.bindings_trust import Promises, Trusts

ROOT = Path(__file__).resolve().parents[3]
HOOKS = {name for name in Cluster.__dict__ if not name.startswith("_")} | set(Cluster.__annotations__)


def cluster_uses(source: str) -> list[str]:
    """How `source` (a Server) touches `self.cluster`: `.hook` for an attribute read of it, else the whole node's code
    (a test of it, a comparison, an argument passed on: the Server asking whether there is a cluster)."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "cluster" and ast.unparse(node.value) == "self":
            parent = parents[node]
            if isinstance(parent, ast.Attribute):
                uses.append(f".{parent.attr}")
            elif not isinstance(node.ctx, ast.Store):  # set once, at start: not a question
                uses.append(ast.unparse(parent))
    return uses


def test_the_server_asks_the_cluster_only_through_its_hooks():
    uses = cluster_uses((ROOT / "server" / "app.py").read_text(encoding="utf-8"))
    assert uses, "the check reads app.py's uses of self.cluster: none found"
    assert [use for use in uses if use.removeprefix(".") not in HOOKS or not use.startswith(".")] == []


def test_the_check_above_sees_a_server_asking_whether_it_is_in_a_cluster():
    asking = ("class S:\n    def f(self):\n        if self.cluster is not None:\n"
              "            self.cluster.serve(1, 2, 3)\n")
    assert cluster_uses(asking) == ["self.cluster is not None", ".serve"]
    assert cluster_uses("class S:\n    def f(self):\n        self.a, self.cluster = 1, 2\n") == []


def make_group(tmp_path: Path, tokens: Any = None) -> Any:
    pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")
    from mqks.server.cluster.group import ClusterGroup

    bridge = SimpleNamespace(spawn=lambda coroutine: None)
    stream_log = SimpleNamespace(bridge=bridge, owner="node a", wake=lambda: None, fenced_by=None, handoff_to=None,
                                 epoch=7, name="c-0-of-4")
    config = Config(cluster="c", node="a", workers=4, run_dir=str(tmp_path))
    return ClusterGroup(config, stream_log, lambda group: None, tokens=tokens, node_root_pid=42)  # type: ignore[arg-type]


def test_both_answer_every_hook(tmp_path):
    for cluster in (NoCluster(), make_group(tmp_path)):
        assert [hook for hook in sorted(HOOKS) if not hasattr(cluster, hook)] == []


def test_without_a_cluster_no_hook_does_anything():
    cluster = NoCluster()
    peers = SimpleNamespace(unit="worker", link_hello=b"- _link 0\n", worker=0)
    cluster.link(peers)  # type: ignore[arg-type]
    assert vars(peers) == {"unit": "worker", "link_hello": b"- _link 0\n", "worker": 0}
    assert cluster.hello_fields(4) == {} and cluster.owned_groups() is None and not cluster.hands_off()
    scope, labels, root_pid = cluster.node_figures()
    assert scope() is None and labels is None and root_pid is None
    assert cluster.link_tls is None and cluster.check_link_token is None
    assert not cluster.links_over_tcp and not cluster.shares_metrics_port
    replayed: list[bool] = []
    log = SimpleNamespace(replay=lambda repair=False: replayed.append(repair) or iter([b"r1"]))
    assert [r for batch in cluster.replay(log, True) for r in batch] == [b"r1"] and replayed == [True]  # type: ignore[arg-type]


def test_a_group_asked_for_marks_its_log_for_that_node_and_a_planned_stop_keeps_the_mark(tmp_path):
    group = make_group(tmp_path)
    assert not group.hands_off() and group.stream_log.handoff_to is None
    assert json.loads(group.hand_offs.answer("c-0-of-4", "b"))["ok"]
    assert group.hands_off() and group.stream_log.handoff_to == "b"
    group.stopping()
    assert group.stream_log.handoff_to == "b"


def test_a_planned_stop_lets_any_standby_take_over_unless_the_group_was_taken_over(tmp_path):
    group = make_group(tmp_path)
    group.stopping()
    assert group.stream_log.handoff_to == "*"
    fenced = make_group(tmp_path)
    fenced.stream_log.fenced_by = "node b"
    fenced.stopping()
    assert fenced.stream_log.handoff_to is None


def test_a_group_links_over_tcp_with_the_cluster_secret_and_checks_the_links_it_accepts(tmp_path):
    tokens = SimpleNamespace(cluster_secret=b"s3cret", tokens=[b"user"], check_link=lambda token: token == b"s3cret")
    group = make_group(tmp_path, tokens)
    peers = SimpleNamespace(worker=2, trusts=Trusts(4), promises=Promises(lambda group: None))
    group.link(peers)
    assert peers.unit == "group" and peers.link_hello == b"- _link 2 s3cret\n"
    # a lost link's bindings are trusted for a few leases, and the owner promises as long (bindings_trust.py)
    assert peers.trusts.seconds == peers.promises.seconds == 3 * group.config.lease_seconds > 0
    group.map.entries[1] = {"epoch": 5, "host": "10.0.0.2", "link_port": 7001}
    assert peers.owner_epoch(1) == 5 and peers.owner_epoch(3) is None
    assert peers.address_of(1) == group.map.address(1)
    assert group.check_link_token(b"s3cret") and not group.check_link_token(b"user")
    fields = group.hello_fields(2)
    assert (fields["cluster"], fields["node"]) == ("c", "a")
    assert [entry["epoch"] for entry in fields["direct"]] == [None, 5]
    scope, labels, root_pid = group.node_figures()
    assert scope() == [] and labels == {"cluster": "c", "node": "a"} and root_pid == 42


@pytest.mark.parametrize(("epoch", "promised"), [(1, {}), (7, {0: 5, 1: 5, 3: 5})])
def test_a_group_taken_over_promises_the_others_a_lease_and_its_first_owner_promises_nothing(tmp_path, epoch,
                                                                                              promised):
    """A router may route by the previous owner's bindings for a while (bindings_trust.py); the first owner of a group
    had no previous owner, so a fresh cluster binds at once (it refused "try again" until every group linked)."""
    group = make_group(tmp_path)
    group.stream_log.epoch = epoch
    peers = SimpleNamespace(worker=2, count=4, trusts=Trusts(4), promises=Promises(lambda group: 5))
    group.link(peers)
    group.group = 2
    group.serve(18000, 18001, None)
    assert {worker: its_epoch for worker, (until, its_epoch) in peers.promises.until.items()} == promised
    assert group.map.entries[2]["epoch"] == epoch

"""Hand-offs (server/cluster/election.py, map.py): a group's owner asked for its group by two nodes' standbys at once
(balancing) hands it to the first and tells the second no, so the second node's turn to pull ends at once instead of
after PULL_TURN_SECONDS (issue 40: a new three-node cluster spread its groups in 35 s, two of them spent waiting for
that turn); pins are read sparingly (an owner that handed its group over is silent: test_lease.py). In process."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")

from mqks.server.cluster.candidacy import Candidacy
from mqks.server.cluster.election import BALANCE_SECONDS, HandOffRequests
from mqks.server.cluster.map import WRITE_CHECK_SECONDS, ClusterMap, NodeDir

pytestmark = pytest.mark.timeout(10)


def test_the_first_node_to_ask_gets_the_group_and_the_next_is_told_where_it_goes():
    woken: list[str] = []
    hand_offs = HandOffRequests("a", "node a", lambda: woken.append("hub"))
    answers = [json.loads(hand_offs.answer("c-0-of-4", node)) for node in ("b", "c", "b")]  # b asks again: still its
    assert hand_offs.move_to == "b" and woken == ["hub"]
    assert [(answer["ok"], answer["to"]) for answer in answers] == [(True, "b"), (False, "b"), (True, "b")]
    assert json.loads(HandOffRequests("a", "node a", lambda: None).answer("c-0-of-4", "a"))["ok"] is False


def test_a_request_meant_for_another_owner_is_refused_and_hands_nothing_over():
    """Issue 56: after a heal, a standby whose map still named a group's old owner (8 groups) asked for it; the new
    owner (the healed node, 2 groups) handed it on. A request names the owner it was meant for; another refuses."""
    woken: list[str] = []
    hand_offs = HandOffRequests("c", "node c", lambda: woken.append("hub"))
    refused = json.loads(hand_offs.answer("c-0-of-4", "b a"))
    assert refused["ok"] is False and refused["owner"] == "c"
    assert hand_offs.move_to is None and woken == []
    assert json.loads(hand_offs.answer("c-0-of-4", "b c"))["ok"] is True and hand_offs.move_to == "b"


def test_the_owner_answers_a_request_on_nats_with_the_hand_offs_answer():
    """map.py's subscription: the request's node in, HandOffRequests' answer out on the reply subject."""
    subscribed: dict[str, object] = {}
    replies: list[tuple[str, dict]] = []

    async def subscribe(subject: str, cb: object) -> None:
        subscribed[subject] = cb

    async def publish(subject: str, data: bytes) -> None:
        replies.append((subject, json.loads(data)))

    nc = SimpleNamespace(subscribe=subscribe, publish=publish)
    spawned: list[object] = []
    bridge = SimpleNamespace(spawn=spawned.append)
    cluster_map = ClusterMap(bridge, Candidacy("c", "a", 0, lease_seconds=12.0), 3, lambda group: None)
    hand_offs = HandOffRequests("a", "node a", lambda: None)
    cluster_map.serve_hand_offs("c-0-of-4", hand_offs)

    async def scenario() -> None:
        await spawned[0](nc)  # type: ignore[operator]
        await subscribed["mqks.move.c-0-of-4"](SimpleNamespace(data=b"b", reply="r1"))  # type: ignore[operator]

    asyncio.run(scenario())
    assert hand_offs.move_to == "b" and replies == [("r1", {"ok": True, "from": "node a", "to": "b"})]


def test_a_nodes_turn_to_pull_is_one_at_a_time_and_ends_when_told(tmp_path):
    node_dir = NodeDir(str(tmp_path))
    assert node_dir.take_pull_turn()
    assert not node_dir.take_pull_turn()  # another standby of this node waits
    node_dir.end_pull_turn()  # the group went elsewhere
    assert node_dir.take_pull_turn()
    node_dir.owner_of(3)  # the group came: the turn is over, and the node owns one group more
    assert node_dir.owned() == 1 and node_dir.take_pull_turn()


def test_a_standby_reads_its_pin_again_only_when_old_or_about_to_ask():
    """A pin read is an API call on NATS: every 5 s for every standby was a quarter of an idle cluster's calls."""
    reads: list[str] = []

    def run(make, timeout: float = 10.0):
        reads.append("pin")
        return "b"

    bridge = SimpleNamespace(run=run)
    cluster_map = ClusterMap(bridge, Candidacy("c", "a", 1, lease_seconds=12.0), 3, lambda group: None)
    cluster_map.entries = {0: {"node": "b"}, 1: {"node": "b"}, 2: {"node": "c"}}
    assert cluster_map.balance_view(False) == ({"b": 2, "c": 1}, "b", "b")
    assert cluster_map.balance_view(False)[2] == "b" and len(reads) == 1  # the pin as read moments ago
    cluster_map.balance_view(True)  # about to ask for the group: read now
    assert len(reads) == 2
    cluster_map._pin_read_at -= 31  # as if 31 s had passed
    cluster_map.balance_view(False)
    assert len(reads) == 3


def test_a_put_to_the_map_that_the_bridge_stops_waiting_for_is_a_put_that_does_not_go_through():
    """Issue 56: after a heal, a standby's check that its put goes through waited ASK_SECONDS on the bridge, whose wait
    ends with gevent's Timeout (not an Exception): it went up through balance() and ended the group's standby, and
    its node's turn to pull, taken just before, was held until PULL_TURN_SECONDS had passed (the healed node got a
    group back 43 s after the heal). That put did not go through: the standby does not ask, and ends its turn."""
    import gevent.event

    waits: list[float] = []

    def run(make, timeout: float = 10.0):
        waits.append(timeout)
        return gevent.event.AsyncResult().get(timeout=0.01)  # the bridge's wait, as NatsBridge.run makes it

    cluster_map = ClusterMap(SimpleNamespace(run=run), Candidacy("c", "a", 1, lease_seconds=12.0), 3,
                             lambda group: None)
    assert cluster_map.can_write() is False and len(waits) == 1
    assert waits == [WRITE_CHECK_SECONDS] and WRITE_CHECK_SECONDS < BALANCE_SECONDS  # the next look is not held back

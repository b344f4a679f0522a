"""A group's owner asked for its group by two nodes' standbys at once (balancing) hands it to the first and tells
the second no, so the second node's turn to pull ends at once instead of after PULL_TURN_SECONDS (issue 40: a
new three-node cluster spread its groups in 35 s, two of them spent waiting for that turn). In process."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")

from mqks.server.journal.jetstream_log import Candidacy, JetStreamLog
from mqks.server.node.cluster import NodeDir

pytestmark = pytest.mark.timeout(10)


def test_the_first_node_to_ask_gets_the_group_and_the_next_is_told_where_it_goes():
    candidacy = Candidacy("c", "a", 0, lease_seconds=12.0)
    stream_log = JetStreamLog(["nats://127.0.0.1:1"], "c-0-of-4", "node a", candidacy=candidacy)
    replies: list[tuple[str, dict]] = []

    async def publish(subject: str, data: bytes) -> None:
        replies.append((subject, json.loads(data)))

    stream_log.bridge.nc = SimpleNamespace(publish=publish)

    async def ask(node: str, reply: str) -> None:
        await stream_log._on_move(SimpleNamespace(data=node.encode(), reply=reply))

    async def scenario() -> None:
        await ask("b", "r1")
        await ask("c", "r2")
        await ask("b", "r3")  # asked again (a retry): still its

    asyncio.run(scenario())
    assert stream_log.move_to == "b"
    assert [(subject, answer["ok"], answer["to"]) for subject, answer in replies] == [
        ("r1", True, "b"), ("r2", False, "b"), ("r3", True, "b")]


def test_a_nodes_turn_to_pull_is_one_at_a_time_and_ends_when_told(tmp_path):
    node_dir = NodeDir(str(tmp_path))
    assert node_dir.take_pull_turn()
    assert not node_dir.take_pull_turn()  # another standby of this node waits
    node_dir.end_pull_turn()  # the group went elsewhere
    assert node_dir.take_pull_turn()
    node_dir.owner_of(3)  # the group came: the turn is over, and the node owns one group more
    assert node_dir.owned() == 1 and node_dir.take_pull_turn()

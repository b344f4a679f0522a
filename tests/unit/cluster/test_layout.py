"""The layout a node runs, from the layouts its cluster's streams on NATS have (server/cluster/layout.py): without
--groups it takes the cluster's, a new cluster takes the default, and a conflict is refused with the flags that fit."""

from __future__ import annotations

import pytest

from mqks.common.cluster_names import Layout
from mqks.server.cluster.layout import chosen_layout
from mqks.server.edges.config import DEFAULT_GROUPS

pytestmark = pytest.mark.timeout(10)


def test_a_node_without_groups_takes_the_layout_its_cluster_has():
    assert chosen_layout({Layout(16, 1): ["demo-g16-s0-of-1"]}, "demo", None, 1) == Layout(16, 1)
    assert chosen_layout({Layout(5, 5): ["demo-0-of-5", "demo-1-of-5"]}, "demo", None, 1) == Layout(5, 5)
    assert chosen_layout({Layout(6, 2): ["demo-g6-s0-of-2"]}, "demo", None, 2) == Layout(6, 2)


def test_a_new_cluster_takes_the_default_group_count():
    assert chosen_layout({}, "demo", None, 1) == Layout(DEFAULT_GROUPS, 1)
    assert chosen_layout({}, "demo", 3, 1) == Layout(3, 1)


def test_explicit_groups_that_differ_from_the_cluster_are_refused_with_the_flags_that_fit():
    reason = chosen_layout({Layout(16, 1): ["demo-g16-s0-of-1"]}, "demo", 4, 1)
    assert isinstance(reason, str)
    assert "cluster 'demo' already has 16 groups in 1 stream on this NATS" in reason
    assert "start it with --groups 16 --streams 1 (or without --groups" in reason
    assert chosen_layout({Layout(16, 1): ["demo-g16-s0-of-1"]}, "demo", 16, 1) == Layout(16, 1)


def test_without_groups_two_layouts_or_other_streams_are_refused():
    two = chosen_layout({Layout(16, 1): ["demo-g16-s0-of-1"], Layout(4, 1): ["demo-g4-s0-of-1"]}, "demo", None, 1)
    assert isinstance(two, str) and "4 groups in 1 stream (demo-g4-s0-of-1 ...); 16 groups in 1 stream" in two, two
    assert "started without --groups: give it the --groups and --streams" in two
    streams = chosen_layout({Layout(16, 1): ["demo-g16-s0-of-1"]}, "demo", None, 2)
    assert isinstance(streams, str) and "without --groups and with --streams 2" in streams, streams


def test_without_groups_a_node_asks_nats_again_until_it_answers_and_never_guesses(monkeypatch):
    from mqks.common.nats_urls import NatsAccess
    from mqks.server.cluster import layout

    asked: list[str] = []

    async def unreachable_once(urls, cluster, node, access):
        asked.append(cluster)
        if len(asked) == 1:
            raise OSError("nats: no servers available for connection")
        return {Layout(16, 1): ["demo-g16-s0-of-1"]}, []

    monkeypatch.setattr(layout, "layouts_on_nats", unreachable_once)
    monkeypatch.setattr(layout, "ASK_AGAIN_SECONDS", 0.0)
    assert layout.check_layout(["nats://x:4222"], "demo", None, 1, "a", NatsAccess()) == Layout(16, 1)
    assert len(asked) == 2  # the default (4) was never taken while NATS could not say

    async def unreachable(urls, cluster, node, access):
        raise OSError("nats: no servers available for connection")

    monkeypatch.setattr(layout, "layouts_on_nats", unreachable)
    assert layout.check_layout(["nats://x:4222"], "demo", 8, 1, "a", NatsAccess()) == Layout(8, 1)  # given: starts
    stopped = layout.check_layout(["nats://x:4222"], "demo", None, 1, "a", NatsAccess(), stopping=lambda: True)
    assert isinstance(stopped, str)

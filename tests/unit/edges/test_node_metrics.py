"""A cluster node's /metrics speaks for the node (server/edges/metrics.py, server/cluster/map.py's NodeDir): the groups
it owns are the run dir's `owns-g` files, and its process figures are summed over the supervisor and every process
under it. In process, on this test's own process tree."""

from __future__ import annotations

import os

import pytest

from mqks.server.cluster.map import NodeDir
from mqks.server.edges.metrics import NodeProcessCollector, process_tree

pytestmark = pytest.mark.timeout(10)


def test_the_groups_a_node_owns_are_its_owner_files(tmp_path):
    node_dir = NodeDir(str(tmp_path))
    assert node_dir.owned_groups() == []
    for group in (11, 3, 7):
        (tmp_path / f"owns-{group}").write_text("1")
    (tmp_path / "pull-turn").write_text("")
    assert node_dir.owned_groups() == [3, 7, 11]
    assert node_dir.owned() == 3


def test_the_node_figures_read_the_process_tree_from_proc():
    """Summing over several processes is the cluster tier's (test_cluster_clients.py); here the one process."""
    assert process_tree(os.getpid())[0] == os.getpid()
    samples = {metric.name: metric.samples[0].value for metric in NodeProcessCollector(os.getpid()).collect()}
    with open("/proc/self/statm", encoding="ascii") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert 0.5 * resident < samples["process_resident_memory_bytes"] < 2 * resident
    assert samples["process_open_fds"] >= 3  # stdin, stdout, stderr at least
    assert samples["process_cpu_seconds"] > 0
    assert process_tree(2**22 + 12345) == [2**22 + 12345]  # no such process: itself, and nothing under it

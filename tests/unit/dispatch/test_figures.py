"""The figures table (server/dispatch/figures.py): every key a process's `stats` answers is named there, exported to
Prometheus by its kind, and merged over workers by its rule. In process: a Process with no socket, answers as
JSON lines."""

from __future__ import annotations

import json

import pytest
from prometheus_client.core import CounterMetricFamily

from mqks.common.figures import ANY, FIGURES, LOG_FIGURES, OWN, THIS, merge_log_stats, merge_stats, ranked
from mqks.server.dispatch.process import Process
from mqks.server.edges.metrics import StatsCollector

pytestmark = pytest.mark.timeout(10)


def answer(figures: dict) -> bytes:
    return b"s ok " + json.dumps(figures).encode()


def test_every_key_a_process_answers_is_named_in_the_table():
    assert set(Process().stats()) - set(FIGURES) == set()


def test_every_figure_says_what_it_is_and_every_label_is_unique():
    for key, figure in {**FIGURES, **LOG_FIGURES}.items():
        assert figure.help.endswith((".", ")")) and figure.kind in (None, "counter", "gauge"), key
    labels = [figure.label for figure in FIGURES.values() if figure.label]
    assert len(labels) == len(set(labels))


def test_every_numeric_figure_is_exported_by_its_kind():
    process = Process()
    process.broker.published = 7  # a counter with a value: mqks_published_total 7
    families = {family.name: family for family in StatsCollector(process, max_queues=10).collect()}
    exported = {key for key, figure in FIGURES.items() if figure.kind is not None}
    numeric = {key for key, value in process.stats().items() if isinstance(value, int | float)}
    assert {f"mqks_{key}" for key in exported & numeric} <= set(families)
    published = families["mqks_published"]
    assert isinstance(published, CounterMetricFamily) and published.samples[0].value == 7


def test_counts_are_summed_flags_ored_and_a_workers_own_figures_left_out():
    local = {"published": 3, "queued": 5, "memory_full": False, "uptime_seconds": 10.0, "version": "1.0",
             "worker": 0, "pid": 100, "dropped": 1, "dropped_unlinked": 2, "top_queues": [["a", 5], ["b", 1]],
             "top_leased_queues": []}
    other = {"published": 4, "queued": 6, "memory_full": True, "uptime_seconds": 11.0, "version": "1.0",
             "worker": 1, "pid": 101, "dropped": 0, "dropped_unlinked": 3, "top_queues": [["c", 9]],
             "top_leased_queues": [["d", 2]]}
    merged = merge_stats([answer(other)], local, events=4)
    assert (merged["published"], merged["queued"], merged["memory_full"]) == (7, 11, True)
    assert (merged["uptime_seconds"], merged["version"], merged["workers"], merged["events"]) == (10.0, "1.0", 2, 4)
    assert "worker" not in merged and "pid" not in merged  # one worker's own
    assert merged["dropped"] == 1 + 2 + 3  # copies for a restarting worker count as dropped
    assert merged["top_queues"] == [["c", 9], ["a", 5], ["b", 1]] and merged["top_leased_queues"] == [["d", 2]]


def test_the_merge_rules_are_the_ones_the_table_names():
    assert FIGURES["memory_full"].merge == ANY and FIGURES["uptime_seconds"].merge == THIS
    assert FIGURES["pid"].merge == OWN and FIGURES["published"].merge == "sum"


def test_log_figures_add_sizes_keep_the_worst_latency_and_name_each_stream_once():
    merged = merge_log_stats([
        {"log_bytes": 100, "fsync_ms_p99": 2.5, "disk_full": False, "stream": "s-0", "epoch": 3},
        {"log_bytes": 50, "fsync_ms_p99": 9.0, "disk_full": True, "stream": "s-1", "epoch": 1},
        {"log_bytes": 1, "fsync_ms_p99": 1.0, "disk_full": False, "stream": "s-1", "epoch": 2}])
    assert merged == {"log_bytes": 151, "fsync_ms_p99": 9.0, "disk_full": True, "stream": "s-0, s-1", "epoch": 3}


def test_ranked_keeps_the_largest_first_and_ties_in_order():
    rows = [("a", 1), ("b", 5), ("c", 5), ("d", 0)]
    assert ranked(rows, limit=3) == [("b", 5), ("c", 5), ("a", 1)]

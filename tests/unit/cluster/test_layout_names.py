"""A cluster's names on NATS (common/cluster_names.py): each layout's stream names are read back as that layout and
the groups they hold, and never as another cluster's or another layout's."""

from __future__ import annotations

import pytest

from mqks.common.cluster_names import Layout, group_count_of, group_name, layout_of, log_subject

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("layout", [Layout(16, 1), Layout(16, 3), Layout(4, 2), Layout(16, 16), Layout(1, 1)])
@pytest.mark.parametrize("cluster", ["demo", "demo-g16", "a-1"])
def test_every_group_is_in_exactly_one_stream_whose_name_reads_back_as_the_layout(cluster, layout):
    streams: dict[str, list[int]] = {}
    for group in range(layout.groups):
        streams.setdefault(layout.stream_of(cluster, group), []).append(group)
    assert len(streams) == layout.streams
    for stream, groups in streams.items():
        assert layout_of(stream, cluster) == (layout, groups)
        subjects = layout.subjects_of(cluster, groups[0])
        assert subjects == [log_subject(group_name(cluster, group, layout.groups)) for group in groups]
        for other in ("demo", "demo-g16", "a-1", "a"):
            if other != cluster:
                assert layout_of(stream, other) is None


@pytest.mark.parametrize("stream", ["KV_mqks-demo", "demo", "demo-a-of-4", "demo-g16-s1-of-1", "demo-g16-s0-of-16",
                                    "demo-gx-s0-of-2", "demo-g16-0-of-2"])
def test_other_streams_are_no_layout_of_the_cluster(stream):
    """A stream index past the count, a stream count not below the group count, or no number: not ours."""
    assert layout_of(stream, "demo") is None


@pytest.mark.parametrize("stream, cluster, expected", [
    ("demo-3-of-16", "demo", (3, 16)), ("demo-x-3-of-16", "demo-x", (3, 16)), ("demo-x-3-of-16", "demo", None),
    ("KV_mqks-demo", "demo", None), ("demo", "demo", None), ("demo-a-of-4", "demo", None),
    ("demo-g16-s0-of-1", "demo", None)])
def test_a_stream_of_one_group_is_read_as_its_group_and_group_count(stream, cluster, expected):
    """The layout check and status tell a cluster's streams of one group (and their --groups) from every other."""
    assert group_count_of(stream, cluster) == expected

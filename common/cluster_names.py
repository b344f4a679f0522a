"""The names a cluster (and a broker of several workers) gives its things on NATS: one stream per slot group,
`NAME-g-of-N`, and one key-value bucket, `mqks-NAME` (owners' entries, pins, standby reports)."""

from __future__ import annotations


def stream_of(name: str, group: int, groups: int) -> str:
    """The stream of slot group `group` of `groups`."""
    return f"{name}-{group}-of-{groups}"


def group_count_of(stream: str, cluster: str) -> tuple[int, int] | None:
    """(group, groups) of a cluster's stream name `CLUSTER-g-of-N`; None for any other stream."""
    prefix, _, size = stream.rpartition("-of-")
    name, _, group = prefix.rpartition("-")
    if name != cluster or not size.isdigit() or not group.isdigit():
        return None
    return int(group), int(size)


def bucket_of(cluster: str) -> str:
    """The cluster's key-value bucket."""
    return f"mqks-{cluster}"

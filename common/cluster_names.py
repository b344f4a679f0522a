"""The names a cluster (and a broker of several workers) gives its things on NATS.

A slot group is named `NAME-g-of-N`: its log is the subject `mqks.log.NAME-g-of-N`, its owner answers on
`mqks.owner.NAME-g-of-N`. The groups' subjects live in `--streams S` JetStream streams: group g in stream g % S,
named `NAME-gN-sI-of-S`. With S = N (and in clusters made before streams were shared) each group has a stream of
its own, named as the group. One key-value bucket, `mqks-NAME`, holds owners' entries, pins and standby
reports."""

from __future__ import annotations

from typing import NamedTuple


class Layout(NamedTuple):
    """How a cluster's groups sit in streams: `groups` groups in `streams` streams."""

    groups: int
    streams: int

    @property
    def shared(self) -> bool:
        """Several groups to a stream: each group's frames are fenced by its subject's last sequence."""
        return self.streams < self.groups

    def stream_of(self, name: str, group: int) -> str:
        if not self.shared:
            return group_name(name, group, self.groups)
        return f"{name}-g{self.groups}-s{group % self.streams}-of-{self.streams}"

    def groups_in(self, stream_index: int) -> list[int]:
        return list(range(stream_index, self.groups, self.streams))

    def subjects_of(self, name: str, group: int) -> list[str]:
        """Every subject of the stream `group` is in."""
        return [log_subject(group_name(name, g, self.groups)) for g in self.groups_in(group % self.streams)]


def group_name(name: str, group: int, groups: int) -> str:
    """Slot group `group` of `groups`: its subjects say this; so does the stream of one group alone."""
    return f"{name}-{group}-of-{groups}"


def stream_of(name: str, group: int, groups: int) -> str:
    """The stream of a worker (or a group) with a stream of its own."""
    return group_name(name, group, groups)


def log_subject(name: str) -> str:
    return f"mqks.log.{name}"


def group_count_of(stream: str, cluster: str) -> tuple[int, int] | None:
    """(group, groups) of a cluster's stream of one group, `CLUSTER-g-of-N`; None for any other stream."""
    prefix, _, size = stream.rpartition("-of-")
    name, _, group = prefix.rpartition("-")
    if name != cluster or not size.isdigit() or not group.isdigit():
        return None
    return int(group), int(size)


def layout_of(stream: str, cluster: str) -> tuple[Layout, list[int]] | None:
    """The layout a stream of `cluster` belongs to, and the groups it holds; None for any other stream."""
    alone = group_count_of(stream, cluster)
    if alone is not None:
        group, groups = alone
        return Layout(groups, groups), [group]
    prefix, _, size = stream.rpartition("-of-")
    rest, _, index = prefix.rpartition("-s")
    name, _, groups_part = rest.rpartition("-g")
    if name != cluster or not (size.isdigit() and index.isdigit() and groups_part.isdigit()):
        return None
    layout = Layout(int(groups_part), int(size))
    if not layout.shared or int(index) >= layout.streams:
        return None
    return layout, layout.groups_in(int(index))


def bucket_of(cluster: str) -> str:
    """The cluster's key-value bucket."""
    return f"mqks-{cluster}"

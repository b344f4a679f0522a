"""A node's start-up checks against what NATS already holds: the cluster's layout (its group and stream counts),
which a node started without --groups adopts, and node ids in use. Run once, by the node's supervisor, before any
of its processes starts; they get the layout on their command line."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ...common.cluster_names import Layout, group_name, layout_of
from ...common.nats_urls import NatsAccess, nats_access, quiet_tls_noise
from ..edges.config import DEFAULT_GROUPS, DEFAULTS, Config

log = logging.getLogger("mqks.cluster")

ASK_AGAIN_SECONDS = 2.0  # a node without --groups waits for NATS to say its cluster's layout


async def layouts_on_nats(urls: list[str], cluster: str, node: str | None, access: NatsAccess
                          ) -> tuple[dict[Layout, list[str]], list[dict[str, Any]]]:
    """The cluster's streams already on NATS, by the layout their names say; and, given a `node` id, the running
    owners that answer for its groups under that id (another live node started with it)."""
    import nats

    async def on_error(e: BaseException) -> None:  # nats-py's default logs a traceback per attempt; the caller says
        pass

    quiet_tls_noise()
    nc = await nats.connect(servers=urls, connect_timeout=5, max_reconnect_attempts=1, error_cb=on_error,
                            **access.connect_options(urls))
    try:
        layouts: dict[Layout, list[str]] = {}
        groups: list[str] = []
        for info in await nc.jetstream(timeout=5).streams_info():
            name = info.config.name or ""
            found = layout_of(name, cluster)
            if found is not None:
                layouts.setdefault(found[0], []).append(name)
                groups += [group_name(cluster, group, found[0].groups) for group in found[1]]
        if node is None:
            return layouts, []

        async def owner_of(group: str) -> dict[str, Any] | None:
            try:
                answer = await nc.request(f"mqks.owner.{group}", b"", timeout=1.0)
                return dict(json.loads(answer.data))
            except Exception:  # nobody answers (no owner, or a paused one): nothing to say about the id
                return None

        owners = await asyncio.gather(*(owner_of(group) for group in groups))
        return layouts, [owner for owner in owners if owner is not None and owner.get("node") == node]
    finally:
        await nc.close()


def check_layout(urls: list[str], cluster: str, groups: int | None, streams: int, node: str | None,
                 access: NatsAccess, stopping: Callable[[], bool] = lambda: False) -> Layout | str:
    """The layout a node of `cluster` runs (`groups` None: the one its streams on NATS already have, or the default
    for a new cluster), or why it must not start on this NATS: its streams were made with another --groups or
    --streams (nodes of each layout would take the same groups over, each in its own stream), or a running node
    already answers as `node` (two nodes with one id would each count the other's groups as their own). With
    --groups given and NATS out of reach, that layout (the group processes wait for NATS); without it, NATS is asked
    again until it answers or `stopping()`: a guess could split the cluster in two layouts."""
    while True:
        try:
            layouts, same_id = asyncio.run(layouts_on_nats(urls, cluster, node, access))
            break
        except Exception as e:
            if groups is not None:
                log.warning("cannot check cluster %s's group count on NATS now (%s); starting", cluster, e)
                return Layout(groups, streams)
            if stopping():
                return "stopped before NATS said the cluster's group count"
            log.warning("cannot read cluster %s's group count on NATS (%s), and --groups is not given; asking again "
                        "in %g s", cluster, e, ASK_AGAIN_SECONDS)
            time.sleep(ASK_AGAIN_SECONDS)
    if same_id:
        return (f"node id {node!r} is in use in cluster {cluster!r}: {same_id[0].get('owner', '?')} answers for "
                f"{len(same_id)} of its groups; give this node another --node, or stop that one first")
    return chosen_layout(layouts, cluster, groups, streams)


def chosen_layout(layouts: dict[Layout, list[str]], cluster: str, groups: int | None, streams: int) -> Layout | str:
    """The layout a node runs given the layouts of `cluster`'s streams on NATS, or why it must not start: `groups`
    None takes the one layout there (with --streams left at its default or equal to it), or DEFAULT_GROUPS in
    `streams` streams for a cluster with none."""
    if groups is None:
        if not layouts:
            return Layout(DEFAULT_GROUPS, streams)
        if len(layouts) == 1 and streams in (DEFAULTS.streams, next(iter(layouts)).streams):
            return next(iter(layouts))
        shown = "; ".join(f"{found.groups} groups in {_streams(found)} ({', '.join(sorted(layouts[found])[:2])} ...)"
                          for found in sorted(layouts))
        return (f"cluster {cluster!r} has {shown} on this NATS, and this node was started without --groups"
                f"{'' if streams == DEFAULTS.streams else f' and with --streams {streams}'}: give it the --groups and "
                f"--streams of the layout the cluster runs, or remove the other (mqks cluster remove --cluster "
                f"{cluster} --groups N --log ...)")
    layout = Layout(groups, streams)
    others = sorted(found for found in layouts if found != layout)
    if not others:
        return layout
    found = others[0]
    return (f"cluster {cluster!r} already has {found.groups} groups in {_streams(found)} on this NATS "
            f"(streams {', '.join(sorted(layouts[found])[:2])} ...), and this node was started with --groups "
            f"{layout.groups} --streams {layout.streams}: start it with --groups {found.groups} --streams "
            f"{found.streams} (or without --groups: a node takes the count its cluster has), or give this cluster "
            f"another --cluster name, or remove the old cluster first (mqks cluster remove --cluster {cluster} "
            f"--groups {found.groups} --log ...)")


def _streams(layout: Layout) -> str:
    return f"{layout.streams} stream{'' if layout.streams == 1 else 's'}"


def node_settings(config: Config, argv: list[str], stopping: Callable[[], bool]) -> tuple[Config, list[str]]:
    """A node's supervisor: `config` and its processes' command line with the layout it runs (the cluster's own
    when --groups is not given), and its processes at most one per group; SystemExit(1) when it must not start."""
    assert config.cluster is not None
    found = check_layout(config.log_urls, config.cluster, config.groups, config.streams, config.node,
                         nats_access(config), stopping)
    if isinstance(found, str):
        log.error("cannot start: %s", found)
        raise SystemExit(1)
    if config.groups is None:
        log.info("cluster %s runs %d groups in %s: this node too", config.cluster, found.groups, _streams(found))
    processes = min(config.processes, found.groups)
    adopted = replace(config, groups=found.groups, workers=found.groups, streams=found.streams, processes=processes)
    return adopted, [*argv, "--groups", str(found.groups), "--streams", str(found.streams), "--processes",
                     str(processes)]

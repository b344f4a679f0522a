"""A node's start-up checks against what NATS already holds: the cluster's layout (its group and stream counts),
and node ids in use."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from ...common.cluster_names import Layout, group_name, layout_of
from ...common.nats_urls import NatsAccess, quiet_tls_noise

log = logging.getLogger("mqks.cluster")


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


def check_layout(urls: list[str], cluster: str, layout: Layout, node: str | None, access: NatsAccess) -> str | None:
    """Why a node of `cluster` with `layout` must not start on this NATS: its streams were made with another
    --groups or --streams (nodes of each layout would take the same groups over, each in its own stream), or a
    running node already answers as `node` (two nodes with one id would each count the other's groups as their
    own). None when it may, or when NATS cannot be asked now (the group processes wait for it)."""
    try:
        layouts, same_id = asyncio.run(layouts_on_nats(urls, cluster, node, access))
    except Exception as e:
        log.warning("cannot check cluster %s's group count on NATS now (%s); starting", cluster, e)
        return None
    if same_id:
        return (f"node id {node!r} is in use in cluster {cluster!r}: {same_id[0].get('owner', '?')} answers for "
                f"{len(same_id)} of its groups; give this node another --node, or stop that one first")
    others = sorted(found for found in layouts if found != layout)
    if not others:
        return None
    found = others[0]
    streams = f"{found.streams} stream{'' if found.streams == 1 else 's'}"
    return (f"cluster {cluster!r} already has {found.groups} groups in {streams} on this NATS "
            f"(streams {', '.join(sorted(layouts[found])[:2])} ...), and this node was started with --groups "
            f"{layout.groups} --streams {layout.streams}: start it with --groups {found.groups} --streams "
            f"{found.streams}, or give this cluster another --cluster name, or remove the old cluster first (mqks "
            f"cluster remove --cluster {cluster} --groups {found.groups} --log ...)")

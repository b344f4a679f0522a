"""A node's start-up checks against what NATS already holds: the cluster's group count, and node ids in use."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from ...common.cluster_names import group_count_of
from ...common.nats_urls import NatsAccess, quiet_tls_noise

log = logging.getLogger("mqks.cluster")


async def layouts_on_nats(urls: list[str], cluster: str, node: str | None = None, access: NatsAccess | None = None,
                          ) -> tuple[dict[int, list[str]], list[dict[str, Any]]]:
    """The cluster's streams already on NATS, by the group count in their names; and, given a `node` id, the
    running owners that answer for its streams under that id (another live node started with it)."""
    import nats

    async def on_error(e: BaseException) -> None:  # nats-py's default logs a traceback per attempt; the caller says
        pass

    quiet_tls_noise()
    nc = await nats.connect(servers=urls, connect_timeout=5, max_reconnect_attempts=1, error_cb=on_error,
                            **(access or NatsAccess()).connect_options(urls))
    try:
        layouts: dict[int, list[str]] = {}
        for info in await nc.jetstream(timeout=5).streams_info():
            name = info.config.name or ""
            found = group_count_of(name, cluster)
            if found is not None:
                layouts.setdefault(found[1], []).append(name)
        if node is None:
            return layouts, []

        async def owner_of(stream: str) -> dict[str, Any] | None:
            try:
                answer = await nc.request(f"mqks.owner.{stream}", b"", timeout=1.0)
                return dict(json.loads(answer.data))
            except Exception:  # nobody answers (no owner, or a paused one): nothing to say about the id
                return None

        streams = [name for names in layouts.values() for name in names]
        owners = await asyncio.gather(*(owner_of(stream) for stream in streams))
        return layouts, [owner for owner in owners if owner is not None and owner.get("node") == node]
    finally:
        await nc.close()


def check_layout(urls: list[str], cluster: str, groups: int, node: str | None = None,
                 access: NatsAccess | None = None) -> str | None:
    """Why a node of `cluster` with `groups` groups must not start on this NATS: its streams were made with
    another --groups (two layouts would share one name, and nodes of each would take the other's groups over),
    or a running node already answers as `node` (two nodes with one id would each count the other's groups as
    their own). None when it may, or when NATS cannot be asked now (the group processes wait for it)."""
    try:
        layouts, same_id = asyncio.run(layouts_on_nats(urls, cluster, node, access))
    except Exception as e:
        log.warning("cannot check cluster %s's group count on NATS now (%s); starting", cluster, e)
        return None
    if same_id:
        return (f"node id {node!r} is in use in cluster {cluster!r}: {same_id[0].get('owner', '?')} answers for "
                f"{len(same_id)} of its groups; give this node another --node, or stop that one first")
    others = sorted(count for count in layouts if count != groups)
    if not others:
        return None
    found = others[0]
    return (f"cluster {cluster!r} already has {found} groups on this NATS (streams {cluster}-0-of-{found} ...), "
            f"and this node was started with --groups {groups}: start it with --groups {found}, or give this "
            f"cluster another --cluster name, or remove the old cluster first (mqks cluster remove --cluster "
            f"{cluster} --groups {found} --log ...)")

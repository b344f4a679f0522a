"""The operator's view of a cluster (`mqks cluster status|move|unpin|remove`): read from NATS, the groups'
streams and the cluster's bucket, never from a broker; a move pins the group and asks its owner to hand it over.
The nodes write what this reads (server/cluster/map.py)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from mqks.common.cluster_names import bucket_of, group_count_of
from mqks.common.nats_urls import NatsAccess, quiet_tls_noise, shown

STANDBY_WAIT_SECONDS = 20.0  # `mqks cluster move` waits this long for the target node's standby to report
# a standby reports every 10 s (server/cluster/election.py); silent for three reports, status calls it down
STANDBY_DOWN_SECONDS = 30.0


async def connect(urls: list[str], access: NatsAccess | None) -> Any:
    """A short-lived connection for one command: one reconnect attempt, the operator's TLS files and credentials.
    OSError with what NATS said (Authorization Violation, a certificate problem) when it cannot be made."""
    import nats

    quiet_tls_noise()
    options = (access or NatsAccess()).connect_options(urls)
    said: list[BaseException] = []

    async def on_error(e: BaseException) -> None:  # nats-py's default logs a traceback per attempt
        said.append(e)

    try:
        return await nats.connect(servers=urls, connect_timeout=5, max_reconnect_attempts=1, error_cb=on_error,
                                  **options)
    except Exception as e:
        cause = said[0] if said else e
        raise OSError(f"cannot reach NATS at {shown(urls)}: {type(cause).__name__}: {cause}") from None


async def read_bucket(js: Any, bucket: str, keys: str = ">") -> dict[str, bytes]:
    """Every live key of `bucket` matching `keys` and its value, read without a consumer: the stream's subjects,
    then a direct get each (nats-py's `keys()` makes a consumer that NATS keeps for 300 s after each call, so a
    script reading the status every few seconds filled the bucket's consumer limit). Raises what NATS raises:
    a read that fails is an error, never an empty map."""
    from nats.js.errors import KeyNotFoundError

    prefix = f"$KV.{bucket}."
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=prefix + keys)
    kv = await js.key_value(bucket)
    values = {}
    for subject in sorted(info.state.subjects or {}):
        key = subject[len(prefix):]
        try:
            values[key] = (await kv.get(key)).value or b""
        except KeyNotFoundError:  # deleted (KeyDeletedError), or purged since the listing
            continue
    return values


async def read_cluster(urls: list[str], cluster: str, access: NatsAccess | None = None) -> list[dict[str, Any]]:
    """One row per slot group: its stream, the NATS leader, the owner the map names and the one that answers its
    ping, and each standby's lag behind the stream's last sequence."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.errors import BucketNotFoundError

    nc = await connect(urls, access)
    try:
        js = nc.jetstream(timeout=5)
        streams = {}
        layouts: set[int] = set()
        for info in await js.streams_info():
            found = group_count_of(info.config.name or "", cluster)
            if found is not None:
                streams[found[0]] = info
                layouts.add(found[1])
        if len(layouts) > 1:
            raise ValueError(f"cluster {cluster!r} has streams of {len(layouts)} group counts on this NATS "
                             f"({', '.join(map(str, sorted(layouts)))} groups): remove the one no node runs "
                             f"(mqks cluster remove --cluster {cluster} --groups N --log ...)")
        entries: dict[str, dict[str, Any]] = {}
        pins: dict[int, str] = {}
        try:
            values = await read_bucket(js, bucket_of(cluster))
        except BucketNotFoundError:
            if not streams:
                raise ValueError(f"no cluster {cluster!r} on NATS at {shown(urls)}") from None
            values = {}  # streams and no bucket: no owner has put its entry yet
        for key, value in values.items():
            if key.startswith("pin."):
                pins[int(key.partition(".")[2])] = value.decode()
                continue
            try:
                entries[key] = json.loads(value or b"{}")
            except ValueError:
                continue
        rows = []
        for group, info in sorted(streams.items()):
            try:
                answer = await nc.request(f"mqks.owner.{info.config.name}", b"", timeout=1.0)
                answering = json.loads(answer.data)
            except (NoRespondersError, NatsTimeout, ValueError):
                answering = None
            last_seq = int(info.state.last_seq)
            standbys = []
            for key, report in entries.items():
                if key.startswith(f"standby.{group}."):
                    seen_ago = round(time.time() - float(report.get("at", 0)), 1)
                    standbys.append({"node": report.get("node"), "lag": max(0, last_seq - int(report.get("seq", 0))),
                                     "seen_seconds_ago": seen_ago, "down": seen_ago > STANDBY_DOWN_SECONDS})
            standbys.sort(key=lambda standby: str(standby["node"]))
            owner = entries.get(f"owner.{group}", {})
            rows.append({"group": group, "stream": info.config.name,
                         "leader": (info.cluster.leader if info.cluster is not None else None),
                         "last_seq": last_seq, "messages": info.state.messages, "bytes": info.state.bytes,
                         "owner": owner.get("node"), "epoch": owner.get("epoch"),
                         "address": f"{owner.get('host')}:{owner.get('port')}" if owner else None,
                         "answering": (answering or {}).get("node"), "pinned": pins.get(group),
                         "standbys": [s for s in standbys if s["node"] != (answering or owner).get("node")]})
        return rows
    finally:
        await nc.close()


async def remove_cluster(urls: list[str], cluster: str, groups: int, access: NatsAccess | None = None) -> list[str]:
    """Delete the cluster's streams of `groups` groups, and its bucket once none of its streams is left; the
    streams deleted. ValueError while one of those groups has an owner that answers: its node still runs."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.errors import NotFoundError

    nc = await connect(urls, access)
    try:
        js = nc.jetstream(timeout=5)
        doomed: list[str] = []
        kept: list[str] = []
        for info in await js.streams_info():
            name = info.config.name or ""
            found = group_count_of(name, cluster)
            if found is not None:
                (doomed if found[1] == groups else kept).append(name)
        for name in sorted(doomed):
            try:
                answer = await nc.request(f"mqks.owner.{name}", b"", timeout=1.0)
            except (NoRespondersError, NatsTimeout):
                continue
            node = json.loads(answer.data).get("node", "?") if answer.data else "?"
            raise ValueError(f"node {node} still owns {name}: stop that cluster's nodes first")
        for name in sorted(doomed):
            await js.delete_stream(name)
        if doomed and not kept:
            try:
                await js.delete_key_value(bucket_of(cluster))
            except NotFoundError:
                pass
        return sorted(doomed)
    finally:
        await nc.close()


async def unpin_groups(urls: list[str], cluster: str, groups: list[int], access: NatsAccess | None = None) -> list[int]:
    """Let the nodes balance `groups` (every pinned group when empty) again; the groups that were pinned."""

    nc = await connect(urls, access)
    try:
        js = nc.jetstream(timeout=5)
        kv = await js.key_value(bucket_of(cluster))
        pinned = [int(key.partition(".")[2]) for key in await read_bucket(js, bucket_of(cluster), "pin.*")]
        unpinned = [group for group in pinned if not groups or group in groups]
        for group in unpinned:
            await kv.delete(f"pin.{group}")
        return sorted(unpinned)
    finally:
        await nc.close()


async def move_group(urls: list[str], cluster: str, group: int, node: str, timeout: float = 60.0,
                     access: NatsAccess | None = None) -> dict[str, Any]:
    """Pin `group` to `node` (a standby of it), ask its owner to hand it over, and wait until the map names that
    node."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    deadline = time.monotonic() + STANDBY_WAIT_SECONDS
    while True:  # a node's process that just gave the group up stands by again within seconds
        rows = {row["group"]: row for row in await read_cluster(urls, cluster, access)}
        row = rows.get(group)
        if row is None:
            raise ValueError(f"cluster {cluster!r} has no group {group} (groups: {sorted(rows)})")
        if row["answering"] == node and row["owner"] == node:
            return row
        if node in {standby["node"] for standby in row["standbys"]}:
            break
        if time.monotonic() > deadline:
            raise ValueError(f"node {node!r} does not stand by for group {group} (standbys: "
                             f"{', '.join(str(s['node']) for s in row['standbys']) or 'none'})")
        await asyncio.sleep(0.5)
    nc = await connect(urls, access)
    try:
        # pinned: no node's balancing pulls it elsewhere, and it comes back here after a failover
        kv = await nc.jetstream(timeout=5).key_value(bucket_of(cluster))
        await kv.put(f"pin.{group}", node.encode())
        try:
            await nc.request(f"mqks.move.{row['stream']}", node.encode(), timeout=5)
        except (NoRespondersError, NatsTimeout):
            raise ValueError(f"group {group} has no owner that answers: a standby takes it over after the lease") \
                from None
    finally:
        await nc.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        row = {r["group"]: r for r in await read_cluster(urls, cluster, access)}[group]
        if row["answering"] == node and row["owner"] == node:
            return row
    raise TimeoutError(f"group {group} is not owned by node {node} after {timeout:g} s")

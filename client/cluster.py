"""The operator's view of a cluster (`mqks cluster status|move|unpin|remove`): read from NATS, the groups'
subjects in their streams and the cluster's bucket, never from a broker; a move pins the group and asks its owner
to hand it over. The nodes write what this reads (server/cluster/map.py)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from mqks.common.cluster_names import Layout, bucket_of, group_name, layout_of, log_subject
from mqks.common.nats_urls import NatsAccess, quiet_tls_noise, shown

STANDBY_WAIT_SECONDS = 20.0  # `mqks cluster move` waits this long for the target node's standby to report
# a node process reports its standbys within 10 s of a change and every 20 s anyway (server/cluster/map.py's
# SharedMap); silent for this long, status calls them down
STANDBY_DOWN_SECONDS = 30.0
LAG_COUNTED = 100  # a standby's lag in a shared stream is counted frame by frame up to this
# NATS answers 503 "JetStream system temporarily unavailable" while its servers elect a JetStream leader (right after
# they start, or after one was lost): a command asks again, every RETRY_SECONDS doubling to 2 s, for this long
ELECTION_SECONDS = 10.0
RETRY_SECONDS = 0.25
RETRY_MAX_SECONDS = 2.0

T = TypeVar("T")


def no_cluster(cluster: str, urls: list[str]) -> ValueError:
    """What a NATS that has neither streams nor a map of `cluster` means to the operator."""
    return ValueError(f"no cluster {cluster!r} on the NATS servers at {shown(urls)} yet: are its nodes started "
                      f"(mqksd --cluster {cluster} --log ...), and is --cluster {cluster} the name they were given?")


def electing(urls: list[str], seconds: float | None = None) -> str:
    """What a 503 from JetStream (for `seconds`, when asked again that long) means to the operator."""
    during = f" for {seconds:g} s" if seconds else ""
    return (f"the NATS servers at {shown(urls)} answered \"JetStream system temporarily unavailable\"{during}: NATS "
            "is electing a JetStream leader, which takes a majority of its servers (some just started, or were lost); "
            "try again in a moment")


async def while_electing(urls: list[str], read: Callable[[], Awaitable[T]], timeout: float = ELECTION_SECONDS) -> T:
    """`read()`, asked again while NATS answers 503 (no JetStream leader yet), for up to `timeout` seconds; then
    ValueError saying NATS is electing a leader."""
    from nats.js.errors import ServiceUnavailableError

    deadline, pause = time.monotonic() + timeout, RETRY_SECONDS
    while True:
        try:
            return await read()
        except ServiceUnavailableError:
            if time.monotonic() + pause > deadline:
                raise ValueError(electing(urls, timeout)) from None
        await asyncio.sleep(pause)
        pause = min(pause * 2, RETRY_MAX_SECONDS)


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


async def cluster_streams(js: Any, cluster: str) -> dict[Layout, dict[int, Any]]:
    """The cluster's streams on NATS by layout: each group's stream info."""
    layouts: dict[Layout, dict[int, Any]] = {}
    for info in await js.streams_info():
        found = layout_of(info.config.name or "", cluster)
        if found is not None:
            for group in found[1]:
                layouts.setdefault(found[0], {})[group] = info
    return layouts


async def group_figures(js: Any, cluster: str, layout: Layout, group: int, info: Any) -> tuple[int, int, int | None]:
    """A group's last sequence, messages and bytes (None in a shared stream: NATS counts bytes per stream)."""
    from nats.js.errors import NotFoundError

    if not layout.shared:
        return int(info.state.last_seq), int(info.state.messages), int(info.state.bytes)
    subject = log_subject(group_name(cluster, group, layout.groups))
    try:
        last_seq = int((await js.get_last_msg(info.config.name, subject)).seq or 0)
    except NotFoundError:
        last_seq = 0
    return last_seq, int((info.state.subjects or {}).get(subject, 0)), None


async def frames_after(js: Any, stream: str, layout: Layout, name: str, seq: int, last_seq: int) -> tuple[int, bool]:
    """A standby's lag: the frames of group `name` after `seq`, and whether there are more than that. In a shared
    stream the other groups' frames sit between them: counted one by one (a standby is a few frames behind), up
    to LAG_COUNTED."""
    from nats.js.errors import NotFoundError

    if not layout.shared or seq >= last_seq:
        return max(0, last_seq - seq), False
    frames = 0
    while seq < last_seq and frames < LAG_COUNTED:
        try:
            seq = int((await js.get_msg(stream, seq + 1, subject=log_subject(name), next=True)).seq)
        except NotFoundError:
            break
        frames += 1
    return frames, seq < last_seq


async def read_cluster(urls: list[str], cluster: str, access: NatsAccess | None = None,
                       timeout: float = ELECTION_SECONDS) -> list[dict[str, Any]]:
    """One row per slot group: its stream, the NATS leader, the owner the map names and the one that answers its
    ping, and each standby's lag behind its last sequence (as of its report, `seen_seconds_ago`). Asked again
    while NATS elects a JetStream leader, for up to `timeout` seconds; ValueError when there is no such cluster."""
    nc = await connect(urls, access)
    try:
        return await while_electing(urls, lambda: read_rows(nc, urls, cluster), timeout)
    finally:
        await nc.close()


async def read_rows(nc: Any, urls: list[str], cluster: str) -> list[dict[str, Any]]:
    """read_cluster's rows, read once over `nc`."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.errors import NotFoundError

    js = nc.jetstream(timeout=5)
    layouts = await cluster_streams(js, cluster)
    if len(layouts) > 1:
        shown_layouts = ", ".join(f"{layout.groups} groups in {layout.streams} streams" for layout in layouts)
        raise ValueError(f"cluster {cluster!r} has streams of {len(layouts)} layouts on this NATS "
                         f"({shown_layouts}): remove the one no node runs (mqks cluster remove --cluster "
                         f"{cluster} --groups N --log ...)")
    layout, streams = next(iter(layouts.items())) if layouts else (Layout(0, 0), {})
    if layout.shared:  # each subject's message count, in one stream info per stream
        by_name = {info.config.name: info for info in streams.values()}
        for name in by_name:
            by_name[name] = await js.stream_info(name, subjects_filter=f"mqks.log.{cluster}-*")
        streams = {group: by_name[info.config.name] for group, info in streams.items()}
    entries: dict[str, dict[str, Any]] = {}
    pins: dict[int, str] = {}
    reports: dict[tuple[int, str], dict[str, Any]] = {}  # (group, node): the freshest report of its standby
    try:
        values = await read_bucket(js, bucket_of(cluster))
    except NotFoundError:  # the bucket's stream (`stream not found`), or the bucket
        if not streams:
            raise no_cluster(cluster, urls) from None
        values = {}  # streams and no bucket: no owner has put its entry yet
    for key, value in values.items():
        if key.startswith("pin."):
            pins[int(key.partition(".")[2])] = value.decode()
            continue
        try:
            entry = json.loads(value or b"{}")
        except ValueError:
            continue
        if key.startswith("standbys."):  # a node process's standbys: group and the sequence read to
            for group_key, seq in (entry.get("groups") or {}).items():
                report = {"node": entry.get("node"), "seq": seq, "at": float(entry.get("at", 0))}
                known = reports.get((int(group_key), str(report["node"])))
                if known is None or known["at"] < report["at"]:  # a process of the node's earlier start
                    reports[(int(group_key), str(report["node"]))] = report
            continue
        entries[key] = entry
    rows = []
    for group, info in sorted(streams.items()):
        name = group_name(cluster, group, layout.groups)
        try:
            answer = await nc.request(f"mqks.owner.{name}", b"", timeout=1.0)
            answering = json.loads(answer.data)
        except (NoRespondersError, NatsTimeout, ValueError):
            answering = None
        last_seq, messages, size = await group_figures(js, cluster, layout, group, info)
        standbys = []
        for (reported_group, _), report in reports.items():
            if reported_group == group:
                seen_ago = round(time.time() - float(report.get("at", 0)), 1)
                lag, capped = await frames_after(js, info.config.name, layout, name, int(report.get("seq", 0)),
                                                 last_seq)
                standbys.append({"node": report.get("node"), "lag": lag, "lag_capped": capped,
                                 "seen_seconds_ago": seen_ago, "down": seen_ago > STANDBY_DOWN_SECONDS})
        standbys.sort(key=lambda standby: str(standby["node"]))
        owner = entries.get(f"owner.{group}", {})
        rows.append({"group": group, "name": name, "stream": info.config.name,
                     "leader": (info.cluster.leader if info.cluster is not None else None),
                     "last_seq": last_seq, "messages": messages, "bytes": size,
                     "owner": owner.get("node"), "epoch": owner.get("epoch"),
                     "address": f"{owner.get('host')}:{owner.get('port')}" if owner else None,
                     "answering": (answering or {}).get("node"), "pinned": pins.get(group),
                     "standbys": [s for s in standbys if s["node"] != (answering or owner).get("node")]})
    return rows


async def remove_cluster(urls: list[str], cluster: str, groups: int, access: NatsAccess | None = None) -> list[str]:
    """Delete the cluster's streams of `groups` groups, and its bucket once none of its streams is left; the
    streams deleted. ValueError while one of those groups has an owner that answers: its node still runs."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.errors import NotFoundError

    nc = await connect(urls, access)
    try:
        js = nc.jetstream(timeout=5)
        doomed: set[str] = set()
        kept: set[str] = set()
        for layout, streams in (await cluster_streams(js, cluster)).items():
            (doomed if layout.groups == groups else kept).update(info.config.name for info in streams.values())
        for group in range(groups) if doomed else ():
            name = group_name(cluster, group, groups)
            try:
                answer = await nc.request(f"mqks.owner.{name}", b"", timeout=1.0)
            except (NoRespondersError, NatsTimeout):
                continue
            node = json.loads(answer.data).get("node", "?") if answer.data else "?"
            raise ValueError(f"node {node} still owns group {name}: stop that cluster's nodes first")
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
    from nats.js.errors import NotFoundError

    async def unpin() -> list[int]:
        js = nc.jetstream(timeout=5)
        try:
            kv = await js.key_value(bucket_of(cluster))
            pinned = [int(key.partition(".")[2]) for key in await read_bucket(js, bucket_of(cluster), "pin.*")]
        except NotFoundError:  # no map: BucketNotFoundError, or its stream's `stream not found`
            raise no_cluster(cluster, urls) from None
        unpinned = [group for group in pinned if not groups or group in groups]
        for group in unpinned:
            await kv.delete(f"pin.{group}")
        return sorted(unpinned)

    nc = await connect(urls, access)
    try:
        return await while_electing(urls, unpin)
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
            await nc.request(f"mqks.move.{row['name']}", node.encode(), timeout=5)
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

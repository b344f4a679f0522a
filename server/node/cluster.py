"""A node of a cluster (`mqksd --cluster NAME --node ID`): where each slot group's owner listens.

Who owns a group is decided in its stream alone: a takeover is a conditional append
(server/journal/jetstream_log.py), and a stale owner is fenced by the stream. This map only tells
clients (through `hello`) and the other groups' links where the owner of each group listens. Each
owner puts its entry in the cluster's key-value bucket once it listens; every owner watches the
bucket. An entry can be stale for as long as a takeover takes: a link or client that dials it
fails and dials again once the entry changes, and an entry of a lower epoch never replaces a
higher one here.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from ..journal.jetstream_log import Candidacy
from ..journal.nats_bridge import NatsBridge, shown

log = logging.getLogger("mqks.cluster")

STANDBY_WAIT_SECONDS = 20.0  # `mqks cluster move` waits this long for the target node's standby to report
PULL_TURN = "pulling"  # in a node's run dir while one of its standbys has asked for its group
PULL_TURN_SECONDS = 30.0  # a turn whose group never came (its owner refused or died) ends after this
# a stopped watcher's consumer goes from NATS after this (nats-py's default is 300 s); a live one never idles
# this long: NATS sends it a heartbeat every 5 s
WATCHER_INACTIVE_SECONDS = 30.0
RETRY_SECONDS = 1.0
# a standby reports every 10 s (STANDBY_REPORT_SECONDS); silent for three reports, `mqks cluster status` calls it down
STANDBY_DOWN_SECONDS = 30.0
# a standby reads its group's pin again after this (a failover took a pinned group away: it asks for it back
# within this); one read every 5 s per standby was a quarter of an idle cluster's API calls on NATS
PIN_READ_SECONDS = 30.0


async def open_bucket(nc: Any, candidacy: Candidacy, replicas: int) -> Any:
    """The cluster's bucket, made by the first node that needs it."""
    from nats.js.api import KeyValueConfig, StorageType
    from nats.js.errors import BucketNotFoundError

    js = nc.jetstream(timeout=5)
    try:
        return await js.key_value(candidacy.bucket)
    except BucketNotFoundError:
        pass
    for tries in range(replicas, 0, -1):
        try:
            return await js.create_key_value(KeyValueConfig(bucket=candidacy.bucket, history=1, replicas=tries,
                                                            storage=StorageType.FILE))
        except Exception as e:  # fewer NATS servers than replicas; or made by another node meanwhile
            try:
                return await js.key_value(candidacy.bucket)
            except BucketNotFoundError:
                if tries == 1:
                    raise
                log.warning("bucket %s: %s; trying %d replicas", candidacy.bucket, e, tries - 1)
    raise AssertionError("unreachable")


class NodeDir:
    """What a node's processes tell each other through its run dir: which groups they own (`owns-g`, removed by
    the node's supervisor when the process ends), and whether one of them is pulling a group now."""

    def __init__(self, path: str) -> None:
        self.path = path

    def owned(self) -> int:
        """Groups this node owns now."""
        return sum(name.startswith("owns-") for name in os.listdir(self.path))

    def owner_of(self, group: int) -> None:
        """This process owns `group`; the pull that brought it here (if one did) is over."""
        with open(os.path.join(self.path, f"owns-{group}"), "w", encoding="utf-8") as f:
            f.write(str(os.getpid()))
        self.end_pull_turn()

    def end_pull_turn(self) -> None:
        """The group asked for goes elsewhere (or its owner did not answer): another standby may ask now."""
        try:
            os.unlink(os.path.join(self.path, PULL_TURN))
        except FileNotFoundError:
            pass

    def take_pull_turn(self) -> bool:
        """True if no other standby of this node is pulling a group now (one balance move at a time per node)."""
        path = os.path.join(self.path, PULL_TURN)
        try:
            if time.time() - os.stat(path).st_mtime > PULL_TURN_SECONDS:
                os.unlink(path)
        except FileNotFoundError:
            pass
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True


class ClusterMap:
    """Each group's owner as its entry in the bucket says: node, epoch, and the addresses it listens on."""

    def __init__(self, bridge: NatsBridge, candidacy: Candidacy, replicas: int,
                 on_change: Callable[[int], None]) -> None:
        self.bridge = bridge
        self.candidacy = candidacy
        self.replicas = replicas
        self.on_change = on_change  # called in the hub with the group whose entry changed
        self.entries: dict[int, dict[str, Any]] = {}  # written in the hub only
        self.serving = False  # an owner logs the map's changes; a standby only keeps them
        self._kv: Any = None  # the bucket, opened once (each open is a stream info: an API call on NATS)
        self._pin: str | None = None  # this group's pin as last read, and when (monotonic)
        self._pin_read_at = -PIN_READ_SECONDS

    def watch(self) -> None:
        """Follow every group's entry from now on: a standby balances by it, an owner links by it."""
        self.bridge.spawn(self._watch)

    def start(self, about: dict[str, Any]) -> None:
        """This process owns its group now: put its entry (the watch runs since watch())."""
        self.serving = True
        self.bridge.spawn(lambda nc: self._put(nc, about))

    def balance_view(self, fresh_pin: bool = False) -> tuple[dict[str, int], str | None, str | None]:
        """In the hub: how many groups each node owns as the map says, this group's owner, and the node it is
        pinned to (None: not pinned). The pin is one direct get (no consumer), read again once it is
        PIN_READ_SECONDS old or when `fresh_pin` (a standby about to ask for its group); OSError when NATS does
        not answer."""
        counts: dict[str, int] = {}
        for entry in self.entries.values():
            node = entry.get("node")
            if node is not None:
                counts[node] = counts.get(node, 0) + 1
        owner = self.entries.get(self.candidacy.group, {}).get("node")
        now = time.monotonic()
        if fresh_pin or now - self._pin_read_at >= PIN_READ_SECONDS:
            try:
                self._pin = self.bridge.run(self._read_pin, timeout=10)
            except Exception as e:
                raise OSError(f"cannot read the pin of group {self.candidacy.group}: {e}") from None
            self._pin_read_at = now
        return counts, owner, self._pin

    async def _bucket(self, nc: Any) -> Any:
        if self._kv is None:
            self._kv = await open_bucket(nc, self.candidacy, self.replicas)
        return self._kv

    async def _read_pin(self, nc: Any) -> str | None:
        from nats.js.errors import KeyNotFoundError

        kv = await self._bucket(nc)
        try:
            return ((await kv.get(f"pin.{self.candidacy.group}")).value or b"").decode() or None
        except KeyNotFoundError:  # KeyDeletedError too: `mqks cluster unpin`
            return None
        except Exception:
            self._kv = None  # the bucket was removed, or NATS moved it: open it again next time
            raise

    def address(self, group: int) -> tuple[str, int] | None:
        """Where the owner of `group` takes links; None while no owner is known."""
        entry = self.entries.get(group)
        if entry is None or not entry.get("link_port"):
            return None
        return entry["host"], entry["link_port"]

    def dial(self, group: int) -> socket.socket:
        """A connected link socket to the owner of `group` (gevent's); OSError when none is known or it refuses."""
        import gevent.socket

        address = self.address(group)
        if address is None:
            raise OSError(f"no owner of group {group} is known yet")
        sock = gevent.socket.create_connection(address, timeout=5)
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _learn(self, group: int, entry: dict[str, Any]) -> None:
        """In the hub: a newer entry for `group` replaces what was known."""
        known = self.entries.get(group)
        if known is not None and known.get("epoch", 0) > entry.get("epoch", 0):
            return
        if known != entry:
            self.entries[group] = entry
            log.log(logging.INFO if self.serving else logging.DEBUG, "group %d: owned by node %s (epoch %s) at %s:%s",
                    group, entry.get("node"), entry.get("epoch"), entry.get("host"), entry.get("port"))
            self.on_change(group)

    async def _put(self, nc: Any, about: dict[str, Any]) -> None:
        while True:
            try:
                kv = await self._bucket(nc)
                await kv.put(f"owner.{self.candidacy.group}", json.dumps(about).encode())
                return
            except Exception as e:
                self._kv = None
                log.warning("cluster map: cannot publish this owner's entry (%s); again", e)
                await asyncio.sleep(RETRY_SECONDS)

    async def _watch(self, nc: Any) -> None:
        """One watcher for the life of the process. nats-py's ordered consumer checks its heartbeats and makes
        itself again when its NATS node goes, so an idle watch is not renewed: each renewal was a new consumer
        that NATS kept for its inactivity threshold, and 48 processes renewing filled the bucket's consumer
        limit in minutes (issue 39)."""
        while True:
            watcher = None
            try:
                kv = await open_bucket(nc, self.candidacy, self.replicas)
                watcher = await kv.watch("owner.*", inactive_threshold=WATCHER_INACTIVE_SECONDS)
                while True:
                    entry = await watcher.updates(timeout=None)
                    if entry is None or not entry.value:
                        continue
                    try:
                        group = int(entry.key.rpartition(".")[2])
                        value = json.loads(entry.value)
                    except ValueError:
                        continue
                    self.bridge.to_hub(functools.partial(self._learn, group, value))
            except Exception as e:  # NATS went away for longer than the watcher's own recovery: make it again
                log.debug("cluster map: watch ended (%s); again", e)
                await asyncio.sleep(RETRY_SECONDS)
            finally:
                if watcher is not None:
                    try:
                        await watcher.stop()
                    except Exception:
                        pass


# -- the operator's view: `mqks cluster status|move` (client/cli.py) --------------------------------------------


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


def group_count_of(stream: str, cluster: str) -> tuple[int, int] | None:
    """(group, groups) of a cluster's stream name `CLUSTER-g-of-N`; None for any other stream."""
    prefix, _, size = stream.rpartition("-of-")
    name, _, group = prefix.rpartition("-")
    if name != cluster or not size.isdigit() or not group.isdigit():
        return None
    return int(group), int(size)


async def layouts_on_nats(urls: list[str], cluster: str, node: str | None = None,
                          ) -> tuple[dict[int, list[str]], list[dict[str, Any]]]:
    """The cluster's streams already on NATS, by the group count in their names; and, given a `node` id, the
    running owners that answer for its streams under that id (another live node started with it)."""
    import nats

    nc = await nats.connect(servers=urls, connect_timeout=5, max_reconnect_attempts=1)
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


def check_layout(urls: list[str], cluster: str, groups: int, node: str | None = None) -> str | None:
    """Why a node of `cluster` with `groups` groups must not start on this NATS: its streams were made with
    another --groups (two layouts would share one name, and nodes of each would take the other's groups over),
    or a running node already answers as `node` (two nodes with one id would each count the other's groups as
    their own). None when it may, or when NATS cannot be asked now (the group processes wait for it)."""
    try:
        layouts, same_id = asyncio.run(layouts_on_nats(urls, cluster, node))
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


async def read_cluster(urls: list[str], cluster: str) -> list[dict[str, Any]]:
    """One row per slot group: its stream, the NATS leader, the owner the map names and the one that answers its
    ping, and each standby's lag behind the stream's last sequence."""
    import nats
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.errors import BucketNotFoundError

    nc = await nats.connect(servers=urls, connect_timeout=5, max_reconnect_attempts=1)
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
            values = await read_bucket(js, f"mqks-{cluster}")
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


async def remove_cluster(urls: list[str], cluster: str, groups: int) -> list[str]:
    """Delete the cluster's streams of `groups` groups, and its bucket once none of its streams is left; the
    streams deleted. ValueError while one of those groups has an owner that answers: its node still runs."""
    import nats
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.errors import NotFoundError

    nc = await nats.connect(servers=urls, connect_timeout=5, max_reconnect_attempts=1)
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
                await js.delete_key_value(f"mqks-{cluster}")
            except NotFoundError:
                pass
        return sorted(doomed)
    finally:
        await nc.close()


async def unpin_groups(urls: list[str], cluster: str, groups: list[int]) -> list[int]:
    """Let the nodes balance `groups` (every pinned group when empty) again; the groups that were pinned."""
    import nats

    nc = await nats.connect(servers=urls, connect_timeout=5, max_reconnect_attempts=1)
    try:
        js = nc.jetstream(timeout=5)
        kv = await js.key_value(f"mqks-{cluster}")
        pinned = [int(key.partition(".")[2]) for key in await read_bucket(js, f"mqks-{cluster}", "pin.*")]
        unpinned = [group for group in pinned if not groups or group in groups]
        for group in unpinned:
            await kv.delete(f"pin.{group}")
        return sorted(unpinned)
    finally:
        await nc.close()


async def move_group(urls: list[str], cluster: str, group: int, node: str, timeout: float = 60.0) -> dict[str, Any]:
    """Pin `group` to `node` (a standby of it), ask its owner to hand it over, and wait until the map names that
    node."""
    import nats
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    deadline = time.monotonic() + STANDBY_WAIT_SECONDS
    while True:  # a node's process that just gave the group up stands by again within seconds
        rows = {row["group"]: row for row in await read_cluster(urls, cluster)}
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
    nc = await nats.connect(servers=urls, connect_timeout=5, max_reconnect_attempts=1)
    try:
        # pinned: no node's balancing pulls it elsewhere, and it comes back here after a failover
        kv = await nc.jetstream(timeout=5).key_value(f"mqks-{cluster}")
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
        row = {r["group"]: r for r in await read_cluster(urls, cluster)}[group]
        if row["answering"] == node and row["owner"] == node:
            return row
    raise TimeoutError(f"group {group} is not owned by node {node} after {timeout:g} s")

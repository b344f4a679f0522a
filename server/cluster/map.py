"""Where each slot group's owner listens, and what a node's processes tell each other.

Who owns a group is decided in its stream alone (election.py); this map only tells clients (through `hello`)
and the other groups' links where the owner of each group listens. Each owner puts its entry in the cluster's
key-value bucket once it listens; every process watches the bucket. An entry can be stale for as long as a
takeover takes: a link or client that dials it fails and dials again once the entry changes, and an entry of a
lower epoch never replaces a higher one here. The bucket also holds the operators' pins (`pin.G`) and each
standby's report of how far it has read (`standby.G.NODE`), which `mqks cluster status` shows.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

import gevent
import gevent.event

from ..nats_io.nats_bridge import Bridge, SharedNats
from ..workers.links import notice_dead_peer
from .candidacy import Candidacy
from .election import STANDBY_IDLE_REPORT_SECONDS, STANDBY_REPORT_SECONDS, HandOffRequests

log = logging.getLogger("mqks.cluster")

PULL_TURN = "pulling"  # in a node's run dir while one of its standbys has asked for its group
PULL_TURN_SECONDS = 30.0  # a turn whose group never came (its owner refused or died) ends after this
# a stopped watch's consumer goes from NATS after this (nats-py's default is 300 s); a live one never idles
# this long: NATS sends it a heartbeat every WATCH_HEARTBEAT_SECONDS
WATCHER_INACTIVE_SECONDS = 30.0
# an idle watch hears NATS this often; after two silent periods it is made anew. Its consumer lives on one NATS
# server: one on a host cut off went deaf for two periods, and at 10 s the nodes learned the cut node's groups'
# new owners 7 s after the takeovers (issue 56: its queues served again 26 s after the cut). One heartbeat every
# 2 s per process costs nothing beside the bridge's ping a second
WATCH_HEARTBEAT_SECONDS = 2.0
RETRY_SECONDS = 1.0
# a standby reads its group's pin again after this (a failover took a pinned group away: it asks for it back
# within this); one read every 5 s per standby was a quarter of an idle cluster's API calls on NATS
PIN_READ_SECONDS = 30.0
ASK_SECONDS = 5.0  # a standby's request for its group waits this long for the owner's answer
# a standby's check that its puts to the map go through waits this long: NATS never answers a put sent before it has
# elected the bucket's leader (a heal), and the check holds its node's turn to pull (issue 56: 5 s held after a heal)
WRITE_CHECK_SECONDS = 2.0


class OwnerWatch:
    """A push consumer of the owners' entries (`owner.G` in the cluster's bucket), each handed to the hub."""

    def __init__(self, bridge: Bridge, learn: Callable[[int, dict[str, Any]], None]) -> None:
        self.bridge = bridge
        self.learn = learn
        self.heard = asyncio.Event()
        self.next_delivery = 1
        self.skipped = False
        self.subscription: Any = None

    async def run(self, nc: Any, bucket: str) -> None:
        """Deliver entries until the watch goes quiet for two heartbeats or skips one (raises then)."""
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        inbox = nc.new_inbox()
        self.subscription = await nc.subscribe(inbox, cb=self.on_message)  # first: NATS sends once it exists
        await nc.jetstream(timeout=5)._jsm.add_consumer(f"KV_{bucket}", config=ConsumerConfig(
            deliver_subject=inbox, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            filter_subject=f"$KV.{bucket}.owner.*", ack_policy=AckPolicy.NONE, idle_heartbeat=WATCH_HEARTBEAT_SECONDS,
            mem_storage=True, num_replicas=1, inactive_threshold=WATCHER_INACTIVE_SECONDS))
        while not self.skipped:
            self.heard.clear()
            try:
                await asyncio.wait_for(self.heard.wait(), 2 * WATCH_HEARTBEAT_SECONDS)
            except TimeoutError:
                raise ConnectionError(f"nothing heard for {2 * WATCH_HEARTBEAT_SECONDS:g} s") from None
        raise ConnectionError("a delivery was skipped")

    async def on_message(self, msg: Any) -> None:
        self.heard.set()
        if not msg.data and msg.headers and "Status" in msg.headers:  # an idle heartbeat: no delivery
            return
        delivery = msg.metadata.sequence.consumer
        if delivery != self.next_delivery:
            self.skipped = True  # a slow subscription lost some: a new watch sends every entry again
            return
        self.next_delivery = delivery + 1
        if not msg.data:  # a deleted entry
            return
        try:
            group = int(msg.subject.rpartition(".")[2])
            value = json.loads(msg.data)
        except ValueError:
            return
        self.bridge.to_hub(functools.partial(self.learn, group, value))

    async def stop(self) -> None:
        subscription, self.subscription = self.subscription, None
        if subscription is not None:
            try:
                await subscription.unsubscribe()  # NATS drops the consumer once no one listens
            except Exception:
                pass


async def open_bucket(nc: Any, bucket: str, replicas: int) -> Any:
    """The cluster's bucket, made by the first node that needs it."""
    from nats.js.api import KeyValueConfig, StorageType
    from nats.js.errors import BucketNotFoundError

    js = nc.jetstream(timeout=5)
    try:
        return await js.key_value(bucket)
    except BucketNotFoundError:
        pass
    for tries in range(replicas, 0, -1):
        try:
            return await js.create_key_value(KeyValueConfig(bucket=bucket, history=1, replicas=tries,
                                                            storage=StorageType.FILE))
        except Exception as e:  # fewer NATS servers than replicas; or made by another node meanwhile
            try:
                return await js.key_value(bucket)
            except BucketNotFoundError:
                if tries == 1:
                    raise
                log.warning("bucket %s: %s; trying %d replicas", bucket, e, tries - 1)
    raise AssertionError("unreachable")


async def watch_owners(bridge: Bridge, bucket: str, replicas: int, learn: Callable[[int, dict[str, Any]], None],
                       nc: Any) -> None:
    """One watch of the owners' entries for as long as it runs: a push consumer of the bucket's stream that sends
    the latest entry of each group, then every new one, and an idle heartbeat. nats-py's watcher (an ordered
    consumer) woke each process four times a second for its flow control; here an idle watch wakes once per
    heartbeat. A watch that hears nothing for two heartbeats (its NATS node went) or skips a delivery is made
    anew, which sends every entry again."""
    while True:
        watch = OwnerWatch(bridge, learn)
        try:
            await open_bucket(nc, bucket, replicas)
            await watch.run(nc, bucket)
        except Exception as e:  # NATS went away, or the watch went quiet: make it again
            log.debug("cluster map: watch ended (%s); again", e)
            await asyncio.sleep(RETRY_SECONDS)
        finally:
            await watch.stop()


def standbys_key(node: str, reporter: str) -> str:
    """The bucket's key for the standbys one process of a node reports (`reporter`: the process's index, or a
    lone group's `gN`): `mqks cluster status` reads them."""
    return f"standbys.{node}.{reporter}"


def standbys_entry(node: str, positions: dict[int, int]) -> bytes:
    """What a standby report says: its node, its process, when, and each group's sequence read to."""
    return json.dumps({"node": node, "pid": os.getpid(), "at": time.time(),
                       "groups": {str(group): seq for group, seq in sorted(positions.items())}}).encode()


class SharedMap:
    """The map as the groups of one node process share it (cluster/node_process.py holds several groups in a process):
    one watch of the owners' entries, and one report of where every standby of the process has read to. Made per
    group, an idle default cluster kept 48 watches, and its 32 standbys put an R3 entry each every 20 s."""

    def __init__(self, shared: SharedNats, bucket: str, node: str, process: int, replicas: int,
                 report_seconds: float = STANDBY_REPORT_SECONDS,
                 idle_report_seconds: float = STANDBY_IDLE_REPORT_SECONDS) -> None:
        self.shared = shared
        self.report_seconds = report_seconds
        self.idle_report_seconds = idle_report_seconds
        self.bucket = bucket
        self.node = node
        self.process = process
        self.replicas = replicas
        self.entries: dict[int, dict[str, Any]] = {}  # the owners' entries as the watch brought them (in the hub)
        self.maps: list[ClusterMap] = []  # the groups' maps, each told every entry
        self.positions: dict[int, int] = {}  # group: the sequence its standby here has read to
        self.reported: dict[int, int] = {}  # as the last report put them
        self.changed = gevent.event.Event()
        self.reporter: gevent.Greenlet | None = None
        self.watching = False
        self._kv: Any = None

    def join(self, cluster_map: ClusterMap) -> None:
        """A group's map learns every entry known and every one to come (in the hub)."""
        self.maps.append(cluster_map)
        for group, entry in list(self.entries.items()):
            cluster_map.learn(group, entry)
        if not self.watching:
            self.watching = True
            bridge = self.shared.started()
            bridge.spawn(functools.partial(watch_owners, bridge, self.bucket, self.replicas, self.learn))

    def leave(self, cluster_map: ClusterMap) -> None:
        """A group's `Server` ended: its map hears no more, and its standby is no longer reported from here."""
        if cluster_map in self.maps:
            self.maps.remove(cluster_map)
        self.stands_by_no_more(cluster_map.candidacy.group)

    def stands_by_no_more(self, group: int) -> None:
        """The group's `Server` here owns it now, or ended."""
        if self.positions.pop(group, None) is not None:
            self.changed.set()

    def learn(self, group: int, entry: dict[str, Any]) -> None:
        """In the hub: an entry the watch brought; a lower epoch than one known never replaces it."""
        known = self.entries.get(group)
        if known is not None and known.get("epoch", 0) > entry.get("epoch", 0):
            return
        self.entries[group] = entry
        for cluster_map in list(self.maps):
            cluster_map.learn(group, entry)

    def report(self, group: int, seq: int) -> None:
        """The standby of `group` has read to `seq` (in the hub): the process's next report says so. A standby new
        here is reported at once (`mqks cluster move` waits to see it)."""
        if self.positions.get(group) == seq:
            return
        self.positions[group] = seq
        self.changed.set()
        if self.reporter is None:
            self.reporter = gevent.spawn(self._report)

    def _report(self) -> None:
        """Put the process's standbys' positions: at once for a standby not reported yet, within `report_seconds`
        of a change, and every `idle_report_seconds` anyway (status calls a standby down after
        client/cluster.py's STANDBY_DOWN_SECONDS of silence)."""
        last_put = -1e9
        while True:
            now = time.monotonic()
            due = self.report_due(now, last_put)
            if now >= due:
                last_put = now
                self.reported = dict(self.positions)
                self.shared.started().spawn(functools.partial(self._put, positions=self.reported))
                continue
            self.changed.clear()
            self.changed.wait(None if due == float("inf") else due - now)

    def report_due(self, now: float, last_put: float) -> float:
        """When the next report goes, the last one having gone at `last_put` (inf: none is needed)."""
        if not self.positions and not self.reported:  # every group of the process is owned here
            return float("inf")
        if self.positions.keys() - self.reported.keys():
            return now
        if self.positions != self.reported:
            return last_put + self.report_seconds
        return last_put + self.idle_report_seconds

    async def _put(self, nc: Any, positions: dict[int, int]) -> None:
        try:
            if self._kv is None:
                self._kv = await open_bucket(nc, self.bucket, self.replicas)
            await self._kv.put(standbys_key(self.node, str(self.process)), standbys_entry(self.node, positions))
        except Exception as e:
            self._kv = None
            log.debug("standby report failed: %s", e)


class NodeDir:
    """What a node's processes tell each other through its run dir: which groups they own (`owns-g`, removed by
    the node's supervisor when the process ends), and whether one of them is pulling a group now."""

    def __init__(self, path: str) -> None:
        self.path = path

    def owned(self) -> int:
        """Groups this node owns now."""
        return sum(name.startswith("owns-") for name in os.listdir(self.path))

    def owned_groups(self) -> list[int]:
        """The groups this node owns now, in order."""
        return sorted(int(name[5:]) for name in os.listdir(self.path) if name.startswith("owns-"))

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

    def __init__(self, bridge: Bridge, candidacy: Candidacy, replicas: int,
                 on_change: Callable[[int], None], shared: SharedMap | None = None) -> None:
        self.bridge = bridge
        self.shared = shared  # a node process's groups share one watch and one standby report
        self.candidacy = candidacy
        self.replicas = replicas
        self.on_change = on_change  # called in the hub with the group whose entry changed
        self.entries: dict[int, dict[str, Any]] = {}  # written in the hub only
        self.serving = False  # an owner logs the map's changes; a standby only keeps them
        self._kv: Any = None  # the bucket, opened once (each open is a stream info: an API call on NATS)
        self._pin: str | None = None  # this group's pin as last read, and when (monotonic)
        self._pin_read_at = -PIN_READ_SECONDS
        self.link_tls: ssl.SSLContext | None = None  # set when this node's links to the others use TLS
        self._seq = 0  # how far this group's standby has read, as last reported

    def watch(self) -> None:
        """Follow every group's entry from now on: a standby balances by it, an owner links by it."""
        if self.shared is not None:
            self.shared.join(self)
            return
        self.bridge.spawn(functools.partial(watch_owners, self.bridge, self.candidacy.bucket, self.replicas,
                                            self.learn))

    def close(self) -> None:
        """The group's `Server` ended: no more entries, and no more reports of its standby."""
        if self.shared is not None:
            self.shared.leave(self)

    def start(self, about: dict[str, Any], still_owner: Callable[[], bool] = lambda: True) -> None:
        """This process owns its group now: put its entry (the watch runs since watch()), for as long as
        `still_owner()` says it does."""
        self.serving = True
        if self.shared is not None:
            self.shared.stands_by_no_more(self.candidacy.group)
        self.bridge.spawn(lambda nc: self._put(nc, about, still_owner))

    def owner_counts(self) -> tuple[dict[str, int], str | None]:
        """In the hub, from memory: how many groups each node owns as the map says, and this group's owner."""
        counts: dict[str, int] = {}
        for entry in self.entries.values():
            node = entry.get("node")
            if node is not None:
                counts[node] = counts.get(node, 0) + 1
        return counts, self.entries.get(self.candidacy.group, {}).get("node")

    def balance_view(self, fresh_pin: bool = False) -> tuple[dict[str, int], str | None, str | None]:
        """In the hub: how many groups each node owns as the map says, this group's owner, and the node it is
        pinned to (None: not pinned). The pin is one direct get (no consumer), read again once it is
        PIN_READ_SECONDS old or when `fresh_pin` (a standby about to ask for its group); OSError when NATS does
        not answer."""
        counts, owner = self.owner_counts()
        now = time.monotonic()
        if fresh_pin or now - self._pin_read_at >= PIN_READ_SECONDS:
            try:
                self._pin = self.bridge.run(self._read_pin, timeout=10)
            except (Exception, gevent.Timeout) as e:
                raise OSError(f"cannot read the pin of group {self.candidacy.group}: {e}") from None
            self._pin_read_at = now
        return counts, owner, self._pin

    async def _bucket(self, nc: Any) -> Any:
        if self._kv is None:
            self._kv = await open_bucket(nc, self.candidacy.bucket, self.replicas)
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

    def can_write(self) -> bool:
        """Whether a put to the bucket goes through from here now (in the hub, waiting up to WRITE_CHECK_SECONDS): this
        standby's report put again, as its process's report or its own."""
        candidacy = self.candidacy
        if self.shared is not None:
            key, positions = standbys_key(candidacy.node, str(self.shared.process)), dict(self.shared.positions)
        else:
            key, positions = standbys_key(candidacy.node, f"g{candidacy.group}"), {candidacy.group: self._seq}

        async def put(nc: Any) -> None:
            kv = await self._bucket(nc)
            await kv.put(key, standbys_entry(candidacy.node, positions))

        try:
            self.bridge.run(put, timeout=WRITE_CHECK_SECONDS)
        except (Exception, gevent.Timeout) as e:  # the bridge's wait ends with gevent's Timeout, not an Exception:
            self._kv = None  # it went up through balance(), ended the standby and held its node's pull turn (issue 56)
            log.debug("group %d: a put to the map failed: %s", candidacy.group, e)
            return False
        return True

    def report_standby(self, seq: int) -> None:
        """A standby tells `mqks cluster status` how far it has read: in its process's report, or in one of its
        own (a put in the background)."""
        self._seq = seq
        if self.shared is not None:
            self.shared.report(self.candidacy.group, seq)
            return
        self.bridge.spawn(functools.partial(self._report_standby, seq=seq))

    async def _report_standby(self, nc: Any, seq: int) -> None:
        candidacy = self.candidacy
        try:
            kv = await self._bucket(nc)
            await kv.put(standbys_key(candidacy.node, f"g{candidacy.group}"),
                         standbys_entry(candidacy.node, {candidacy.group: seq}))
        except Exception as e:
            self._kv = None
            log.debug("group %d: standby report failed: %s", candidacy.group, e)

    def ask_for_group(self, name: str, node: str, of_node: str | None = None) -> dict[str, Any]:
        """Ask the owner of group `name` to hand it to `node` (if it is node `of_node`, when given); its answer (`ok`,
        and the node it goes `to`)."""
        request = node if of_node is None else f"{node} {of_node}"
        reply = self.bridge.run(lambda nc: nc.request(f"mqks.move.{name}", request.encode(), timeout=ASK_SECONDS),
                                timeout=ASK_SECONDS * 2)
        return dict(json.loads(reply.data))

    def serve_hand_offs(self, name: str, hand_offs: HandOffRequests) -> None:
        """This process owns group `name` now: answer the requests to hand it over."""

        async def subscribe(nc: Any) -> None:
            async def on_request(msg: Any) -> None:
                answer = hand_offs.answer(name, msg.data.decode(errors="replace").strip())
                if msg.reply:
                    await nc.publish(msg.reply, answer)

            await nc.subscribe(f"mqks.move.{name}", cb=on_request)

        self.bridge.spawn(subscribe)

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
        notice_dead_peer(sock)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.link_tls is not None:  # the other node's certificate is checked against the host it advertised
            try:
                sock = self.link_tls.wrap_socket(sock, server_hostname=address[0])
            except (OSError, ValueError) as e:
                sock.close()
                raise OSError(f"TLS to group {group}'s owner at {address[0]}:{address[1]} failed: {e}") from None
        sock.settimeout(None)
        return sock

    def learn(self, group: int, entry: dict[str, Any]) -> None:
        """In the hub: a newer entry for `group` replaces what was known."""
        known = self.entries.get(group)
        if known is not None and known.get("epoch", 0) > entry.get("epoch", 0):
            return
        if known != entry:
            self.entries[group] = entry
            log.log(logging.INFO if self.serving else logging.DEBUG, "group %d: owned by node %s (epoch %s) at %s:%s",
                    group, entry.get("node"), entry.get("epoch"), entry.get("host"), entry.get("port"))
            self.on_change(group)

    async def _put(self, nc: Any, about: dict[str, Any], still_owner: Callable[[], bool]) -> None:
        """Put this owner's entry, never over a newer owner's: a conditional update on the entry's revision, after a
        look at its epoch, retried while NATS does not answer and this process still owns the group. (Issue 56: an
        owner cut off by a partition retried an unconditional put through the heal; it landed after another node
        had taken the group over, and the map named the fenced node for good.)"""
        from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

        key = f"owner.{self.candidacy.group}"
        value = json.dumps(about).encode()
        while still_owner():
            try:
                kv = await self._bucket(nc)
                try:
                    entry = await kv.get(key)  # KeyDeletedError is a KeyNotFoundError
                except KeyNotFoundError:
                    entry = None
                if entry is None:
                    await kv.create(key, value)
                    return
                newer = json.loads(entry.value or b"{}").get("epoch", 0)
                if newer > about["epoch"]:
                    log.warning("cluster map: group %d has a newer owner (epoch %d > %d); this entry is not put",
                                self.candidacy.group, newer, about["epoch"])
                    return
                await kv.update(key, value, last=entry.revision)
                return
            except KeyWrongLastSequenceError:
                continue  # another put came between the look and the update: look again
            except Exception as e:
                self._kv = None
                log.warning("cluster map: cannot publish this owner's entry (%s); again", e or type(e).__name__)
                await asyncio.sleep(RETRY_SECONDS)

"""Real clusters on loopback for the tests: three NATS nodes (conftest's nats_cluster), MQKS nodes on their own
ports, a history of what clients were told, and the checker that judges it.

A node's port answers only while it owns a group (its owners share it); `Cluster.owners()` reads the map from
any node that answers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TypeVar

import gevent
import gevent.server
import gevent.socket
import pytest
from conftest import CALL_FAILED, READY_TIMEOUT_SECONDS, BrokerProcess, child_pids
from helpers import free_port
from waiting import wait_for

from mqks.common.cluster_names import Layout, group_name, log_subject
from mqks.server.dispatch.slots import owner_of
from mqks.server.edges.config import DEFAULT_GROUPS

T = TypeVar("T")


@pytest.fixture(autouse=True)
def node_logs_on_failure(request):
    """A failed scenario prints the end of each node's log (CI keeps nothing else of them). Autouse in every
    module that imports it."""
    Cluster.made.clear()
    yield
    if request.node.stash.get(CALL_FAILED, False):
        for made in Cluster.made:
            print(made.log_tails())


class ClusterNode(BrokerProcess):
    """`mqksd --cluster ... --node NAME`: started without waiting for a ping (it may own nothing yet)."""

    def __init__(self, name: str, *args: str, port: int | None = None) -> None:
        self.name = name
        super().__init__(*args, port=port)

    def start(self) -> None:
        self.piped_log.clear()
        cmd = [sys.executable, "-m", "mqks.server", "--port", str(self.port), *self.args]
        with open(self.log_path, "wb") as log_file:  # a restart's log starts empty: assertions read this run
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log_file)
        wait_for(lambda: "slot groups in" in self.log() or self.exited(), "the node's supervisor to start",
                 READY_TIMEOUT_SECONDS)
        assert not self.exited(), self.log()

    def exited(self) -> bool:
        assert self.proc is not None
        return self.proc.poll() is not None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def group_pids(self) -> list[int]:
        """The node's processes, each holding several of its groups."""
        assert self.proc is not None
        return child_pids(self.proc.pid)

    def processes(self) -> dict[int, int]:
        """The node's group processes by index: process p of P holds groups p, p + P, ..."""
        processes = {}
        for pid in self.group_pids():
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            if b"--process-index" in args:
                processes[int(args[args.index(b"--process-index") + 1])] = pid
        assert processes, f"node {self.name} has no group process"
        return processes

    def pid_of(self, group: int) -> int:
        """The process holding `group` on this node."""
        processes = self.processes()
        return processes[group % len(processes)]


def ask(port: int, *lines: bytes, timeout: float = 3.0) -> list[bytes]:
    """Send `lines`, read one answer per line (raises OSError when the port does not answer). Cooperative: the
    test's gevent clients run while it waits."""
    with gevent.socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"".join(line + b"\n" for line in lines))
        data = b""
        while data.count(b"\n") < len(lines):
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    return data.split(b"\n")[: len(lines)]


class Cluster:
    """Three (or more) MQKS nodes of one cluster on one NATS cluster."""

    made: list[Cluster] = []  # this test's clusters, whose logs are printed when it fails

    def __init__(self, name: str, urls: list[str], nodes: tuple[str, ...] = ("A", "B", "C"), groups: int = 4,
                 lease: float = 6.0, node_urls: dict[str, list[str]] | None = None,
                 extra: tuple[str, ...] = (), streams: int = 1, node_extra: dict[str, tuple[str, ...]] | None = None
                 ) -> None:
        Cluster.made.append(self)
        self.name = name
        self.urls = urls
        self.groups = groups
        self.layout = Layout(groups, streams)
        self.lease = lease
        self.args = (*self.args_for(name, groups, lease), "--streams", str(streams), *extra)
        self.nodes: dict[str, ClusterNode] = {}
        for node in nodes:  # started together, as an operator's three hosts would be
            log = ",".join((node_urls or {}).get(node, urls))  # a node may reach NATS its own way (a proxy)
            self.nodes[node] = ClusterNode(node, *self.args, *(node_extra or {}).get(node, ()), "--log", log,
                                           "--node", node, port=free_port())

    @staticmethod
    def args_for(name: str, groups: int, lease: float) -> tuple[str, ...]:
        """mqksd's flags for a node of cluster `name` (but --node and --log). The default layout goes without
        --groups, as an operator starts a node: most of the tier's clusters then take it the way a new cluster does."""
        layout = () if groups == DEFAULT_GROUPS else ("--groups", str(groups))
        return ("--cluster", name, *layout, "--lease", str(lease), "--eval")

    def group_name(self, group: int) -> str:
        """The group's name: its subjects (mqks.log.NAME, mqks.owner.NAME) say it."""
        return group_name(self.name, group, self.groups)

    def stream_of(self, group: int) -> str:
        return self.layout.stream_of(self.name, group)

    def group_log(self, group: int) -> list[dict[str, str]]:
        """The headers of every message of the group's log still in its stream, in order (read from NATS)."""

        async def read() -> list[dict[str, str]]:
            import nats
            from nats.js.errors import NotFoundError

            nc = await nats.connect(servers=self.urls)
            try:
                js, stream, subject = nc.jetstream(), self.stream_of(group), log_subject(self.group_name(group))
                seq, headers = 0, []
                while True:
                    try:
                        msg = await js.get_msg(stream, seq + 1, subject=subject, next=True)
                    except NotFoundError:
                        return headers
                    seq = int(msg.seq)
                    headers.append(dict(msg.headers or {}))
            finally:
                await nc.close()

        return asyncio.run(read())

    def ports(self, alive_only: bool = True) -> list[int]:
        return [node.port for node in self.nodes.values() if node.alive() or not alive_only]

    def hello(self) -> dict[str, Any] | None:
        for port in self.ports():
            try:
                line = ask(port, b"h hello")[0]
            except OSError:
                continue
            if b" ok " in line:
                return json.loads(line.partition(b" ok ")[2])
        return None

    def owners(self) -> dict[int, str]:
        """Group -> node, for the groups whose owner answers on its own port."""
        info = self.hello()
        owners: dict[int, str] = {}
        for entry in (info or {}).get("direct", []):
            node = self.nodes.get(entry.get("node") or "")
            if node is None or not node.alive() or not entry.get("port"):
                continue
            try:
                if ask(entry["port"], b"p ping")[0].startswith(b"p ok"):
                    owners[entry["worker"]] = node.name
            except OSError:
                continue
        return owners

    def wait_owned(self, without: tuple[str, ...] = (), timeout: float = 60.0) -> dict[int, str]:
        """Every group owned by a live node (none of `without`), as the map says; the map."""
        def owned() -> dict[int, str] | None:
            owners = self.owners()
            if len(owners) == self.groups and not set(owners.values()) & set(without):
                return owners
            return None
        return wait_for(owned, f"every group of cluster {self.name} to be owned", timeout, interval=0.2)

    def wait_balanced(self, timeout: float = 90.0) -> dict[int, str]:
        """Every group owned, and every live node owning its share (the nodes balance by themselves)."""
        share = self.groups // len([node for node in self.nodes.values() if node.alive()])

        def balanced() -> dict[int, str] | None:
            owners = self.owners()
            counts = [list(owners.values()).count(name) for name, node in self.nodes.items() if node.alive()]
            return owners if len(owners) == self.groups and min(counts) >= share else None
        return wait_for(balanced, f"the groups of cluster {self.name} to spread over its nodes", timeout, interval=0.5)

    def lease_takeovers(self) -> int:
        """Takeovers after an owner's silence (not moves, not first claims), as the nodes logged them."""
        return sum(node.log().count("taking it over") for node in self.nodes.values())

    def kill(self, node: str) -> float:
        """kill -9 the node's supervisor and every process of it (a lost host); the monotonic time of the kill."""
        victim = self.nodes[node]
        assert victim.proc is not None
        pids = [victim.proc.pid, *victim.group_pids()]
        at = time.monotonic()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        victim.proc.wait()
        wait_for(lambda: not any(os.path.exists(f"/proc/{pid}/fd") for pid in pids), "the node's processes to go",
                 READY_TIMEOUT_SECONDS)
        return at

    def queue_of(self, group: int, prefix: str) -> str:
        """A queue name whose slot is in `group`."""
        return next(f"{prefix}-{n}" for n in range(100000) if owner_of(f"{prefix}-{n}".encode(), self.groups) == group)

    def log_tails(self, lines: int = 60) -> str:
        """The end of every node's log: what a failed test's reader needs first."""
        return "\n".join(f"--- node {name} of {self.name}, last {lines} log lines ---\n"
                         + "\n".join(node.log().splitlines()[-lines:]) for name, node in self.nodes.items())

    def remove(self) -> None:
        """Its streams and bucket deleted from NATS (after `stop`): a shared NATS cluster stays light."""
        from mqks.client.cluster import remove_cluster

        asyncio.run(remove_cluster(self.urls, self.name, self.groups))

    def stop(self) -> None:
        """Every node's processes SIGKILLed at once (a group process otherwise notices its supervisor's death
        only after a moment, node after node: seconds of teardown per test)."""
        live = [node for node in self.nodes.values() if node.alive()]
        for node in live:
            for pid in node.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for node in live:
            node.kill()  # reaps the supervisor and waits for its group processes to be gone


@dataclass
class History:
    """What clients were told: confirmed publishes, deliveries, confirmed acks; judged by `check`."""

    confirmed: dict[str, str] = field(default_factory=dict)  # body -> queue
    delivered: list[tuple[str, str, float]] = field(default_factory=list)  # (queue, body, when)
    acked: set[str] = field(default_factory=set)  # bodies whose ack was confirmed
    ack_confirmed_at: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def deliver(self, queue: str, body: str) -> None:
        with self.lock:
            self.delivered.append((queue, body, time.monotonic()))

    def ack(self, body: str) -> None:
        with self.lock:
            self.acked.add(body)
            self.ack_confirmed_at[body] = time.monotonic()

    def missing(self) -> set[str]:
        """Confirmed publishes never delivered (an acked one was delivered, by definition)."""
        seen = {body for _, body, _ in self.delivered}
        return set(self.confirmed) - seen

    def check(self) -> dict[str, int]:
        """The verdict: every confirmed publish delivered at least once; none delivered again after its ack was
        confirmed; duplicates counted (at-least-once allows them)."""
        counts = Counter(body for _, body, _ in self.delivered)
        redelivered_after_ack = [body for _, body, when in self.delivered
                                 if body in self.ack_confirmed_at and when > self.ack_confirmed_at[body]]
        lost = self.missing()
        assert not lost, f"{len(lost)} confirmed publishes never delivered: {sorted(lost)[:10]}"
        assert not redelivered_after_ack, f"delivered again after a confirmed ack: {redelivered_after_ack[:10]}"
        return {"confirmed": len(self.confirmed), "delivered": len(self.delivered), "distinct": len(counts),
                "duplicates": sum(n - 1 for n in counts.values() if n > 1), "acked": len(self.acked)}


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))] if ordered else 0.0


class Proxy:
    """A TCP proxy on loopback that can be cut (every connection closed, new ones refused) and healed, on one port:
    a node's way to one NATS server, so the node alone loses NATS while its clients still reach it."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.pairs: set[Any] = set()
        self.server: gevent.server.StreamServer | None = None  # type: ignore[name-defined]
        self.heal()

    def heal(self) -> None:
        self.server = gevent.server.StreamServer(("127.0.0.1", self.port), self.handle)
        self.server.init_socket()
        self.server.start()

    def cut(self) -> None:
        assert self.server is not None
        self.server.stop(timeout=0)
        for sock in list(self.pairs):
            try:
                sock.close()
            except OSError:
                pass
        self.pairs.clear()

    def handle(self, client: Any, address: Any) -> None:
        try:
            upstream = gevent.socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        self.pairs.update((client, upstream))

        def pump(source: Any, sink: Any) -> None:
            try:
                while chunk := source.recv(1 << 16):
                    sink.sendall(chunk)
            except OSError:
                pass
            for sock in (source, sink):
                try:
                    sock.close()
                except OSError:
                    pass
                self.pairs.discard(sock)

        gevent.joinall([gevent.spawn(pump, client, upstream), gevent.spawn(pump, upstream, client)])

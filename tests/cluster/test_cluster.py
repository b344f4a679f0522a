"""Nodes of a cluster (`mqksd --cluster NAME --node ID --log nats://...`) on loopback: three NATS nodes, three MQKS
nodes on their own ports, real kill -9s, SIGSTOPs and a cut to NATS.

A history of what clients were told (confirmed publishes, deliveries, confirmed acks) is judged at the end of
every scenario (cluster_harness.History.check): every confirmed publish is delivered at least once, nothing is
delivered again after its ack was confirmed, duplicates are counted and printed.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections import Counter
from pathlib import Path

import gevent
import pytest
from cluster_harness import (
    Cluster,
    History,
    ask,
    node_logs_on_failure,  # noqa: F401 (autouse: a failed test prints the nodes' logs)
    percentile,
)
from helpers import MQKS, unique
from waiting import wait_for, wait_until

pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")

from mqks.client import Client, MqksError
from mqks.server.journal.jetstream_log import EPOCH, Replayer

pytestmark = pytest.mark.timeout(300)

LEASE = 6.0  # short, so a failover test takes seconds; the default (12) is for elections of slow networks
ELECTION_LEASE = 30.0  # longer than a NATS election on a loaded machine: a test that must see no failover


@pytest.fixture
def cluster(shared_nats_cluster):
    """A three-node MQKS cluster of its own, on the module's NATS (the scenarios that use it kill no NATS node)."""
    _, urls = shared_nats_cluster
    # two streams for the four groups: the scenarios below cross a shared stream's other groups' frames (the
    # default, one stream, is the tests' that make their own cluster; a stream per group, test_cluster_clients')
    made = Cluster(unique("c").replace("-", "_"), urls, lease=LEASE, streams=2)
    made.wait_balanced()
    yield made
    made.stop()
    made.remove()  # its streams off the shared NATS: the next scenarios' elections do not share it with them


def mqks_cluster(*args: str) -> subprocess.CompletedProcess:
    """`mqks cluster ARGS` to the end."""
    return subprocess.run([str(MQKS), "cluster", *args], capture_output=True, text=True, timeout=120)


def client_for(cluster: Cluster, first: str | None = None) -> Client:
    """A client with every node as a seed: the first one, then the others when it cannot be reached."""
    ports = [cluster.nodes[first].port] if first else []
    ports += [port for port in cluster.ports(alive_only=False) if port not in ports]
    return Client("127.0.0.1", ports[0], fallbacks=[("127.0.0.1", port) for port in ports[1:]], timeout_seconds=60,
                  reconnect_max_seconds=0.5, ping_seconds=2).connect(timeout=30)


class Workload:
    """Pipelined confirmed publishes to a queue of every group, and a consumer per queue acking each message
    with a confirmed ack (one ack line per message, as msg.ack() sends)."""

    def __init__(self, cluster: Cluster, history: History, publishers: int = 6) -> None:
        self.cluster = cluster
        self.history = history
        self.queues = [cluster.queue_of(group, unique("q")) for group in range(cluster.groups)]
        self.consumer = client_for(cluster)
        self.producer = client_for(cluster)
        self.counter = itertools.count()
        self.errors = 0
        self.refusals: Counter[str] = Counter()
        self.stopped = False
        for queue in self.queues:
            self.consumer.consume(queue, [f"{queue}.e"], self.on_message(queue), manual_ack=True)
        self.greenlets = [gevent.spawn(self.publish_loop, n) for n in range(publishers)]

    def on_message(self, queue: str):
        def handle(msg) -> None:
            self.history.deliver(queue, msg.data)
            try:
                msg.ack(confirm=True)
            except MqksError:
                return  # not acked: it comes back, which the checker allows
            self.history.ack(msg.data)
        return handle

    def publish_loop(self, n: int) -> None:
        while not self.stopped:
            i = next(self.counter)
            queue = self.queues[i % len(self.queues)]
            body = f"{queue}:{i}"
            while not self.stopped:  # a refused publish goes again: it counts once it is confirmed
                try:
                    self.producer.publish(f"{queue}.e", body, confirm=True, timeout=30)
                except MqksError as e:
                    self.errors += 1
                    reason = str(e)[:160]
                    if reason not in self.refusals:  # each new reason once, in the failed test's captured log
                        logging.getLogger("cluster-test").warning("publish refused, sent again: %s", reason)
                    self.refusals[reason] += 1
                    gevent.sleep(0.05)
                    continue
                with self.history.lock:
                    self.history.confirmed[body] = queue
                break

    def stop(self) -> None:
        self.stopped = True
        gevent.joinall(self.greenlets, timeout=60)

    def settle(self, timeout: float = 90.0) -> None:
        """Wait until every confirmed publish was delivered (bounded), then close the clients."""
        deadline = time.monotonic() + timeout
        while self.history.missing() and time.monotonic() < deadline:
            gevent.sleep(0.2)
        self.consumer.close()
        self.producer.close()

    def first_delivery_after(self, queue: str, published_after: int, since: float, timeout: float = 60.0) -> float:
        """Seconds from `since` to the first delivery on `queue` of a message numbered past `published_after`."""
        def found() -> float | None:
            with self.history.lock:
                for q, body, when in self.history.delivered:
                    if q == queue and int(body.rpartition(":")[2]) > published_after:
                        return when - since
            return None
        return wait_for(found, f"a delivery on {queue} from its new owner", timeout, interval=0.05)


# The two scenarios that kill or cut off NATS nodes run first, on NATS clusters of their own: the module's shared
# one (the other scenarios') is made only after them, so its servers never share the cores with their elections.


def test_a_nats_leader_kill_stalls_owners_but_fails_nothing_over(nats_cluster):
    """kill -9 the NATS node leading the most groups' streams, with a lease longer than the election: an election
    inside NATS, no takeover in MQKS (every group keeps its owner and epoch), nothing confirmed is lost.

    The lease is ELECTION_LEASE, not the default 12 s: with the suite's other tiers on the same two cores, a
    stream's election once took more than 12 s (CI), and a standby rightly took its group over; what this test
    checks is that an election shorter than the lease moves nothing."""
    from mqks.client.nats_local import load, restart

    directory, urls = nats_cluster
    cluster = Cluster(unique("c").replace("-", "_"), urls, lease=ELECTION_LEASE)
    try:
        cluster.wait_balanced()
        history = History()
        work = Workload(cluster, history)
        try:
            wait_for(lambda: len(history.confirmed) > 300, "confirmed publishes", 60)
            before = cluster.lease_takeovers()
            leaders = list(stream_leaders(cluster).values())
            leader = max(sorted(set(leaders)), key=leaders.count)
            node = next(node for node in load(str(directory)) if node.name == leader)
            os.kill(node.pid, signal.SIGKILL)
            killed_at, confirmed_then = time.monotonic(), len(history.confirmed)
            wait_for(lambda: len(history.confirmed) > confirmed_then + 300, "confirms after the election", 60)
            resumed = time.monotonic() - killed_at
            restart(str(directory), node.name)
        finally:
            work.stop()
            work.settle()
        verdict = history.check()
        assert cluster.lease_takeovers() == before, "a NATS election made MQKS fail a group over"
        print(f"NATS leader kill (it led {leaders.count(leader)} of {len(leaders)} streams): confirms flowed again "
              f"{resumed:.1f} s after; no group changed owner; {verdict}")
    finally:
        cluster.stop()


def test_an_owner_cut_off_from_nats_steps_down_and_its_groups_move(nats_cluster):
    """A node whose way to NATS is cut (its clients still reach it) stops confirming, steps down after the
    lease, and standbys on the other nodes take its groups over; after the heal it stands by again."""
    from cluster_harness import Proxy

    _, urls = nats_cluster
    proxies = [Proxy(int(url.rpartition(":")[2])) for url in urls]
    cluster = Cluster(unique("c").replace("-", "_"), urls,
                      node_urls={"A": [f"nats://127.0.0.1:{proxy.port}" for proxy in proxies]})
    try:
        owners = cluster.wait_balanced()
        cut_groups = [group for group, node in owners.items() if node == "A"]
        history = History()
        work = Workload(cluster, history)
        try:
            wait_for(lambda: len(history.confirmed) > 300, "confirmed publishes", 60)
            for proxy in proxies:
                proxy.cut()
            cut_at = time.monotonic()
            after = cluster.wait_owned(without=("A",), timeout=90)
            moved = time.monotonic() - cut_at
            assert all(after[group] != "A" for group in cut_groups)
            wait_for(lambda: "steps down as its owner" in cluster.nodes["A"].log(), "A's owners to step down", 30)
            for proxy in proxies:
                proxy.heal()
            wait_for(lambda: "standing by" in cluster.nodes["A"].log().rpartition("steps down")[2],
                     "A to stand by again after the heal", 60)
            confirmed_then, healed_at = len(history.confirmed), time.monotonic()
            # bounded generously: what is judged is that the cluster works on after the heal (balancing may move a
            # group back to A right then); how long it took is printed
            wait_for(lambda: len(history.confirmed) > confirmed_then + 200, "confirms after the heal", 120)
            flowing = time.monotonic() - healed_at
        finally:
            work.stop()
            work.settle()
        verdict = history.check()
        print(f"owner cut off from NATS: its {len(cut_groups)} groups owned elsewhere {moved:.1f} s after the cut "
              f"(lease {cluster.lease:g} s); 200 more confirms {flowing:.1f} s after A stood by again; {verdict}, "
              f"refusals {dict(work.refusals)}")
        assert_no_old_epoch_applied(cluster)
    finally:
        cluster.stop()
        for proxy in proxies:
            proxy.cut()


def test_kill_9_of_an_owner_node_loses_no_confirmed_message(cluster):
    """Three rounds: kill -9 the node owning the most groups under pipelined confirmed publishes and per-message
    confirmed acks; a standby takes each of its groups over; the node comes back as a standby."""
    history = History()
    work = Workload(cluster, history)
    recoveries = []
    try:
        for _ in range(3):
            owners = cluster.wait_owned()
            wait_for(lambda: len(history.confirmed) > 300 + len(recoveries) * 200, "confirmed publishes", 60)
            victim = max(sorted(cluster.nodes), key=lambda node: list(owners.values()).count(node))
            groups = [group for group, node in owners.items() if node == victim]
            mark = next(work.counter)
            killed_at = cluster.kill(victim)
            for group in groups:
                recoveries.append(work.first_delivery_after(work.queues[group], mark, killed_at))
            after = cluster.wait_owned(without=(victim,))
            assert not {group for group, node in after.items() if node == victim}
            cluster.nodes[victim].start()  # back, as a standby of every group
    finally:
        work.stop()
        work.settle()
    verdict = history.check()
    print(f"kill -9 of an owner node, 3 rounds: {verdict}, {work.errors} refused publishes sent again; recovery "
          f"(kill to first delivery from the new owner) p50 {percentile(recoveries, 0.5):.1f} s, "
          f"p99 {percentile(recoveries, 0.99):.1f} s over {len(recoveries)} groups (lease {LEASE:g} s)")
    assert verdict["confirmed"] > 600
    assert_no_old_epoch_applied(cluster)


def test_the_asyncio_client_rides_a_kill_9_of_an_owner_node(cluster):
    """mqks.aio with every node as a seed: a consumer per group on its owner's link, confirmed publishes from four
    tasks, kill -9 of the node owning the most groups; its consumers are re-created on the new owners, publishing
    goes on, and every confirmed publish arrives (at least once)."""
    import asyncio

    from aio_helpers import run
    from waiting import until

    from mqks import aio

    queues = [cluster.queue_of(group, unique("aq")) for group in range(cluster.groups)]
    ports = cluster.ports(alive_only=False)
    confirmed: set[str] = set()
    delivered: set[str] = set()

    async def main() -> None:
        async with aio.Client("127.0.0.1", ports[0], fallbacks=[("127.0.0.1", port) for port in ports[1:]],
                              timeout_seconds=60, reconnect_max_seconds=0.5, ping_seconds=2) as client:
            async def on_message(msg: aio.Message) -> None:
                delivered.add(msg.data)
                await msg.ack()

            for queue in queues:
                await client.consume(queue, [f"{queue}.e"], on_message, manual_ack=True)
            stopped = asyncio.Event()

            async def publish_loop(first: int) -> None:
                i = first
                while not stopped.is_set():
                    queue = queues[i % len(queues)]
                    body = f"{queue}:{i}"
                    try:
                        await client.publish(f"{queue}.e", body, confirm=True, timeout=30)
                    except MqksError:  # refused while a group moves: the same body again
                        await asyncio.sleep(0.05)
                        continue
                    confirmed.add(body)
                    i += 4

            publishers = [asyncio.create_task(publish_loop(n)) for n in range(4)]
            await until(lambda: len(confirmed) > 200, "publishes confirmed before the kill", 60)
            owners = cluster.owners()
            victim = max(sorted(cluster.nodes), key=lambda node: list(owners.values()).count(node))
            cluster.kill(victim)  # blocks the loop for the kill only (its processes gone): well under a second
            before = len(confirmed)
            await until(lambda: len(confirmed) > before + 200, "publishes confirmed by the new owners", 90)
            stopped.set()
            await asyncio.gather(*publishers)
            await until(lambda: confirmed <= delivered, "every confirmed publish delivered", 90)

    try:
        run(main)
    finally:
        print(f"mqks.aio through a kill -9 of an owner node: {len(confirmed)} confirmed, "
              f"{len(confirmed - delivered)} of them not delivered: {sorted(confirmed - delivered)[:20]}")
    assert not confirmed - delivered


def assert_no_old_epoch_applied(cluster: Cluster) -> None:
    """In every group's log, no frame of an old epoch follows a takeover, or replay ignores each one."""
    for group in range(cluster.groups):
        name, frames = cluster.group_name(group), cluster.group_log(group)
        highest = 0
        late = 0
        replayer = Replayer()
        for headers in frames:
            epoch = int(headers.get(EPOCH, 0))
            late += epoch < highest
            highest = max(highest, epoch)
            replayer.feed(headers, b"")
        assert replayer.ignored == late, (name, late, replayer.ignored)


def owner_pid(cluster: Cluster, group: int) -> tuple[str, int]:
    """The node and process that own `group` now."""
    info = cluster.hello()
    assert info is not None
    entry = next(entry for entry in info["direct"] if entry["worker"] == group)
    node = cluster.nodes[entry["node"]]
    return node.name, node.pid_of(group)


def test_a_stopped_owner_is_taken_over_and_confirms_nothing_after(cluster):
    """SIGSTOP a group's owner for longer than the lease: a standby takes the group over. Lines its clients sent
    meanwhile are answered after SIGCONT with errors naming the new owner (or not at all), none with ok; its server
    ends and its process stands by for the group again, and the queue holds only what was confirmed before."""
    group = 1
    queue = cluster.queue_of(group, unique("q"))
    event = f"{queue}.e".encode()
    node, pid = owner_pid(cluster, group)
    info = cluster.hello()
    assert info is not None
    port = next(entry["port"] for entry in info["direct"] if entry["worker"] == group)
    assert ask_until_ok(port, b"r rebind --confirm %b %b" % (queue.encode(), event)) == b"r ok "
    for i in range(20):
        assert ask_until_ok(port, b"m%d publish --confirm %b before-%d" % (i, event, i)) == b"m%d ok " % i
    zombie_client = socket.create_connection(("127.0.0.1", port), timeout=60)
    os.kill(pid, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        # the lease runs out: a standby of another node takes the group over
        def new_owner() -> str | None:
            owners = cluster.owners()
            return owners.get(group) if owners.get(group) not in (None, node) else None
        taker = wait_for(new_owner, "a standby to take the stopped owner's group over", 60, interval=0.2)
        took = time.monotonic() - stopped_at
        zombie_client.sendall(b"".join(b"z%d publish --confirm %b zombie-%d\n" % (i, event, i) for i in range(10)))
    finally:
        os.kill(pid, signal.SIGCONT)
    answers = b""
    try:
        while answers.count(b"\n") < 10:
            chunk = zombie_client.recv(65536)
            if not chunk:
                break
            answers += chunk
    except OSError:
        pass  # closed as it stopped: what it answered before is judged
    lines = [line for line in answers.split(b"\n") if line]
    # it may also close without answering (CI: it noticed the takeover before it read them): never with ok,
    # and the queue below holds nothing of the zombie's
    assert not [line for line in lines if b" ok" in line], lines
    # refused: its group was taken over (by the taker, or by the node balancing then handed it to: CI saw the other
    # standby ask for it a second after the takeover), or (its process froze the owners of other groups too) a group
    # it would have to reach is failing over
    others = [name.encode() for name in cluster.nodes if name != node]
    assert taker.encode() in others
    assert all(any(b"taken over by node " + other in line for other in others) or b"failing over" in line
               for line in lines), lines
    # the fenced owner's server ends, and its process (which holds other groups too) stands by for the group again
    wait_for(lambda: f"group {group} is not owned here now; standing by" in cluster.nodes[node].log(),
             "the fenced owner to stand by again", 30)
    assert process_state(pid) not in ("gone", "Z")
    drained = drain(cluster, queue)
    assert drained == [f"before-{i}" for i in range(20)], drained  # nothing of the zombie's
    print(f"SIGSTOP of an owner: group {group} taken over by node {taker} {took:.1f} s after the stop (lease "
          f"{LEASE:g} s); the stopped owner answered {len(lines)} lines with errors after SIGCONT")


def ask_until_ok(port: int, line: bytes, timeout: float = 30.0) -> bytes:
    """One line's answer; again while it is refused with "try again" (its owner, or a link to another group's
    owner, is still coming up), as a client would."""
    deadline = time.monotonic() + timeout
    while True:
        answer = ask(port, line)[0]
        if not answer.endswith(b"try again") or time.monotonic() > deadline:
            return answer
        gevent.sleep(0.2)


def test_a_queue_bound_while_a_router_has_lost_its_link_misses_none_of_its_confirmed_publishes(cluster):
    """Group R's link to group O's owner is lost (its dials fail), both still owned and on NATS. R routes by O's
    bindings as it last had them (issue 56), so O must not bind a new queue R does not know: O refuses the consume
    ("try again") until R links again (or R's trust runs out), and every publish R confirms reaches every queue bound
    before it. Before, O bound it at once and R confirmed a publish to its event that reached no queue."""
    direct = {entry["worker"]: entry["port"] for entry in (cluster.hello() or {})["direct"]}
    router, owner = 0, 1
    queue, event = cluster.queue_of(owner, unique("bq")), unique("be")

    def evaluates(group: int, expression: str) -> bytes:
        return ask(direct[group], f"v _eval --worker={group} {expression}".encode())[0]

    wait_for(lambda: evaluates(router, f"process.peers.links[{owner}] is not None") == b"v ok True",
             "the router's link to the owner", 30)
    # the router's dials to the owner fail from now on, and its link there goes (what a cut between them does)
    cut = ("setattr(process.peers, 'real_dial', process.peers.dial) or setattr(process.peers, 'dial', lambda group: "
           f"(_ for _ in ()).throw(OSError('cut by the test')) if group == {owner} else process.peers.real_dial(group))"
           f" or process.peers.links[{owner}].sock.shutdown(2)")
    assert evaluates(router, cut).startswith(b"v ok")
    wait_for(lambda: evaluates(router, f"process.peers.links[{owner}] is None") == b"v ok True",
             "the router to lose its link to the owner", 30)
    wait_for(lambda: evaluates(owner, f"{router} in {{link.worker for link in process.peers.incoming}}")
             == b"v ok False", "the owner to see the router's link go", 30)

    answer = ask(direct[owner], f"b consume --confirm {queue} {event}".encode())[0]
    if answer.startswith(b"b ok"):  # the old way: bound, and the router does not know it
        confirmed = ask(direct[router], f"p publish --confirm {event} lost?".encode())[0]
        depth = ask(direct[owner], f"d _eval --worker={owner} state.queues[b'{queue}'].depth()".encode())[0]
        assert not confirmed.startswith(b"p ok") or depth == b"d ok 1", (
            f"a publish the router confirmed ({confirmed!r}) missed {queue}, bound before it ({depth!r})")
    assert answer.startswith(b"b error") and answer.endswith(b"try again"), answer
    assert f"group {router} may still route publishes".encode() in answer

    assert evaluates(router, "setattr(process.peers, 'dial', process.peers.real_dial)").startswith(b"v ok")
    assert ask_until_ok(direct[owner], f"b consume --confirm {queue} {event}".encode()).startswith(b"b ok")
    assert ask_until_ok(direct[router], f"p publish --confirm {event} found".encode()).startswith(b"p ok")
    depth_line = f"d _eval --worker={owner} state.queues[b'{queue}'].depth()".encode()
    assert wait_for(lambda: ask(direct[owner], depth_line)[0] == b"d ok 1", f"the publish in {queue}", 30)


def publish_until_confirmed(client: Client, event: str, data: str, timeout: float = 60.0) -> str:
    """A confirmed publish, again while it is refused with "try again" (a link to a group's owner is still
    coming up: the message was not published), as an application would."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.publish(event, data, confirm=True)
        except MqksError as e:
            if not e.reason.endswith("try again") or time.monotonic() > deadline:
                raise
            gevent.sleep(0.2)


def drain(cluster: Cluster, queue: str) -> list[str]:
    """Every message body `queue` holds, through a client that follows the map: as many as its row says it holds
    (read before consuming, so a late delivery is waited for, never taken for the end)."""
    client = client_for(cluster)
    bodies: list[str] = []
    try:
        rows = client.queues(queue)
        depth = rows[0]["depth"] if rows else 0
        client.consume(queue, None, lambda msg: bodies.append(msg.data))
        wait_until(lambda: len(bodies) >= depth, f"the {depth} messages {queue} holds", 60)
    finally:
        client.close()
    return bodies


def test_cluster_move_under_load_loses_nothing(cluster, shared_nats_cluster):
    """`mqks cluster move GROUP NODE` while producers and consumers run: the group changes owner with no loss,
    and `mqks cluster status` shows it."""
    nats_dir, urls = shared_nats_cluster
    history = History()
    work = Workload(cluster, history)
    moves = []
    processes = {name: node.processes() for name, node in cluster.nodes.items()}
    try:
        for _ in range(3):
            owners = cluster.wait_owned()
            wait_for(lambda: len(history.confirmed) > 200 + len(moves) * 200, "confirmed publishes", 60)
            group = 0
            target = next(node for node in sorted(cluster.nodes) if node != owners[group])
            started = time.monotonic()
            done = mqks_cluster("move", str(group), target, "--log", ",".join(urls), "--cluster", cluster.name)
            assert done.returncode == 0, done.stderr
            moves.append(time.monotonic() - started)
            assert f"group {group}: owned by node {target}" in done.stdout
    finally:
        work.stop()
        work.settle()
    verdict = history.check()
    def settled() -> list[dict] | None:  # balancing may be moving another group right after the last move
        rows = json.loads(mqks_cluster("status", "--json", "--log", ",".join(urls), "--cluster", cluster.name).stdout)
        return rows if all(row["owner"] == row["answering"] for row in rows) else None
    rows = wait_for(settled, "mqks cluster status to show every group's owner answering", 60, interval=1.0)
    assert [row["group"] for row in rows] == list(range(cluster.groups))
    assert rows[0]["pinned"] == rows[0]["owner"]  # the moved group stays where it was put
    # a group that leaves a node ends its server, not its process (which holds other groups): the same processes
    # serve on, each with one NATS connection for all its groups, and an ended server's subscriptions are gone with
    # it: each group's owner ping and hand-off requests have one subscriber, its owner
    assert {name: node.processes() for name, node in cluster.nodes.items()} == processes
    def extra_threads() -> list[int]:  # main and the NATS connection's; a resolver's may linger for a moment
        return [len(os.listdir(f"/proc/{pid}/task")) - 2
                for node in cluster.nodes.values() for pid in node.processes().values()]
    wait_for(lambda: not any(extra_threads()), "two threads in each process", 30)
    # and each group's heartbeats have two subscribers, its standbys (none left over from the moves)
    everyone_once = {group: [1, 1, 2] for group in range(cluster.groups)}
    try:  # a standby moved off its group follows it once its process has read the group's log again
        wait_for(lambda: owners_subscriptions(cluster, nats_dir) == everyone_once, "each group's subscribers", 30)
    except AssertionError:
        assert owners_subscriptions(cluster, nats_dir) == everyone_once
    print(f"mqks cluster move under load, 3 moves: {verdict}; each move took {', '.join(f'{s:.1f}' for s in moves)} s")
    assert verdict["confirmed"] > 400


def owners_subscriptions(cluster: Cluster, nats_dir: Path) -> dict[int, list[int]]:
    """Group -> how many subscriptions the NATS servers hold to its owner ping and to its hand-off requests (only
    its owner makes them) and to its owner's heartbeats (its standbys do), read from their monitoring ports."""
    import urllib.request

    from mqks.client.nats_local import load

    subjects: list[str] = []
    for node in load(str(nats_dir)):
        with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/connz?subs=1&limit=4096", timeout=5) as got:
            for connection in json.load(got).get("connections") or []:
                subjects += connection.get("subscriptions_list") or []
    names = [cluster.group_name(group) for group in range(cluster.groups)]
    return {group: [subjects.count(f"mqks.{kind}.{name}") for kind in ("owner", "move", "beat")]
            for group, name in enumerate(names)}


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (Z: exited, not yet reaped), or "gone" once it is reaped."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"  # reaped between two looks (CI: exists, then open raised ESRCH)


def stream_leaders(cluster: Cluster) -> dict[str, str]:
    """Stream name -> the NATS node leading it."""
    import asyncio

    import nats

    async def read() -> dict[str, str]:
        nc = await nats.connect(servers=cluster.urls)
        js = nc.jetstream()
        leaders = {}
        for name in sorted({cluster.stream_of(group) for group in range(cluster.groups)}):
            info = await js.stream_info(name)
            leaders[name] = info.cluster.leader if info.cluster is not None else ""
        await nc.close()
        return leaders

    return asyncio.run(read())


def test_the_spark_source_reads_through_a_failover_and_loses_nothing(cluster):
    """The `mqks` Spark source's driver and executor calls (made by hand, as Spark's runner makes them), with every
    node as a seed: a batch is read, the owner node of its queue is killed before the batch is committed; the new
    owner has the batch's messages back (retry raised), and every confirmed message reaches the sink."""
    pytest.importorskip("pyspark", reason="pyspark is not installed: pip install -e '.[spark]'")
    pytest.importorskip("pyarrow", reason="pyarrow is not installed: pip install -e '.[spark]'")
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from mqks.spark.source import MqksStreamReader, SourceOptions, source_struct

    group = 2
    queue = cluster.queue_of(group, unique("spark"))
    owner = cluster.owners()[group]
    assert ask(cluster.nodes[owner].port, b"r rebind --confirm %b %b.e" % (queue.encode(), queue.encode())) == [
        b"r ok "]
    publisher = client_for(cluster)
    ids = [publish_until_confirmed(publisher, f"{queue}.e", f"m{i}") for i in range(300)]
    first, *others = [cluster.nodes[owner], *(node for name, node in cluster.nodes.items() if name != owner)]
    options = {"host": "127.0.0.1", "port": str(first.port), "queue": queue, "reconnectSeconds": "60",
               "seeds": ",".join(f"127.0.0.1:{node.port}" for node in others)}
    reader = MqksStreamReader(SourceOptions.parse(options), source_struct())

    def read(start, end) -> list[tuple[str, int]]:
        rows = []
        for partition in reader.partitions(start, end):
            for batch in reader.read(partition):
                rows += zip(batch.column("msg_id").to_pylist(), batch.column("retry").to_pylist(), strict=True)
        return rows

    sink: list[tuple[str, int]] = []
    try:
        start = reader.initialOffset()
        end = reader.latestOffset(start, ReadMaxRows(100))
        first_batch = read(start, end)
        assert len(first_batch) == 100
        # a confirm waits for its frame and every frame before it: once this one is in, the owner's log holds the
        # batch's records (delivered, held), so the kill cannot come before them (a frame waits --frame-wait)
        ids.append(publish_until_confirmed(publisher, f"{queue}.e", "after the batch"))
        cluster.kill(owner)  # the batch is leased, not committed: its messages are the new owner's again
        cluster.wait_owned(without=(owner,))
        reader.commit(end)  # through a seed; the leases died with the owner, so it acks nothing
        while len({msg_id for msg_id, _ in sink}) < len(ids):
            start, end = end, reader.latestOffset(end, ReadMaxRows(100))
            sink += read(start, end)
            reader.commit(end)
    finally:
        reader.stop()
        publisher.close()
    assert set(ids) <= {msg_id for msg_id, _ in sink}
    again = [msg_id for msg_id, retry in sink if msg_id in {m for m, _ in first_batch}]
    assert {retry for msg_id, retry in sink if msg_id in again} == {1}  # the killed owner's batch, back once
    print(f"Spark source through a failover: {len(ids)} confirmed, {len(sink)} rows after the kill, "
          f"{len(again)} of them the uncommitted batch again")

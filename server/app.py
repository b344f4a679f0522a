"""One `mqksd` process (cli.py starts it): the listeners, the journal and its recovery, timers and signals.

One `Server` per process wires the parts together: the `Process` (its one broker, worker i of
n, owning the queues of its slot range), the journal and the cluster over it (startup.py opens
them; without --cluster the cluster is a `NoCluster` whose hooks do nothing), the one timer heap
and its greenlet, the error ids, and a `Connection` per client, which gets the process and an
error-id source, never the server itself. SIGTERM or SIGINT drains: stop accepting, stop delivering, give consumers
`--drain-seconds` to settle what they hold (those that said `hello` hear `ok --draining`),
flush what is owed, requeue the rest (durably with --data-dir), exit 0. SIGHUP re-reads the
token file. With `--tls-port` a second listener speaks the same protocol over TLS; with
`--metrics-port` the same loop serves `/metrics` and `/healthz` (server/edges/metrics.py).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from typing import TYPE_CHECKING, Any

import gevent
from gevent.event import Event

from . import build
from .core.timers import Timers
from .dispatch.actions import ONE_PROCESS, HandlerTables
from .dispatch.process import Process
from .dispatch.slots import SLOTS, slot_ranges
from .edges.config import FENCED_EXIT_CODE, Config
from .edges.connection import Connection
from .edges.error_ids import ErrorIds
from .edges.handshakes import client_tls, link_hello
from .edges.listeners import AcceptFailed, CannotListen, Listener, tcp_listener, unix_listener
from .edges.memory import MemoryGuard
from .edges.restarts import log_greenlets
from .edges.sessions import AUTH_TOKEN_ENV, SilenceWatch, Tokens, eval_lock_reason, tls_server_context
from .startup import log_shown, open_journal, recover_journal
from .wire.protocol import format_error, ok_body

if TYPE_CHECKING:
    from gevent.pywsgi import WSGIServer

    from .cluster.map import SharedMap
    from .nats_io.nats_bridge import SharedNats
    from .workers.peers import Peers

log = logging.getLogger("mqks.server")

SHUTDOWN_FLUSH_SECONDS = 5.0
SHUTDOWN_CLEAN_UP_SECONDS = 2.0
DRAIN_POLL_SECONDS = 0.02
DRAINING = b" ok --draining\n"
LINK_WAIT_SECONDS = 10.0  # at start: how long a worker waits for the others before it serves anyway


class Server:
    """The process: config, workers, timers, error ids, live connections, the listener."""

    def __init__(self, config: Config, shared_nats: SharedNats | None = None,
                 shared_map: SharedMap | None = None) -> None:
        """`shared_nats`, `shared_map`: a cluster node's process, whose groups' logs share one NATS connection,
        one watch of the cluster map and one report of their standbys."""
        self.config = config
        self.connections: set[Connection] = set()
        self.timers_due = Event()
        self.timers = Timers(on_earlier=self.timers_due.set)
        self.next_error_id = ErrorIds()
        # read before anything starts: a wrong token file stops the start at once
        env_token = os.environ.get(AUTH_TOKEN_ENV)
        self.tokens = Tokens(config.auth_token_file, env_token) if config.auth_token_file or env_token else None
        self.peers: Peers | None = None  # before the journal: a cluster's map tells on_map_change as it opens
        # with a journal, the hub's watcher its writer wakes; with --cluster, this process's group, standby or owner
        self.journal, self.log_wake, self.cluster = open_journal(config, self.error_line, self.tokens, shared_nats,
                                                                 shared_map, self.on_map_change)
        self.tables = ONE_PROCESS  # the sessions' handler tables; a worker of several wraps them (link_workers)
        # one broker per process: worker i of n with --workers n (the supervisor started it), else worker 0 of 1
        worker, count = (0, 1) if config.worker_index is None else (config.worker_index, config.workers)
        self.process = Process(self.timers, self.journal, worker, count)
        if count > 1 or config.cluster:
            self.link_workers()
        self.process.topology_extra = self.topology
        self.direct_listeners: list[Listener] = []
        self.link_listener: Listener | None = None
        self.process.error_line = self.error_line
        self.process.max_memory_bytes = config.max_memory_bytes
        if config.max_memory_bytes is not None and self.peers is not None:
            # every worker process holds itself to an equal share, so together they stay under the limit (a cluster
            # node's process holds several groups: each of them checks the process against the process's share)
            self.process.max_memory_share = config.max_memory_bytes // (config.processes if config.cluster
                                                                         else config.workers)
        self.stream_server: Listener | None = None
        self.tls_server: Listener | None = None
        self.tls_context = (tls_server_context(config.tls_cert, config.tls_key, config.tls_ca)
                            if config.tls_port is not None and config.tls_cert and config.tls_key else None)
        self.eval_refusal = eval_lock_reason(config.host, self.tokens is not None) if config.eval_enabled else None
        self.silence_watch = SilenceWatch(self.timers.call_later)
        self.drain_ends_at = 0.0
        self.metrics_server: WSGIServer | None = None
        self.no_connections = Event()  # set whenever the last connection's clean-up is done
        self.no_connections.set()
        self.stopped = Event()  # shutdown is complete: serve_forever may return
        self.fenced = False  # the replicated log was taken over: stopping
        self.exit_code = 0
        self.stopping = False  # shutdown has begun: a worker still linking at start-up must not open its port
        self.serving = False  # listening, with its stop handled by `shutdown` (a standby is still recovering)
        self.timer_greenlet: gevent.Greenlet | None = None

    def link_workers(self) -> None:
        """This process is one worker of several: reach the others, route lines to the owners."""
        from .workers.peers import RELAY_WINDOW_BYTES, Peers
        from .workers.relay import place

        assert self.config.run_dir is not None
        process = self.process
        count = process.worker_count
        # a relayed session's window: 8 MiB, and small enough that even if every other worker fills one for
        # the same client while it stalls, its worker holds under --max-output-bytes in all
        self.peers = Peers(process, self.config.run_dir, self.config.max_link_backlog_bytes,
                           min(RELAY_WINDOW_BYTES, self.config.max_output_bytes // (2 * count)))
        self.peers.on_link_lost = self.on_link_lost
        process.link(self.peers)
        process.requests.prefix = f"{process.worker}w{process.requests.prefix}"  # a reply finds its worker
        self.tables = HandlerTables(place)
        self.cluster.link(self.peers)  # a cluster's groups link over TCP, to the owners the map names

    def on_map_change(self, group: int) -> None:
        """A group's owner changed: a link to its old address goes."""
        if self.peers is not None:
            self.peers.readdress(group)

    def topology(self) -> dict[str, Any]:
        """`hello`'s fields about placement: this worker, the slot map, and every worker's own address."""
        config = self.config
        count, worker = self.process.worker_count, self.process.worker
        fields: dict[str, Any] = {"worker": worker, "slots": SLOTS, "slot_map": slot_ranges(count)}
        cluster_fields = self.cluster.hello_fields(count)
        if cluster_fields:
            return fields | cluster_fields
        if self.peers is None:
            listener = self.stream_server
            fields["direct"] = [{"worker": 0, "host": config.host,
                                 "port": listener.server_port if listener is not None else None, "unix": None}]
            return fields
        direct = []
        for peer in range(count):
            try:
                with open(os.path.join(self.peers.run_dir, f"direct-{peer}.json"), encoding="utf-8") as f:
                    direct.append(json.load(f))
            except (OSError, ValueError):
                direct.append({"worker": peer, "host": None, "port": None, "unix": None})  # starting
        fields["direct"] = direct
        return fields

    def on_link_lost(self, worker: int) -> None:
        """Worker `worker` is gone (it will be restarted): clients with consumers or answers there are closed,
        so they reconnect and replay, as after a broker restart."""
        for conn in list(self.connections):
            if conn.relay is not None and conn.relay.waits_on(worker):
                conn.close()

    def error_line(self, rid: bytes, reason: str) -> bytes:
        error_id = self.next_error_id()
        self.process.errors += 1
        log.warning("error %s: %s (rid %r)", error_id, reason, rid[:80])
        return format_error(rid, error_id, reason)

    def on_log_wake(self) -> None:
        """The log made commits durable (or failed them): answer their confirms."""
        assert self.journal is not None
        self.journal.settle()
        self.process.flush_pending()
        if not self.stopping and self.cluster.hands_off():
            self.exit_code = FENCED_EXIT_CODE  # the node starts this process again, as a standby
            gevent.spawn(self.shutdown)
        fenced_by = self.journal.fenced_by
        if fenced_by is not None and not self.fenced:
            # the confirms that waited were just answered with an error naming the new owner
            self.fenced = True
            log.critical("stopping: %s", fenced_by)
            self.exit_code = FENCED_EXIT_CODE
            gevent.spawn(self.shutdown)

    def run_timers(self) -> None:
        """The process's one timer greenlet: sleep until the earliest deadline, run what is due."""
        timers, due = self.timers, self.timers_due
        while True:
            due.wait(timers.next_delay())
            due.clear()
            if timers.run_due():
                self.process.flush_pending()

    def set_over_memory(self, over: bool) -> None:
        """The memory guard's verdict: every session's table refuses publishes, or takes them again."""
        for conn in self.connections:
            # a connection still owing its `auth` keeps its table of the few actions allowed before it
            conn.refresh_handlers(over)
        if self.peers is not None:  # other workers' clients' lines that run here (publish --confirm)
            self.peers.set_over_memory(over)

    def handle(self, sock: socket.socket, address: object, tls: bool = False) -> None:
        conn = Connection(sock, address, self.config, self.process, self.next_error_id, tls=tls, tokens=self.tokens,
                          eval_refusal=self.eval_refusal, silence_watch=self.silence_watch, tables=self.tables)
        self.connections.add(conn)
        self.no_connections.clear()
        try:
            conn.serve()
        finally:
            self.connections.discard(conn)
            if not self.connections:
                self.no_connections.set()

    def handle_tls(self, sock: socket.socket, address: object) -> None:
        """Handshake (bounded in time), then serve as `handle`; a failed handshake closes that peer alone."""
        assert self.tls_context is not None
        tls_sock = client_tls(self.tls_context, sock, address, lambda: format_error(
            b"-", self.next_error_id(), "this port speaks TLS: connect with TLS (mqks --tls), or to the plain port"))
        if tls_sock is not None:
            self.handle(tls_sock, address, tls=True)

    def reload_tokens(self) -> None:
        if self.tokens is not None:
            self.tokens.reload()

    def health(self) -> str | None:
        """None while the broker accepts connections and its log can write; else why not (`/healthz`)."""
        listener = self.stream_server or self.tls_server
        if listener is None or listener.closed:
            return "not accepting connections: starting or stopping"
        if listener.failed_accepts:
            return "not accepting connections: out of file descriptors or memory"
        if self.journal is not None and self.journal.blocked:
            return f"{self.journal.blocked}: the log cannot write, confirmed publishes are refused"
        if self.peers is not None:  # this worker's /healthz speaks for the broker: a worker it cannot reach fails it
            unlinked = [worker for worker, link in enumerate(self.peers.links)
                        if link is None and worker != self.peers.worker]
            if unlinked:
                return (f"{self.peers.unit} {', '.join(map(str, unlinked))} not linked (restarting, or not reading): "
                        "lines for its queues get an error")
            from ..common.figures import log_trouble

            # a cluster node answers for the groups it owns: another node's trouble is that node's /healthz
            owned = self.cluster.owned_groups()
            for answer in self.peers.ask_all(b"h stats", workers=owned):
                stats = json.loads(ok_body(answer))
                trouble = log_trouble(stats)
                if trouble is not None:
                    return (f"{self.peers.unit} {stats.get('worker')}: {trouble}: its log cannot write, confirmed "
                            "publishes to its queues are refused")
        return None

    def listen(self) -> None:
        """Bind the broker's port and, with --metrics-port, the HTTP one; CannotListen names the one that failed."""
        config = self.config
        shared = self.peers is not None  # every worker accepts on the public ports (SO_REUSEPORT)
        if config.port:  # --port 0: TLS only
            self.stream_server = tcp_listener(config.host, config.port, self.handle, "", shared)
        if config.tls_port is not None:
            self.tls_server = tcp_listener(config.host, config.tls_port, self.handle_tls, " for TLS", shared)
        if self.peers is not None:
            self.listen_direct()
        # worker 0 speaks for a broker of several; on a cluster node every owner accepts, and speaks for the node
        speaks = self.peers is None or self.peers.worker == 0 or self.cluster.shares_metrics_port
        if config.metrics_port is not None and speaks:
            from .edges.console import BrokerLine, Console
            from .edges.metrics import metrics_server  # prometheus_client is loaded only when asked for

            tokens = self.tokens
            console = None
            if config.console:
                # the console asks the broker as a client would: on the plain port, else (--port 0) on the TLS one
                line = BrokerLine(config.host, config.port or config.tls_port or 0, not config.port)
                console = Console(line, tokens, config.console_actions)
            try:
                self.metrics_server = metrics_server(config.metrics_host, config.metrics_port, self.metrics_registry(),
                                                     self.health, console,
                                                     shared=self.cluster.shares_metrics_port)
                self.metrics_server.start()
            except OSError as e:
                raise CannotListen(f"cannot listen for metrics on {config.metrics_host}:{config.metrics_port}: "
                                   f"{e}") from None
            log.info("metrics on http://%s:%d/metrics and /healthz%s", config.metrics_host,
                     self.metrics_server.server_port, ", the console at /" if console is not None else "")

    def metrics_registry(self) -> Any:
        """The figures /metrics shows: the broker's, or on a cluster node those of the node (its groups owned now,
        and its processes)."""
        from .edges.metrics import make_registry

        return make_registry(self.process, self.config.metrics_max_queues, *self.cluster.node_figures())

    def listen_direct(self) -> None:
        """Worker i's own addresses: a TCP port and a Unix socket for clients, a Unix socket for the other workers.

        The addresses are written to the run dir before the link socket exists, so a worker that can
        link to this one can also tell clients where it is.
        """
        config, peers = self.config, self.peers
        assert peers is not None
        port = config.direct_port + peers.worker if config.direct_port else 0
        direct = tcp_listener(config.host, port, self.handle, " (this worker's own port)")
        if self.cluster.links_over_tcp:
            self.listen_as_owner(direct)
            return
        unix_path = os.path.join(peers.run_dir, f"worker-{peers.worker}.sock")
        self.direct_listeners = [direct, unix_listener(unix_path, self.handle)]
        info: dict[str, Any] = {"worker": peers.worker, "host": config.host, "port": direct.server_port,
                                "unix": unix_path}
        if self.tls_context is not None:
            direct_tls = tcp_listener(config.host, 0, self.handle_tls, " for TLS (this worker's own port)")
            self.direct_listeners.append(direct_tls)
            info["tls_port"] = direct_tls.server_port
        path = os.path.join(peers.run_dir, f"direct-{peers.worker}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(info, f)
        os.replace(path + ".tmp", path)
        self.link_listener = unix_listener(peers.socket_path(peers.worker), self.handle_link)

    def listen_as_owner(self, direct: Listener) -> None:
        """A cluster's group owner: its own port for clients, and one for the other groups' links, both over TCP and
        published in the cluster map."""
        config, peers = self.config, self.peers
        assert peers is not None
        self.direct_listeners = [direct]
        link_port = config.direct_port + config.workers + peers.worker if config.direct_port else 0
        self.link_listener = tcp_listener(config.host, link_port, self.handle_link, " for links from other nodes")
        tls_port = None
        if self.tls_context is not None:
            direct_tls = tcp_listener(config.host, 0, self.handle_tls, " for TLS (this worker's own port)")
            self.direct_listeners.append(direct_tls)
            tls_port = direct_tls.server_port
        self.cluster.serve(direct.server_port, self.link_listener.server_port, tls_port)

    def handle_link(self, sock: socket.socket, address: object) -> None:
        """Another worker's link: its first line says which worker it is (after the TLS handshake, between the nodes
        of a cluster whose nodes have --tls-cert: a link that does not speak TLS is refused)."""
        assert self.peers is not None
        self.cluster.link_accepted(sock)
        hello = link_hello(sock, address, self.cluster.link_tls, self.cluster.check_link_token)
        if hello is not None:
            self.peers.accept_link(*hello)

    def serve_forever(self, own_signals: bool = True) -> None:
        """Recover, listen and serve until stopped; `own_signals` False: a cluster node's process holding several
        groups (cluster/node_process.py) handles the signals and calls `shutdown` itself."""
        config = self.config
        if self.journal is not None:
            lines = self.cluster.replay(self.journal.log, config.repair)  # a standby's: up to its takeover
            recover_journal(config, self.journal, self.process, lines)
            self.log_wake.start(self.on_log_wake)
        self.listen()
        hub = gevent.get_hub()
        hub.NOT_ERROR = (*hub.NOT_ERROR, AcceptFailed)  # logged by Listener, once per burst
        self.timer_greenlet = gevent.spawn(self.run_timers)
        if config.max_memory_bytes is not None:
            limit = self.process.max_memory_share or config.max_memory_bytes
            MemoryGuard(self.process, limit, self.timers, self.set_over_memory).check()
        if own_signals:
            for signum in (signal.SIGTERM, signal.SIGINT):
                gevent.signal_handler(signum, gevent.spawn, self.shutdown)
            if self.tokens is not None:
                gevent.signal_handler(signal.SIGHUP, self.reload_tokens)
            gevent.signal_handler(signal.SIGUSR1, log_greenlets)
        self.serving = True
        ports = [f"{config.host}:{listener.server_port}{' (TLS)' if listener is self.tls_server else ''}"
                 for listener in (self.stream_server, self.tls_server) if listener is not None]
        if self.peers is not None:
            ports.append(f"{config.host}:{self.direct_listeners[0].server_port} (this worker's own)")
        log.info("mqksd listening on %s (workers=%d, eval=%s, auth=%s, %s, %s)", ", ".join(ports), config.workers,
                 "refused: token auth beyond loopback" if self.eval_refusal else "on" if config.eval_enabled else "off",
                 self.tokens.describe() if self.tokens is not None else "off",
                 f"data dir {config.data_dir}, fsync {config.fsync}" if config.data_dir else
                 f"replicated log {log_shown(config)}" if config.log else "in memory", build.kind)
        if self.peers is not None:
            for listener in (self.link_listener, *self.direct_listeners):
                assert listener is not None
                listener.start()
            if not self.peers.connect_all(LINK_WAIT_SECONDS, lambda: self.stopping) and not self.stopping:
                log.warning("not every other worker answered within %g s: serving anyway; lines for their queues "
                            "get an error until they do", LINK_WAIT_SECONDS)
        if not self.stopping:  # a SIGTERM while linking closed the listeners before they opened
            for listener in (self.stream_server, self.tls_server):
                if listener is not None:
                    listener.start()
        self.stopped.wait()  # not the listener's serve_forever: it returns as soon as the listener closes
        log.info("mqksd stopped")

    def takes_shutdown(self) -> bool:
        """True once `shutdown` drains this server; before that (recovering, standing by) nothing needs draining."""
        return self.serving

    def release(self) -> None:
        """After `serve_forever` ended, in a process that goes on (a cluster node's process made this group's
        server, and makes another): close what a process's exit would have, so nothing of this one keeps running."""
        if self.timer_greenlet is not None:
            self.timer_greenlet.kill(block=False)
        self.cluster.close()
        for listener in (self.stream_server, self.tls_server, self.link_listener, *self.direct_listeners):
            if listener is not None:
                listener.close()
        for conn in list(self.connections):
            conn.close()
        if self.peers is not None:
            self.peers.close()
        if self.metrics_server is not None:
            self.metrics_server.stop(timeout=1)
        if self.journal is not None:
            self.journal.log.close(0.0)  # a standby's reading, or an owner's log that shutdown could not close
        if self.log_wake is not None:
            self.log_wake.stop()
            self.log_wake.close()
            self.log_wake = None

    def shutdown(self) -> None:
        """Stop accepting, give every client what it is owed, then close.

        In this order: each connection is shut down and its reader cleans up (consumers
        detached, un-acked messages back in their queues, the log told) before the log
        closes; only then may `serve_forever` return and the process exit.
        """
        listeners = [listener for listener in (self.stream_server, self.tls_server) if listener is not None]
        if not listeners or self.stopping:
            if self.drain_ends_at > time.monotonic():
                log.warning("second stop signal: ending the drain now; what is still un-acked goes back to its queue")
                self.drain_ends_at = 0.0
            return
        self.stopping = True
        log.info("stopping: no new connections, draining %d clients for up to %g s", len(self.connections),
                 self.config.drain_seconds)
        self.cluster.stopping()  # a planned stop: a cluster's standby may take over at once, not after the lease
        for listener in listeners:
            listener.close()
        for listener in self.direct_listeners:
            listener.close()
        try:
            self.drain()
            self.process.flush_pending()
            deadline = time.monotonic() + SHUTDOWN_FLUSH_SECONDS
            while any(conn.outbox.out for conn in self.connections) and time.monotonic() < deadline:
                gevent.sleep(0.01)
            for conn in list(self.connections):
                conn.close()
            if not self.no_connections.wait(SHUTDOWN_CLEAN_UP_SECONDS):
                log.warning("%d clients still cleaning up; stopping anyway", len(self.connections))
            if self.metrics_server is not None:
                self.metrics_server.stop(timeout=1)
            if self.journal is not None:
                # everything recorded reaches the disk before exit 0, unless the disk is full: then
                # the stop is bounded, and what is not on disk was never confirmed
                self.journal.close(self.config.log_close_seconds)
        finally:
            self.stopped.set()

    def drain(self) -> None:
        """Deliver nothing more; tell hello'd consumers; wait up to --drain-seconds until nothing is un-acked.

        What is still un-acked afterwards goes back to its queue when the connections close
        (`Connection._clean_up`, through the journal with --data-dir): nothing is lost.
        """
        for conn in self.connections:
            conn.draining = True
            conn.outbox.paused = True  # Consumer.ready() and Queue.put see it: no delivery from now on
            if conn.said_hello:
                for consumer_id in conn.consumers_by_id:
                    conn.write(consumer_id + DRAINING)
        self.process.draining = True
        sessions: list[Any] = list(self.connections)
        if self.peers is not None:  # other workers' clients consuming here stop getting deliveries too
            for link in self.peers.incoming:
                for session in link.sessions.values():
                    session.outbox.paused = True
                    sessions.append(session)
        self.process.flush_pending()
        self.drain_ends_at = time.monotonic() + self.config.drain_seconds  # a second SIGTERM sets it to 0
        while time.monotonic() < self.drain_ends_at and any(
                consumer.unacked for session in sessions for consumer in session.consumers_by_id.values()):
            gevent.sleep(DRAIN_POLL_SECONDS)

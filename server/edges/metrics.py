"""The operator's HTTP side door: `GET /metrics` (Prometheus text format) and `GET /healthz`.

Beside the flow, not in it: `mqksd --metrics-port P` serves it from the broker's own gevent
loop (a `gevent.pywsgi.WSGIServer`, no thread), and it only reads. `StatsCollector` turns
`Process.stats()` and the deepest queues into metric families when a scrape asks, so
nothing is counted per message for it. common/figures.py names each key's kind and help; a key it
does not name (one a later issue adds) is still exported, as a gauge, if it is a number.

With `--workers N`, worker 0 serves the port and speaks for the whole broker. On a cluster node every group
owner of the node accepts on it (SO_REUSEPORT, as on the client port) and speaks for the node: the groups it
owns now and its processes, so Prometheus sums the nodes' figures into the cluster's, as for any set of targets.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from gevent.pywsgi import WSGIServer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from ...common.figures import COUNTER, FIGURES, GAUGE, LOG_FIGURES, Figure
from ..dispatch.process import Process
from .console import Console
from .listeners import reuse_port_socket

log = logging.getLogger("mqks.metrics")

def _number(value: Any) -> float | None:
    """A stats value as a sample, or None if it is not a number (a bool counts as 0 or 1)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


class StatsCollector(Collector):
    """Reads the workers when scraped: the process's figures, the log's, and the deepest queues.

    `scope` gives the workers to read (None: every one); a cluster node reads the groups it owns now, and `node`
    names it: {"cluster": ..., "node": ...}."""

    def __init__(self, process: Process, max_queues: int, scope: Callable[[], list[int] | None] = lambda: None,
                 node: dict[str, str] | None = None) -> None:
        self.process = process
        self.max_queues = max_queues
        self.scope = scope
        self.node = node

    def collect(self) -> Iterable[Metric]:
        peers = self.process.peers  # with worker processes: every worker's figures, asked for now
        workers = self.scope()
        stats = self.process.stats() if peers is None else peers.cluster_stats(workers)
        yield InfoMetricFamily("mqks_build", "The mqksd version.", value={"version": str(stats["version"])})
        if self.node is not None:
            yield InfoMetricFamily("mqks_cluster_node", "The cluster and the node these figures are of: the slot "
                                   "groups it owns now (mqks_workers of them).", value=self.node)
        for key, value in stats.items():
            figure = FIGURES.get(key) or Figure(GAUGE, f"stats: {key}.")  # a key the table lacks: a gauge
            sample = _number(value)
            if figure.kind is not None and sample is not None:
                yield _family(f"mqks_{key}", figure.kind, figure.help, sample)
        for key, value in stats.get("log", {}).items():
            figure = LOG_FIGURES.get(key) or Figure(GAUGE, f"log stats: {key}.")
            sample = _number(value)
            if figure.kind is not None and sample is not None:
                name = key if key.startswith("log_") else f"log_{key}"
                yield _family(f"mqks_{name}", figure.kind, figure.help, sample)
        log_figures = stats.get("log", {})
        if "stream" in log_figures:
            yield InfoMetricFamily("mqks_log_stream", "The replicated log's stream and the NATS server leading it.",
                                   value={"stream": str(log_figures["stream"]),
                                          "leader": str(log_figures.get("stream_leader", ""))})
        yield from self.queue_families()

    def queue_families(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily("mqks_queue_depth", f"Messages waiting in the queue (the {self.max_queues} "
                                  "deepest queues only: --metrics-max-queues).", labels=["queue"])
        unacked = GaugeMetricFamily("mqks_queue_unacked", "Messages of the queue delivered and not acked yet "
                                    "(the same queues as mqks_queue_depth).", labels=["queue"])
        leased = GaugeMetricFamily("mqks_queue_leased", "Messages of the queue held under fetch --lease "
                                   "(the same queues as mqks_queue_depth).", labels=["queue"])
        peers = self.process.peers
        deepest = (self.process.deepest_queues(self.max_queues) if peers is None
                   else peers.cluster_deepest_queues(self.max_queues, self.scope()))
        for name, waiting, held, under_lease in deepest:
            depth.add_metric([name], waiting)
            unacked.add_metric([name], held)
            leased.add_metric([name], under_lease)
        yield depth
        yield unacked
        yield leased


def _family(name: str, kind: str, help_text: str, value: float) -> Metric:
    if kind == COUNTER:
        return CounterMetricFamily(name, help_text, value=value)
    return GaugeMetricFamily(name, help_text, value=value)


class NodeProcessCollector(Collector):
    """A cluster node's processes as one (its supervisor and every process under it): prometheus_client's
    `process_*` names for memory, CPU and descriptors, summed from /proc at scrape time. One process's figures would
    change with the process that happens to accept the scrape."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self.page_bytes = os.sysconf("SC_PAGE_SIZE")
        self.ticks = os.sysconf("SC_CLK_TCK")

    def collect(self) -> Iterable[Metric]:
        resident = cpu = descriptors = 0.0
        for pid in process_tree(self.root_pid):
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
                cpu += (int(fields[11]) + int(fields[12])) / self.ticks
                resident += int(fields[21]) * self.page_bytes
                descriptors += len(os.listdir(f"/proc/{pid}/fd"))
            except (OSError, IndexError, ValueError):
                continue  # it ended meanwhile
        yield GaugeMetricFamily("process_resident_memory_bytes", "Resident memory of the node's processes, summed, "
                                "in bytes.", value=resident)
        yield CounterMetricFamily("process_cpu_seconds", "CPU time of the node's processes, user and system, "
                                  "summed, in seconds.", value=cpu)
        yield GaugeMetricFamily("process_open_fds", "Open file descriptors of the node's processes, summed.",
                                value=descriptors)


def process_tree(root_pid: int) -> list[int]:
    """`root_pid` and its live descendants."""
    found, pending = [], [root_pid]
    while pending:
        pid = pending.pop()
        found.append(pid)
        try:
            for thread in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{thread}/children", encoding="ascii") as f:
                    pending += [int(child) for child in f.read().split()]
        except OSError:
            continue
    return found


def make_registry(process: Process, max_queues: int, scope: Callable[[], list[int] | None] = lambda: None,
                  node: dict[str, str] | None = None, node_root_pid: int | None = None) -> CollectorRegistry:
    """A registry of its own (not prometheus_client's global one): the broker's figures and the process's (a cluster
    node's: those of the groups it owns, and of all its processes)."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(process, max_queues, scope, node))
    if node_root_pid is None:
        ProcessCollector(registry=registry)  # memory, CPU and descriptors, read from /proc at scrape time
    else:
        registry.register(NodeProcessCollector(node_root_pid))
    return registry


def make_app(registry: CollectorRegistry, health: Callable[[], str | None],
             console: Console | None = None) -> Callable[..., list[bytes]]:
    """The WSGI app: /metrics, /healthz (200 `ok`, or 503 and the reason `health` gives), the console, else 404."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if console is not None and path not in ("/metrics", "/healthz"):
            answer = console.answer(environ, start_response)
            if answer is not None:
                return answer
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return _answer(start_response, "405 Method Not Allowed", b"GET only\n", extra=[("Allow", "GET, HEAD")])
        if path == "/metrics":
            return _answer(start_response, "200 OK", generate_latest(registry), CONTENT_TYPE_LATEST)
        if path == "/healthz":
            reason = health()
            if reason is None:
                return _answer(start_response, "200 OK", b"ok\n")
            return _answer(start_response, "503 Service Unavailable", reason.encode() + b"\n")
        return _answer(start_response, "404 Not Found", b"not found: try /metrics or /healthz\n")

    return app


def _answer(start_response: Callable[..., Any], status: str, body: bytes,
            content_type: str = "text/plain; charset=utf-8", extra: Iterable[tuple[str, str]] = ()) -> list[bytes]:
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body))), *extra])
    return [body]


def metrics_server(host: str, port: int, registry: CollectorRegistry, health: Callable[[], str | None],
                   console: Console | None = None, shared: bool = False) -> WSGIServer:
    """The HTTP server, not started: `start()` binds it on the caller's gevent loop (`shared`: bound now, with
    SO_REUSEPORT, beside the node's other group owners; OSError if it cannot be)."""
    app = make_app(registry, health, console)
    # log=None: no access line per scrape; errors go to the broker's log
    return WSGIServer(reuse_port_socket(host, port) if shared else (host, port), app, log=None, error_log=log)

"""The operator's HTTP side door: `GET /metrics` (Prometheus text format) and `GET /healthz`.

Beside the flow, not in it: `mqksd --metrics-port P` serves it from the broker's own gevent
loop (a `gevent.pywsgi.WSGIServer`, no thread), and it only reads. `StatsCollector` turns
`Process.stats()` and the deepest queues into metric families when a scrape asks, so
nothing is counted per message for it. figures.py names each key's kind and help; a key it
does not name (one a later issue adds) is still exported, as a gauge, if it is a number.
"""

from __future__ import annotations

import logging
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

log = logging.getLogger("mqks.metrics")

def _number(value: Any) -> float | None:
    """A stats value as a sample, or None if it is not a number (a bool counts as 0 or 1)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


class StatsCollector(Collector):
    """Reads the workers when scraped: the process's figures, the log's, and the deepest queues."""

    def __init__(self, process: Process, max_queues: int) -> None:
        self.process = process
        self.max_queues = max_queues

    def collect(self) -> Iterable[Metric]:
        peers = self.process.peers  # with worker processes: every worker's figures, asked for now
        stats = self.process.stats() if peers is None else peers.cluster_stats()
        yield InfoMetricFamily("mqks_build", "The mqksd version.", value={"version": str(stats["version"])})
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
                   else peers.cluster_deepest_queues(self.max_queues))
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


def make_registry(process: Process, max_queues: int) -> CollectorRegistry:
    """A registry of its own (not prometheus_client's global one): the broker's figures and the process's."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(process, max_queues))
    ProcessCollector(registry=registry)  # memory, CPU and descriptors, read from /proc at scrape time
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


def metrics_server(host: str, port: int, process: Process, max_queues: int,
                   health: Callable[[], str | None], console: Console | None = None) -> WSGIServer:
    """The HTTP server, not started: `start()` binds it on the caller's gevent loop."""
    app = make_app(make_registry(process, max_queues), health, console)
    # log=None: no access line per scrape; errors go to the broker's log
    return WSGIServer((host, port), app, log=None, error_log=log)

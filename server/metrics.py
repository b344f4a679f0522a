"""The operator's HTTP side door: `GET /metrics` (Prometheus text format) and `GET /healthz`.

Beside the flow, not in it: `mqksd --metrics-port P` serves it from the broker's own gevent
loop (a `gevent.pywsgi.WSGIServer`, no thread), and it only reads. `StatsCollector` turns
`Workers.stats()` and the deepest queues into metric families when a scrape asks, so
nothing is counted per message for it. A stats key that the table below does not name
(one a later issue adds) is still exported, as a gauge, if it is a number.
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

from .workers import Workers

log = logging.getLogger("mqks.metrics")

# stats key -> (counter or gauge, help); the metric is mqks_{key} (a counter gets _total)
COUNTERS = "counter"
GAUGE = "gauge"
STATS_METRICS: dict[str, tuple[str, str]] = {
    "published": (COUNTERS, "Messages published to this process."),
    "queued": (COUNTERS, "Copies of messages put into queues (one per bound queue)."),
    "consumed": (COUNTERS, "Copies delivered to consumers."),
    "acked": (COUNTERS, "Deliveries acked."),
    "rejected": (COUNTERS, "Deliveries rejected or returned by a consumer that went away."),
    "ack_timeouts": (COUNTERS, "Deliveries returned to their queue because their --ack-timeout passed."),
    "touched": (COUNTERS, "Deliveries whose ack-timeout clock a touch restarted."),
    "dead_lettered": (COUNTERS, "Messages moved to a {queue}.dead queue past their queue's --max-retries."),
    "dropped": (COUNTERS, "Copies refused by a full queue (--max-length) or by --max-memory."),
    "requests": (COUNTERS, "Requests published (request/reply)."),
    "replies": (COUNTERS, "Replies passed on to their requester."),
    "replies_late": (COUNTERS, "Replies dropped because another reply had won."),
    "request_timeouts": (COUNTERS, "Requests answered with a timeout error: no reply in time."),
    "schedule_firings": (COUNTERS, "Publishes made by schedules."),
    "bytes_in": (COUNTERS, "Bytes read from client connections."),
    "bytes_out": (COUNTERS, "Bytes written to client connections."),
    "errors": (COUNTERS, "Error lines sent to clients."),
    "queues": (GAUGE, "Queues."),
    "consumers": (GAUGE, "Consumers attached to queues."),
    "messages_waiting": (GAUGE, "Messages waiting in queues for a consumer."),
    "messages_unacked": (GAUGE, "Messages delivered and not acked yet."),
    "leases": (GAUGE, "Leases holding messages fetched and not settled yet."),
    "messages_leased": (GAUGE, "Messages held under leases."),
    "events": (GAUGE, "Distinct events and masks that queues are bound to."),
    "delayed": (GAUGE, "Publishes waiting for their --delay or --at time."),
    "requests_waiting": (GAUGE, "Requests waiting for a reply."),
    "schedules": (GAUGE, "Schedules."),
    "memory_full": (GAUGE, "1 while resident memory is past --max-memory and publishes are refused."),
    "connections": (GAUGE, "Live client connections."),
    "workers": (GAUGE, "Workers of this process."),
    "uptime_seconds": (GAUGE, "Seconds since the broker started."),
}
# info, a duplicate, or per queue
NOT_EXPORTED = frozenset({"version", "clients", "top_queues", "top_leased_queues", "log", "worker"})
LOG_COUNTERS = frozenset({"commits", "fsyncs", "snapshots"})
LOG_HELP = {
    "log_bytes": "Bytes in the write-ahead log's segment files.",
    "segments": "Segment files of the write-ahead log.",
    "commits": "Commits (frames) written to the log.",
    "fsyncs": "fdatasync calls on the log.",
    "fsync_ms_p50": "Median fdatasync latency over the last 1024, in milliseconds.",
    "fsync_ms_p99": "99th percentile fdatasync latency over the last 1024, in milliseconds.",
    "unsynced_bytes": "Bytes written to the log and not yet durable.",
    "disk_full": "1 while the log cannot write for lack of space.",
    "blocked": "1 while the log cannot write for any reason (a full disk, no file descriptor for a new segment).",
    "replayed_records": "Records replayed from the log at the last start.",
    "truncated_bytes": "Bytes of torn tail cut off the log at the last start.",
    "recovery_seconds": "Seconds the last start spent replaying the log.",
    "snapshots": "Snapshots of the live state written to the log.",
    "confirms_waiting": "Confirmed publishes waiting for the log to make them durable.",
}


def _number(value: Any) -> float | None:
    """A stats value as a sample, or None if it is not a number (a bool counts as 0 or 1)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


class StatsCollector(Collector):
    """Reads the workers when scraped: the process's figures, the log's, and the deepest queues."""

    def __init__(self, workers: Workers, max_queues: int) -> None:
        self.workers = workers
        self.max_queues = max_queues

    def collect(self) -> Iterable[Metric]:
        peers = self.workers.peers  # with worker processes: every worker's figures, asked for now
        stats = self.workers.stats() if peers is None else peers.cluster_stats()
        yield InfoMetricFamily("mqks_build", "The mqksd version.", value={"version": str(stats["version"])})
        for key, value in stats.items():
            sample = _number(value)
            if key in NOT_EXPORTED or sample is None:
                continue
            kind, help_text = STATS_METRICS.get(key, (GAUGE, f"stats: {key}."))
            yield _family(f"mqks_{key}", kind, help_text, sample)
        for key, value in stats.get("log", {}).items():
            sample = _number(value)
            if sample is not None:
                kind = COUNTERS if key in LOG_COUNTERS else GAUGE
                name = key if key.startswith("log_") else f"log_{key}"
                yield _family(f"mqks_{name}", kind, LOG_HELP.get(key, f"log stats: {key}."), sample)
        yield from self.queue_families()

    def queue_families(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily("mqks_queue_depth", f"Messages waiting in the queue (the {self.max_queues} "
                                  "deepest queues only: --metrics-max-queues).", labels=["queue"])
        unacked = GaugeMetricFamily("mqks_queue_unacked", "Messages of the queue delivered and not acked yet "
                                    "(the same queues as mqks_queue_depth).", labels=["queue"])
        leased = GaugeMetricFamily("mqks_queue_leased", "Messages of the queue held under fetch --lease "
                                   "(the same queues as mqks_queue_depth).", labels=["queue"])
        peers = self.workers.peers
        deepest = (self.workers.deepest_queues(self.max_queues) if peers is None
                   else peers.cluster_deepest_queues(self.max_queues))
        for name, waiting, held, under_lease in deepest:
            depth.add_metric([name], waiting)
            unacked.add_metric([name], held)
            leased.add_metric([name], under_lease)
        yield depth
        yield unacked
        yield leased


def _family(name: str, kind: str, help_text: str, value: float) -> Metric:
    if kind == COUNTERS:
        return CounterMetricFamily(name, help_text, value=value)
    return GaugeMetricFamily(name, help_text, value=value)


def make_registry(workers: Workers, max_queues: int) -> CollectorRegistry:
    """A registry of its own (not prometheus_client's global one): the broker's figures and the process's."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(workers, max_queues))
    ProcessCollector(registry=registry)  # memory, CPU and descriptors, read from /proc at scrape time
    return registry


def make_app(registry: CollectorRegistry, health: Callable[[], str | None]) -> Callable[..., list[bytes]]:
    """The WSGI app: /metrics, /healthz (200 `ok`, or 503 and the reason `health` gives), else 404."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
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


def metrics_server(host: str, port: int, workers: Workers, max_queues: int,
                   health: Callable[[], str | None]) -> WSGIServer:
    """The HTTP server, not started: `start()` binds it on the caller's gevent loop."""
    app = make_app(make_registry(workers, max_queues), health)
    # log=None: no access line per scrape; errors go to the broker's log
    return WSGIServer((host, port), app, log=None, error_log=log)

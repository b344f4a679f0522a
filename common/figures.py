"""The broker's figures, beside the flow: one table of every `stats` key, read by the `stats` action's merge
over worker processes, by Prometheus (server/edges/metrics.py) and by the people's table (client/stats.py).

Pure data and one merge: no I/O, no broker state, so the client may import it too.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

COUNTER = "counter"
GAUGE = "gauge"
TOP_QUEUES = 10  # the deepest (and most leased) queues a stats answer ranks

# how several workers' values become one
SUM = "sum"  # counts and sizes: the workers' values added
ANY = "any"  # a flag: true if any worker's is
THIS = "this"  # the same for every worker (a version), or the asked worker's (its uptime)
OWN = "own"  # one worker's own: `stats --worker=N` shows it, the merged answer does not


class Figure(NamedTuple):
    """One key of the `stats` answer."""

    kind: str | None  # COUNTER or GAUGE for Prometheus (mqks_{key}[_total]); None: not exported
    help: str
    merge: str = SUM
    label: str = ""  # the row in the people's table (stats.py, `mqks stats`); "": not shown
    per_worker: bool = True  # False: the people's table shows it in the total column only


FIGURES: dict[str, Figure] = {
    # the people's table, in the order a message lives: published, queued, consumed, acked
    "published": Figure(COUNTER, "Messages published to this process.", label="messages published",
                        per_worker=False),
    "queued": Figure(COUNTER, "Copies of messages put into queues (one per bound queue).", label="messages queued"),
    "consumed": Figure(COUNTER, "Copies delivered to consumers.", label="messages consumed"),
    "acked": Figure(COUNTER, "Deliveries acked.", label="messages acked"),
    "rejected": Figure(COUNTER, "Deliveries rejected or returned by a consumer that went away.",
                       label="messages rejected"),
    "queues": Figure(GAUGE, "Queues.", label="queues"),
    "consumers": Figure(GAUGE, "Consumers attached to queues.", label="consumers"),
    "messages_waiting": Figure(GAUGE, "Messages waiting in queues for a consumer.", label="messages waiting in queues"),
    "messages_unacked": Figure(GAUGE, "Messages delivered and not acked yet.", label="messages waiting for ack"),
    "events": Figure(GAUGE, "Distinct events and masks that queues are bound to.", label="events subscribed"),
    "clients": Figure(None, "Live client connections (the same as connections).", label="clients", per_worker=False),
    "connections": Figure(GAUGE, "Live client connections.", label="connections", per_worker=False),
    "bytes_in": Figure(COUNTER, "Bytes read from client connections.", label="bytes received", per_worker=False),
    "bytes_out": Figure(COUNTER, "Bytes written to client connections.", label="bytes sent", per_worker=False),
    "errors": Figure(COUNTER, "Error lines sent to clients.", label="errors answered", per_worker=False),
    "refused_by_scope": Figure(COUNTER, "Lines refused because the token's scope does not allow them.",
                               label="refused by token scope", per_worker=False),
    # the rest, for Prometheus and the JSON
    "ack_timeouts": Figure(COUNTER, "Deliveries returned to their queue because their --ack-timeout passed."),
    "touched": Figure(COUNTER, "Deliveries whose ack-timeout clock a touch restarted."),
    "dead_lettered": Figure(COUNTER, "Messages moved to a {queue}.dead queue past their queue's --max-retries."),
    "purged": Figure(COUNTER, "Messages dropped by purge_queue."),
    "unrouted": Figure(COUNTER, "Publishes to an event no queue was bound to (gone at once; --mandatory refuses them).",
                       label="published to no queue", per_worker=False),
    "dead_requeued": Figure(COUNTER, "Dead letters moved back to their queue by requeue_dead."),
    "dropped": Figure(COUNTER, "Copies refused by a full queue (--max-length) or by --max-memory."),
    "requests": Figure(COUNTER, "Requests published (request/reply)."),
    "replies": Figure(COUNTER, "Replies passed on to their requester."),
    "replies_late": Figure(COUNTER, "Replies dropped because another reply had won."),
    "request_timeouts": Figure(COUNTER, "Requests answered with a timeout error: no reply in time."),
    "schedule_firings": Figure(COUNTER, "Publishes made by schedules."),
    "leases": Figure(GAUGE, "Leases holding messages fetched and not settled yet."),
    "messages_leased": Figure(GAUGE, "Messages held under leases."),
    "delayed": Figure(GAUGE, "Publishes waiting for their --delay or --at time."),
    "requests_waiting": Figure(GAUGE, "Requests waiting for a reply."),
    "schedules": Figure(GAUGE, "Schedules."),
    "memory_full": Figure(GAUGE, "1 while resident memory is past --max-memory and publishes are refused.", ANY),
    "workers": Figure(GAUGE, "Workers of this process."),
    "uptime_seconds": Figure(GAUGE, "Seconds since the broker started.", THIS),
    "version": Figure(None, "The mqksd version (mqks_build's label).", THIS),
    "worker": Figure(None, "Which worker answered.", OWN),
    "pid": Figure(GAUGE, "The worker's process id.", OWN),
    "top_queues": Figure(None, "The deepest queues, as (name, depth).", OWN),
    "top_leased_queues": Figure(None, "The queues with the most messages leased, as (name, count).", OWN),
    "log": Figure(None, "The write-ahead log's figures (LOG_FIGURES).", OWN),
    "worker_links": Figure(GAUGE, "Links to the other workers that are up.", OWN),
    "replica_queues": Figure(GAUGE, "Other workers' queues this worker knows the bindings of.", OWN),
    "dropped_unlinked": Figure(COUNTER, "Copies for a worker that was restarting (counted in dropped too).", OWN),
}

LOG_FIGURES: dict[str, Figure] = {
    "log_bytes": Figure(GAUGE, "Bytes in the write-ahead log's segment files."),
    "segments": Figure(GAUGE, "Segment files of the write-ahead log."),
    "commits": Figure(COUNTER, "Commits (frames) written to the log."),
    "fsyncs": Figure(COUNTER, "fdatasync calls on the log."),
    "fsync_ms_p50": Figure(GAUGE, "Median fdatasync latency over the last 1024, in milliseconds.", "max"),
    "fsync_ms_p99": Figure(GAUGE, "99th percentile fdatasync latency over the last 1024, in milliseconds.", "max"),
    "unsynced_bytes": Figure(GAUGE, "Bytes written to the log and not yet durable."),
    "disk_full": Figure(GAUGE, "1 while the log cannot write for lack of space.", ANY),
    "blocked": Figure(GAUGE, "1 while the log cannot write for any reason (a full disk, no file descriptor for a "
                             "new segment).", ANY),
    "replayed_records": Figure(GAUGE, "Records replayed from the log at the last start."),
    "truncated_bytes": Figure(GAUGE, "Bytes of torn tail cut off the log at the last start."),
    "recovery_seconds": Figure(GAUGE, "Seconds the last start spent replaying the log.", "max"),
    "snapshots": Figure(COUNTER, "Snapshots of the live state written to the log."),
    "confirms_waiting": Figure(GAUGE, "Confirmed publishes waiting for the log to make them durable."),
    # the replicated log (--log nats://...): server/journal/jetstream_log.py
    "stream_messages": Figure(GAUGE, "Messages (frames) in the replicated log's JetStream stream."),
    "frames_in_flight": Figure(GAUGE, "Frames sent to JetStream and not yet acknowledged."),
    "bytes_in_flight": Figure(GAUGE, "Bytes of the frames sent to JetStream and not yet acknowledged."),
    "puback_ms_p50": Figure(GAUGE, "Median JetStream PubAck latency over the last 1024 frames, in milliseconds.",
                            "max"),
    "puback_ms_p99": Figure(GAUGE, "99th percentile JetStream PubAck latency over the last 1024 frames, in "
                                   "milliseconds.", "max"),
    "stream": Figure(None, "The replicated log's stream (the mqks_log_stream info metric)."),
    "stream_leader": Figure(None, "The NATS server leading the stream (the mqks_log_stream info metric)."),
    "epoch": Figure(GAUGE, "The writer's epoch: one more at each takeover of the stream.", "max"),
    "last_seq": Figure(GAUGE, "The stream's last sequence as this writer knows it."),
    "stalls": Figure(COUNTER, "Times frames stopped being stored (a NATS election, NATS out of reach) until "
                              "the tail was read and writing went on."),
    "resent_frames": Figure(COUNTER, "Frames sent again after a stall (stored once: Nats-Msg-Id)."),
    "purges": Figure(COUNTER, "Purges of the stream below a stored snapshot."),
    "purge_failures": Figure(COUNTER, "Purges that failed (each is tried again, after 1 s doubling up to 30 s)."),
    "ignored_frames": Figure(GAUGE, "Frames of a fenced-off writer ignored at the last start."),
}


def merge_stats(answers: list[bytes], local: dict[str, Any], events: int) -> dict[str, Any]:
    """Every worker's `stats` as one: counts summed, top queues re-ranked, the rest as this worker has it.

    `answers` are the other workers' `{rid} ok {json}` lines; `events` counts each event or mask
    once however many workers' queues bind it.
    """
    per_worker = [local] + [json.loads(answer.partition(b" ok ")[2]) for answer in answers]
    figures: dict[str, Any] = {}
    for key, value in local.items():
        merge = FIGURES[key].merge if key in FIGURES else SUM
        if merge == OWN:
            continue
        if merge == ANY:
            figures[key] = any(one.get(key) for one in per_worker)
        elif merge == THIS or isinstance(value, bool) or not isinstance(value, int | float):
            figures[key] = value
        else:
            figures[key] = sum(one.get(key, 0) for one in per_worker)
    figures["workers"] = len(per_worker)
    figures["events"] = events
    # copies for a worker that was restarting count as dropped, as those of a full queue do
    figures["dropped"] = figures.get("dropped", 0) + sum(one.get("dropped_unlinked", 0) for one in per_worker)
    figures["top_queues"] = ranked(row for one in per_worker for row in one.get("top_queues", []))
    figures["top_leased_queues"] = ranked(row for one in per_worker for row in one.get("top_leased_queues", []))
    logs = [one["log"] for one in per_worker if one.get("log")]
    if logs:
        figures["log"] = merge_log_stats(logs)
    return figures


def ranked(rows: Any, limit: int = TOP_QUEUES) -> list[Any]:
    """(name, count) rows, the `limit` largest first (ties in the order given)."""
    return sorted(rows, key=lambda row: -row[1])[:limit]


def merge_log_stats(logs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every worker's log figures as one: sizes and counts summed, latencies the worst, flags if any has it."""
    merged: dict[str, Any] = {}
    for key, value in logs[0].items():
        values = [one.get(key, 0) for one in logs]
        merge = LOG_FIGURES[key].merge if key in LOG_FIGURES else SUM
        if isinstance(value, bool) or merge == ANY:
            merged[key] = any(values)
        elif isinstance(value, str):  # names (a stream, its leader): each worker's, once
            merged[key] = ", ".join(dict.fromkeys(str(one) for one in values))
        elif merge == "max":
            merged[key] = max(values)
        else:
            merged[key] = sum(values)
    return merged


def log_trouble(stats: dict[str, Any]) -> str | None:
    """Why one worker's log cannot write, from its `stats`; None while it can (or it has no log)."""
    figures = stats.get("log") or {}
    if figures.get("disk_full"):
        return "disk full"
    if figures.get("blocked"):
        return "the log cannot create a segment (out of file descriptors)"
    return None

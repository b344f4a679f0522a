"""What a `Server` (app.py) starts with, chosen once from its config: its log and the cluster over it, then recovery.

    open_journal    --data-dir: the disk log (journal/log.py), re-sharded first when one process takes over the logs
                    of several workers; --log: the JetStream stream (journal/jetstream_log.py), and with --cluster
                    the group this process stands by for or owns (cluster/group.py); else none. Without --cluster the
                    cluster is `NoCluster`, whose hooks do nothing.
    recover         the log replayed into the process before the first client is accepted; a log that cannot be
                    read ends the process with the exit code its supervisor or node acts on.

The cluster extra (NATS) is imported only for --log, and the storage layer only for a durable server.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import gevent

from .cluster.hooks import Cluster, NoCluster
from .core.restore import rebuild
from .edges.config import CANNOT_START_EXIT_CODE, FENCED_EXIT_CODE, Config
from .journal.journal import Journal
from .journal.recovery import recover_batches

if TYPE_CHECKING:
    from .cluster.map import SharedMap
    from .dispatch.process import Process
    from .edges.sessions import Tokens
    from .journal.jetstream_log import JetStreamLog
    from .journal.log import Log
    from .nats_io.nats_bridge import SharedNats

log = logging.getLogger("mqks.server")

ErrorLine = Callable[[bytes, str], bytes]


def open_journal(config: Config, error_line: ErrorLine, tokens: Tokens | None, shared_nats: SharedNats | None,
                 shared_map: SharedMap | None, on_map_change: Callable[[int], None]
                 ) -> tuple[Journal | None, Any, Cluster]:
    """(the journal, the hub's async watcher its log's writer wakes, the cluster); (None, None, NoCluster()) for a
    broker in memory. A cluster node's process shares one NATS connection and one watch of the map among its
    groups (`shared_nats`, `shared_map`); `on_map_change` hears of a group's new owner as the map opens."""
    if not (config.data_dir or config.log):
        return None, None, NoCluster()
    wake = gevent.get_hub().loop.async_()
    if config.log is None:
        return Journal(open_disk_log(config, wake.send), error_line, config.compact_min_bytes), wake, NoCluster()
    stream = open_stream(config, wake.send, shared_nats)
    journal = Journal(stream, error_line, config.compact_min_bytes)
    if config.cluster is None:
        return journal, wake, NoCluster()
    from .cluster.group import ClusterGroup
    from .edges.sessions import link_tls_contexts
    from .edges.supervisor import supervisor_pid

    link_tls = (link_tls_contexts(config.tls_cert, config.tls_key, config.tls_ca)
                if config.tls_cert and config.tls_key else None)  # links cross hosts: as encrypted as the clients
    cluster = ClusterGroup(config, stream, on_map_change, shared_map, tokens, link_tls, supervisor_pid())
    cluster.start()
    return journal, wake, cluster


def open_disk_log(config: Config, wake: Callable[[], None]) -> Log:
    """--data-dir: this worker's log (the storage layer is loaded only for a durable server)."""
    from .edges.reshard import ReshardError, log_dir, prepare
    from .journal.log import Log

    assert config.data_dir is not None
    if config.worker_index is None:  # one process: a log written by N workers comes back into one first
        try:
            summary = prepare(config.data_dir, 1, fsync=config.fsync, segment_bytes=config.log_segment_bytes,
                              repair=config.repair)
        except ReshardError as e:
            raise ValueError(str(e)) from None
        if summary:
            log.info("%s", summary)
    # with workers, each its own log; the supervisor has re-sharded them for this number of workers
    data_dir = log_dir(config.data_dir, config.worker_index or 0, config.workers)
    os.makedirs(data_dir, exist_ok=True)
    return Log(data_dir, config.fsync, segment_bytes=config.log_segment_bytes, wake=wake)


def open_stream(config: Config, wake: Callable[[], None], shared_nats: SharedNats | None) -> JetStreamLog:
    """--log: this worker's stream on the NATS cluster (the cluster extra is imported only here)."""
    from ..common.cluster_names import Layout, stream_of
    from .journal.jetstream_log import JetStreamLog
    from .nats_io.nats_bridge import BridgeError

    stream = config.log_stream if config.workers == 1 and not config.cluster else (
        stream_of(config.log_stream, config.worker_index or 0, config.workers))
    group: str | None = None
    subjects: list[str] | None = None
    layout = Layout(config.workers, config.streams)
    if config.cluster is not None and layout.shared:
        group, subjects = stream, layout.subjects_of(config.cluster, config.worker_index or 0)
        stream = layout.stream_of(config.cluster, config.worker_index or 0)
    owner = f"{socket.gethostname()}:{config.port} pid {os.getpid()}"
    lease = None
    if config.cluster is not None:
        from .cluster.group import owner_description
        from .cluster.lease import Lease

        owner = owner_description(config)
        lease = Lease(config.lease_seconds)
    urls = config.log_urls
    # a cluster's group is leased: an idle owner sends heartbeats, and steps down after a lease of no writes
    log_ = JetStreamLog(urls, stream, owner, replicas=config.log_replicas,
                        takeover=config.takeover, timeout_seconds=config.log_timeout, wake=wake,
                        lease=lease, node=config.node,
                        frame_wait_seconds=config.frame_wait_ms / 1000 if config.cluster else 0.0,
                        nats_options=config.nats_options(),
                        shared=shared_nats, group=group, stream_subjects=subjects)
    try:
        log_.open()
    except BridgeError as e:
        raise ValueError(str(e)) from None
    return log_


def log_shown(config: Config) -> str:
    """--log's NATS URLs as the log may show them: no password or token."""
    from ..common.nats_urls import shown

    return shown(config.log_urls)


def recover_journal(config: Config, journal: Journal, process: Process, batches: Iterable[Iterable[bytes]]) -> None:
    """Replay `batches` (the log's records, as the cluster hands them out) into the process before the first client is
    accepted; exit when the log cannot be read."""
    cannot_start: tuple[type[Exception], ...]
    if config.log is not None:
        from nats.errors import Error as NatsError

        from .journal.jetstream_log import LogOwned
        from .nats_io.nats_bridge import BridgeError

        # NatsError: JetStream's 503 while NATS elects a leader (a heal, issue 56) is a wait, not a traceback
        cannot_start = (LogOwned, BridgeError, NatsError)
    else:
        from .journal.log import LogCorrupt

        cannot_start = (LogCorrupt,)
    started = time.monotonic()
    try:
        recovery = recover_batches(batches)
        queues, messages = rebuild(recovery.queues, lambda name: process.broker)
        process.restore(recovery)
    except cannot_start as e:
        # names the file and offset and --repair, or the stream's owner, or what NATS answered
        log.error("cannot start: %s", str(e) or type(e).__name__)
        if config.cluster is not None:  # NATS went away while standing by: the node starts this one again
            sys.exit(FENCED_EXIT_CODE)
        sys.exit(1 if config.worker_index is None else CANNOT_START_EXIT_CODE)
    stats = journal.log.stats()
    # the whole log counts as churn: the first snapshot comes as soon as it is worth it
    journal.count_as_churn(stats.get("log_bytes", 0))
    log.info("recovered %d queues and %d messages from %s in %.3f s (%d records, %d bytes truncated)",
             queues, messages, config.data_dir or log_shown(config), time.monotonic() - started,
             stats.get("replayed_records", 0), stats.get("truncated_bytes", 0))

"""The operator's settings for one `mqksd`, built once from the command line.

Every default lives here and only here: `cli.parse_args` takes its argparse defaults
and help text from this dataclass, so the two can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...common.nats_urls import log_urls, nats_access
from ..wire.protocol import DEFAULT_MAX_LINE_BYTES


@dataclass(frozen=True, slots=True)
class Config:
    host: str = "127.0.0.1"  # loopback only unless the operator says otherwise
    port: int = 25000
    workers: int = 1
    log_level: str = "info"
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    max_output_bytes: int = 64 << 20
    eval_enabled: bool = False  # _eval is remote code execution: off unless asked for
    max_memory_bytes: int | None = None  # past this RSS, publishes are refused until consumers drain
    data_dir: str | None = None  # None: in memory only, as the spec's server
    fsync: str = "always"  # with data_dir: safe by default, fast by group commit
    repair: bool = False  # truncate the log at a bad frame instead of refusing to start
    log: str | None = None  # nats://host:port,...: the log is a replicated JetStream stream (the cluster extra)
    log_stream: str = "mqks"  # with log: the stream's name (a worker of several adds -{i}-of-{n})
    log_replicas: int = 3  # with log: a quorum of these fsyncs a frame before its confirms are answered
    log_timeout: float = 15.0  # with log: a confirm waits this long (> a NATS election), then gets an error
    log_ca: str | None = None  # with log: the CA that signed the NATS servers' certificates (TLS)
    log_cert: str | None = None  # with log: this broker's client certificate and key (mutual TLS)
    log_key: str | None = None
    log_creds: str | None = None  # with log: a NATS .creds file (a user JWT and its nkey seed)
    log_nkey: str | None = None  # with log: an nkey seed file
    takeover: bool = False  # with log: fence off a running owner of the stream instead of refusing to start
    cluster: str | None = None  # with log: this node is one of a cluster of that name (slot groups over nodes)
    node: str | None = None  # with cluster: this node's name, unique in the cluster
    advertise: str | None = None  # with cluster: the host other nodes and clients dial (default: --host)
    # with cluster: slot groups, each with its own subject, owner and standbys; None: the count the cluster's streams
    # on NATS have, DEFAULT_GROUPS for a new cluster (a node's supervisor asks, cluster/layout.py)
    groups: int | None = None
    streams: int = 1  # with cluster: JetStream streams the groups' subjects share (groups: a stream each)
    processes: int = 0  # with cluster: processes on this node, each holding several groups (0: one per core)
    lease_seconds: float = 12.0  # with cluster: a standby takes a group over after this long without a frame
    # with cluster: a group's next frame leaves at least this long after its last (ms): fewer, fuller frames
    frame_wait_ms: float = 20.0
    log_segment_bytes: int = 64 << 20
    compact_min_bytes: int = 128 << 20  # never rewrite the live state for less churn than this
    metrics_port: int | None = None  # None: no HTTP endpoint (/metrics, /healthz)
    metrics_host: str = "127.0.0.1"  # loopback, as the broker's own port
    metrics_max_queues: int = 100  # per-queue gauges for the deepest queues only: scrapes stay small
    console: bool = True  # the web console at / of the metrics port (edges/console.py), when that port is on
    console_actions: bool = False  # let the console change things (delete a queue): off, read-only by default
    tls_port: int | None = None  # None: no TLS listener
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None  # set: clients must present a certificate signed by this CA
    auth_token_file: str | None = None  # one token a line or TOML tables, re-read on SIGHUP; MQKS_AUTH_TOKEN adds one
    client_ttl: float | None = None  # None: a connection may stay silent for ever unless it says hello --ttl
    drain_seconds: float = 5.0  # on SIGTERM: how long consumers get to settle what they hold
    log_close_seconds: float = 10.0  # on SIGTERM: how long a log that cannot write (full disk) may hold the stop
    direct_port: int = 0  # with workers > 1: worker i's own port is this + i (0: any free port, told in hello)
    max_link_backlog_bytes: int = 512 << 20  # with workers > 1: a worker that leaves this unread loses its link
    worker_index: int | None = None  # set by the supervisor: this process is worker i of `workers`
    run_dir: str | None = None  # set by the supervisor: where the workers' Unix sockets are
    process_index: int | None = None  # set by a cluster node's supervisor: this process holds groups i, i+P, i+2P, ...

    @property
    def log_urls(self) -> list[str]:
        """`--log` as nats-py's list of servers (none without it): the one place the flag's text is read."""
        return log_urls(self.log or "")

    def nats_options(self) -> dict[str, Any]:
        """nats-py's connect() arguments for `--log`'s URLs: the --log-* files and the environment's credentials (a
        new TLS context each call)."""
        return nats_access(self).connect_options(self.log_urls)


DEFAULTS = Config()
DEFAULT_GROUPS = 4  # a new cluster's --groups: on 3 nodes about half the CPU a message of 16 (docs/cluster.md)
# a worker that cannot start because of its data (a corrupt log, an unreadable data dir): restarting
# it would fail the same way for ever, so its supervisor stops the whole broker (EX_CONFIG)
CANNOT_START_EXIT_CODE = 78
# the replicated log was taken over (--takeover elsewhere): this broker stopped confirming and exits (EX_TEMPFAIL)
FENCED_EXIT_CODE = 75

"""`mqksd`'s command line, on top of everything: the flags as a Config, then a supervisor of worker
processes or one `Server` (app.py). Every default and its meaning lives in edges/config.py.

Exit codes: 0 a clean stop, 1 cannot listen, the log is corrupt, NATS cannot be reached or another broker
owns the stream, 2 bad flags (argparse), 70 a failed fsync (server/journal/log.py), 75 the replicated log
was taken over by another broker (server/journal/jetstream_log.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import sys
from typing import NoReturn

from . import build
from .app import Server
from .dispatch.process import VERSION
from .edges.config import CANNOT_START_EXIT_CODE, DEFAULT_GROUPS, DEFAULTS, FENCED_EXIT_CODE, Config
from .edges.listeners import CannotListen
from .edges.sessions import AUTH_TOKEN_ENV, tls_server_context

log = logging.getLogger("mqks.server")

MAX_PORT = 65535


class Parser(argparse.ArgumentParser):
    """argparse, with a bad flag answered in one line (mqksd's usage alone is several) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the flags)\n")


def byte_size(text: str) -> int:
    """`512M`, `2G`, `1048576` -> bytes (K, M and G are powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    number, unit = (text[:-1], units[text[-1].upper()]) if text[-1:].upper() in units else (text, 1)
    try:
        return int(float(number) * unit)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 536870912, 512M, 2G)") from None


def worker_count(text: str) -> int:
    """`--workers`: a number, or `auto` for the cores this process may run on."""
    if text == "auto":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of workers: {text!r} (a number, or auto)") from None


def parse_args(argv: list[str] | None = None) -> Config:
    """The command line as a Config; defaults and their help text come from `config.DEFAULTS`."""
    d = DEFAULTS
    parser = Parser(prog="mqksd", description="MQKS broker: Message Queue Kept Simple.")
    parser.add_argument("--version", action="version", version=f"mqksd {VERSION}, hot path {build.kind}")
    parser.add_argument("--host", default=d.host, help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=d.port, help="TCP port (default: %(default)s)")
    parser.add_argument("--workers", type=worker_count, default=d.workers,
                        help="worker processes, or `auto` for one per core; a queue belongs to the worker that owns "
                             "its slot, crc32(queue) %% 16384 (default: %(default)s)")
    parser.add_argument("--direct-port", type=int, default=d.direct_port, metavar="PORT",
                        help="with --workers N: worker i also listens on PORT+i, for clients that reach a queue's "
                             "owner directly (default: any free port; hello tells clients)")
    parser.add_argument("--max-link-backlog", type=byte_size, default=d.max_link_backlog_bytes,
                        dest="max_link_backlog_bytes", metavar="BYTES",
                        help="with --workers N: bytes one worker may leave unread on its link from another (a "
                             "frozen worker) before that link is closed, as if it had restarted; K, M or G "
                             "(default: 512M)")
    parser.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"],
                        help="(default: %(default)s)")
    parser.add_argument("--max-line-bytes", type=int, default=d.max_line_bytes,
                        help="longest request line; longer lines are discarded with an error (default: %(default)s)")
    parser.add_argument("--max-output-bytes", type=int, default=d.max_output_bytes,
                        help="unsent bytes after which a client that does not read is disconnected "
                             "(deliveries pause at a quarter of it; default: %(default)s)")
    parser.add_argument("--max-memory", type=byte_size, default=d.max_memory_bytes, dest="max_memory_bytes",
                        metavar="BYTES",
                        help="past this resident memory (a number, or with K, M or G), publishes are refused "
                             "(confirmed ones with an error) while every other action keeps working, so consumers "
                             "drain the broker back under it (default: no limit)")
    parser.add_argument("--eval", action="store_true", dest="eval_enabled", default=d.eval_enabled,
                        help="enable the _eval backdoor (remote code execution; loopback clients only)")
    parser.add_argument("--data-dir", default=d.data_dir, metavar="DIR",
                        help="keep queues, bindings and messages in a write-ahead log in DIR (default: in memory)")
    parser.add_argument("--fsync", default=d.fsync, choices=["always", "everysec", "no"],
                        help="with --data-dir: when a confirmed publish is answered: after the fdatasync that "
                             "covers it (always), after the write, with an fdatasync every second (everysec), "
                             "or after the write, syncing left to the OS (no) (default: %(default)s)")
    parser.add_argument("--repair", action="store_true", default=d.repair,
                        help="with --data-dir: a bad frame in the log is cut off there instead of stopping the start")
    parser.add_argument("--log", default=d.log, metavar="NATS_URLS",
                        help="keep the write-ahead log in a NATS JetStream stream instead of a data dir: "
                             "nats://host:4222,host:4223,... (the cluster extra; docs/replicated-log.md)")
    parser.add_argument("--log-stream", default=d.log_stream, metavar="NAME",
                        help="with --log: the stream's name; with --workers N, worker i's is NAME-i-of-N "
                             "(default: %(default)s)")
    parser.add_argument("--log-replicas", type=int, default=d.log_replicas, metavar="N",
                        help="with --log: replicas of a new stream; a confirm waits for a majority of them "
                             "(default: %(default)s)")
    parser.add_argument("--log-timeout", type=float, default=d.log_timeout, metavar="SECONDS",
                        help="with --log: how long a confirm waits for NATS before it is answered with an error "
                             "and confirmed publishes are refused (default: %(default)s)")
    for flag, help_text in (("--log-ca", "the CA that signed the NATS servers' certificates (TLS; tls:// URLs)"),
                            ("--log-cert", "this broker's client certificate, for NATS servers that verify clients"),
                            ("--log-key", "the key of --log-cert"),
                            ("--log-creds", "a NATS .creds file (a user JWT and its nkey)"),
                            ("--log-nkey", "a NATS nkey seed file")):
        parser.add_argument(flag, default=None, metavar="FILE", help=f"with --log: {help_text}; a user and password "
                            "or a token come from MQKS_NATS_USER, MQKS_NATS_PASSWORD, MQKS_NATS_TOKEN, or the URL")
    parser.add_argument("--takeover", action="store_true", default=d.takeover,
                        help="with --log: take the stream over from a broker that still runs it; that broker's "
                             "next write is refused and it stops")
    parser.add_argument("--cluster", default=d.cluster, metavar="NAME",
                        help="with --log: run as one node of cluster NAME: every slot group has an owner node and "
                             "standbys, and a standby takes a group over when its owner stops writing "
                             "(docs/cluster.md)")
    parser.add_argument("--node", default=d.node, metavar="ID", help="with --cluster: this node's name")
    parser.add_argument("--advertise", default=d.advertise, metavar="HOST",
                        help="with --cluster: the host other nodes and clients reach this node at "
                             "(default: --host)")
    parser.add_argument("--groups", type=int, default=d.groups, metavar="N",
                        help="with --cluster: slot groups (the same on every node; default: the count the cluster's "
                             f"streams on NATS have, {DEFAULT_GROUPS} for a new cluster)")
    parser.add_argument("--streams", type=int, default=d.streams, metavar="S",
                        help="with --cluster: JetStream streams the groups share, at most --groups (the same on "
                             "every node; a cluster made before 2026-11-28 has a stream per group: --streams N "
                             "with its --groups N; default: %(default)s)")
    parser.add_argument("--processes", type=worker_count, default=d.processes,
                        help="with --cluster: processes on this node, each holding several of the slot groups; `auto` "
                             "(or 0, the default) for one per core")
    parser.add_argument("--process-index", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--lease", type=float, default=d.lease_seconds, dest="lease_seconds", metavar="SECONDS",
                        help="with --cluster: a standby takes a group over after this long without a frame from "
                             "its owner; more than a NATS election (default: %(default)s)")
    parser.add_argument("--frame-wait", type=float, default=d.frame_wait_ms, dest="frame_wait_ms", metavar="MS",
                        help="with --cluster: a group sends its next frame to NATS at least this long after its last "
                             "one, with every commit made meanwhile (each stream message costs NATS the same, full or "
                             "not; 0: as soon as the last is stored; default: %(default)s)")
    parser.add_argument("--log-segment-bytes", type=int, default=d.log_segment_bytes, metavar="N",
                        help="with --data-dir: size of one log file (default: %(default)s)")
    parser.add_argument("--compact-min-bytes", type=int, default=d.compact_min_bytes, metavar="N",
                        help="with --data-dir: the live state is rewritten (and older log files deleted) once the "
                             "log has grown by half its size, and by at least N bytes (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=d.metrics_port, metavar="PORT",
                        help="serve Prometheus /metrics and /healthz over HTTP on this port (default: off)")
    parser.add_argument("--metrics-host", default=d.metrics_host,
                        help="address of the metrics port (default: %(default)s)")
    parser.add_argument("--metrics-max-queues", type=int, default=d.metrics_max_queues, metavar="N",
                        help="per-queue gauges for the N deepest queues only (default: %(default)s)")
    parser.add_argument("--no-console", dest="console", action="store_false",
                        help="no web console at / of the metrics port (it is on whenever --metrics-port is)")
    parser.add_argument("--console-actions", action="store_true",
                        help="let the web console purge and delete queues and move dead letters back (POST "
                             "with the token and a CSRF token; a scoped token needs manage); default: read-only")
    parser.add_argument("--tls-port", type=int, default=d.tls_port, metavar="PORT",
                        help="also listen for TLS (1.2 or newer) on this port; needs --tls-cert and --tls-key "
                             "(default: off; --port 0 leaves TLS alone)")
    parser.add_argument("--tls-cert", default=d.tls_cert, metavar="FILE",
                        help="the server's certificate (PEM); with --cluster, the links between nodes use TLS with it "
                             "(and with --tls-ca, mutual TLS)")
    parser.add_argument("--tls-key", default=d.tls_key, metavar="FILE", help="its private key (PEM)")
    parser.add_argument("--tls-ca", default=d.tls_ca, metavar="FILE",
                        help="clients must present a certificate signed by this CA (PEM)")
    parser.add_argument("--auth-token-file", default=d.auth_token_file, metavar="FILE",
                        help="require `{id} auth {token}` first; one token per line, or TOML [[token]] tables "
                             "(scoped tokens), re-read on SIGHUP "
                             f"(the environment variable {AUTH_TOKEN_ENV} adds one token; default: no auth)")
    parser.add_argument("--client-ttl", type=float, default=d.client_ttl, metavar="SECONDS",
                        help="close any connection silent for 2x this, returning its un-acked messages "
                             "(a client's hello --ttl=S sets its own; default: off)")
    parser.add_argument("--drain-seconds", type=float, default=d.drain_seconds, metavar="SECONDS",
                        help="on SIGTERM, how long consumers get to ack what they hold before it is requeued "
                             "(default: %(default)s)")
    parser.add_argument("--log-close-seconds", type=float, default=d.log_close_seconds, metavar="SECONDS",
                        help="on SIGTERM, how long to wait for a log that cannot write (a full disk) before "
                             "stopping anyway; what was confirmed is on disk, what was not is logged "
                             "(default: %(default)s)")
    args = parser.parse_args(argv)
    for flag, value, minimum in (("--port", args.port, 0), ("--tls-port", args.tls_port, 1),
                                 ("--client-ttl", args.client_ttl, 0), ("--drain-seconds", args.drain_seconds, 0),
                                 ("--log-close-seconds", args.log_close_seconds, 0),
                                 ("--workers", args.workers, 1),
                                 ("--max-line-bytes", args.max_line_bytes, 64),
                                 ("--max-output-bytes", args.max_output_bytes, 4096),
                                 ("--log-segment-bytes", args.log_segment_bytes, 1),
                                 ("--log-replicas", args.log_replicas, 1), ("--log-timeout", args.log_timeout, 1),
                                 ("--groups", args.groups, 1), ("--streams", args.streams, 1),
                                 ("--lease", args.lease_seconds, 3), ("--frame-wait", args.frame_wait_ms, 0),
                                 ("--processes", args.processes, 0),
                                 ("--compact-min-bytes", args.compact_min_bytes, 0),
                                 ("--metrics-port", args.metrics_port, 1),
                                 ("--metrics-max-queues", args.metrics_max_queues, 0),
                                 ("--max-memory", args.max_memory_bytes, 1 << 20),
                                 ("--max-link-backlog", args.max_link_backlog_bytes, 1 << 20)):
        if value is not None and value < minimum:
            parser.error(f"{flag} must be at least {minimum}, not {value}")
    for flag, value in (("--port", args.port), ("--metrics-port", args.metrics_port), ("--tls-port", args.tls_port)):
        if value is not None and value > MAX_PORT:
            parser.error(f"{flag} must be a TCP port, at most {MAX_PORT}, not {value}")
    if args.metrics_port is not None and args.metrics_port == args.port and args.metrics_host == args.host:
        parser.error("--metrics-port must differ from --port")
    if args.processes and args.cluster is None:
        parser.error("--processes needs --cluster (one broker's processes are --workers)")
    if args.streams != d.streams and args.cluster is None:
        parser.error("--streams needs --cluster (a worker of several has a stream of its own)")
    check_tls_args(parser, args)
    check_log_args(parser, args)
    return Config(**vars(args))


def check_log_args(parser: Parser, args: argparse.Namespace) -> None:
    """One log at a time; --log needs the cluster extra and a stream name NATS accepts."""
    if args.log is None:
        if args.takeover:
            parser.error("--takeover needs --log")
        if args.cluster is not None:
            parser.error("--cluster needs --log nats://...: the groups' logs are streams on NATS")
        if args.node is not None or args.advertise is not None:
            parser.error("--node and --advertise need --cluster")
        return
    check_cluster_args(parser, args)
    if not args.log.replace(",", "").strip():
        parser.error("--log needs the NATS servers' URLs: nats://host:4222,host:4223,...")
    if args.data_dir is not None:
        parser.error("--log and --data-dir are two places for the same log: give one")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", args.log_stream):
        parser.error(f"--log-stream must be letters, digits, '-' or '_', not {args.log_stream!r}")
    from ..common.nats_urls import NatsAccess

    problem = NatsAccess(args.log_ca, args.log_cert, args.log_key, args.log_creds, args.log_nkey).problem()
    if problem is not None:
        parser.error(problem)
    if importlib.util.find_spec("nats") is None:
        parser.error("--log needs the cluster extra: .venv/bin/pip install -e '.[cluster]' in the clone (it brings "
                     "nats-py)")


def check_cluster_args(parser: Parser, args: argparse.Namespace) -> None:
    """A node of a cluster runs one process per slot group; its streams are named after the cluster."""
    if args.cluster is None:
        if args.node is not None or args.advertise is not None:
            parser.error("--node and --advertise need --cluster")
        return
    if args.node is None or not re.fullmatch(r"[A-Za-z0-9_-]+", args.node):
        parser.error("--cluster needs --node ID (letters, digits, '-' or '_'), unique in the cluster")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", args.cluster):
        parser.error(f"--cluster must be letters, digits, '-' or '_', not {args.cluster!r}")
    if args.takeover:
        parser.error("--takeover has no meaning with --cluster: standbys take groups over by themselves")
    if args.workers != 1:
        parser.error("--workers has no meaning with --cluster: a node's processes hold its slot groups (--processes "
                     "and --groups)")
    if args.advertise is not None:
        host, colon, port = args.advertise.rpartition(":")
        if colon and port.isdigit() and ":" not in host:  # host:port; an IPv6 address has more colons
            parser.error(f"--advertise takes a host, not host:port ({args.advertise!r}): the port others dial is "
                         f"--port, so give --advertise {host} --port {port}")
        if not re.fullmatch(r"[A-Za-z0-9_.:-]+", args.advertise):
            parser.error(f"--advertise must be a host name or an IP address, not {args.advertise!r}")
    if args.streams > (args.groups or DEFAULT_GROUPS):
        parser.error(f"--streams must be at most --groups ({args.groups or DEFAULT_GROUPS}), not {args.streams}: a "
                     "group's frames are in one stream")
    args.workers = args.groups or DEFAULT_GROUPS  # none given: the supervisor adopts the cluster's (cluster/layout.py)
    args.processes = args.processes or worker_count("auto")
    if args.groups is not None:  # at most one process per group (without --groups the supervisor caps it)
        args.processes = min(args.processes, args.groups)
    args.log_stream = args.cluster


def check_tls_args(parser: Parser, args: argparse.Namespace) -> None:
    """TLS flags come together; a certificate or key that cannot be loaded stops mqksd with exit 2, not later."""
    if args.tls_port is None:
        if args.port == 0:
            parser.error("--port 0 turns the plain port off: give --tls-port to listen somewhere")
        if not (args.tls_cert or args.tls_key or args.tls_ca):
            return
        if args.cluster is None:
            parser.error("--tls-cert, --tls-key and --tls-ca need --tls-port (or --cluster, for TLS between nodes)")
        if not (args.tls_cert and args.tls_key):
            parser.error("--cluster with TLS between nodes needs --tls-cert and --tls-key")
    elif not (args.tls_cert and args.tls_key):
        parser.error("--tls-port needs --tls-cert and --tls-key")
    if args.tls_port is not None and args.tls_port == args.port:
        parser.error("--tls-port must differ from --port")
    try:
        tls_server_context(args.tls_cert, args.tls_key, args.tls_ca)
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
        parser.error(f"cannot load the TLS certificate, key or CA: {e}")


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    if config.process_index is not None:  # a cluster node's process: its groups' lines say which group
        from .cluster.node_process import GroupTag

        handler = logging.StreamHandler(sys.stderr)
        handler.addFilter(GroupTag(config.process_index))
        logging.basicConfig(handlers=[handler], level=config.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s%(where)s: %(message)s")
    else:
        worker = "" if config.worker_index is None else f" worker-{config.worker_index}"
        logging.basicConfig(stream=sys.stderr, level=config.log_level.upper(),
                            format=f"%(asctime)s %(levelname)s %(name)s{worker}: %(message)s")
    if (config.workers > 1 or config.cluster) and config.worker_index is None and config.process_index is None:
        from .edges.supervisor import Supervisor

        sys.exit(Supervisor(config, sys.argv[1:] if argv is None else argv).run())
    if config.worker_index is not None or config.process_index is not None:
        from .edges.supervisor import die_with_parent

        die_with_parent()
    if config.process_index is not None:
        sys.exit(serve_groups(config))
    try:
        server = Server(config)
    except (OSError, ValueError) as e:  # the data dir, the token file: a restart would fail the same way
        log.error("cannot start: %s", e)
        if config.cluster and config.worker_index is not None:  # NATS out of reach: the node tries again
            sys.exit(FENCED_EXIT_CODE)
        sys.exit(1 if config.worker_index is None else CANNOT_START_EXIT_CODE)
    try:
        server.serve_forever()
        if server.exit_code:
            sys.exit(server.exit_code)
    except CannotListen as e:
        log.error("%s", e)
        sys.exit(1)
    except (OSError, ValueError) as e:
        log.error("cannot start: %s", e)
        sys.exit(1)


def serve_groups(config: Config) -> int:
    """A cluster node's process: its groups, each a Server, over one NATS connection."""
    from ..common.cluster_names import bucket_of
    from .cluster.map import SharedMap
    from .cluster.node_process import NodeProcess
    from .nats_io.nats_bridge import SharedNats

    assert config.log is not None and config.cluster is not None and config.node is not None
    assert config.process_index is not None
    urls = config.log_urls
    shared = SharedNats(urls, options=config.nats_options())
    shared_map = SharedMap(shared, bucket_of(config.cluster), config.node, config.process_index, config.log_replicas)
    try:
        return NodeProcess(config, lambda group_config: Server(group_config, shared, shared_map)).run()
    finally:
        shared.close()

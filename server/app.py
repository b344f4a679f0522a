"""The `mqksd` process: command line, logging, the listener, timers and signals.

One `Server` per process wires the parts together: the `Workers` (a queue belongs to
worker `crc32(queue) % workers`), the one timer heap and its greenlet, the error ids, and
a `Connection` per client, which gets the workers and an error-id source, never the
server itself. SIGTERM or SIGINT stops accepting, flushes what is owed, and exits 0.
With `--metrics-port` the same loop serves `/metrics` and `/healthz` (server/metrics.py).

Exit codes: 0 a clean stop, 1 cannot listen or the log is corrupt, 2 bad flags (argparse),
70 a failed fsync (server/log.py).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, NoReturn

import gevent
from gevent.event import Event
from gevent.server import StreamServer

from .actions import handlers_for
from .config import DEFAULTS, Config
from .connection import Connection
from .durable import Journal, rebuild, recover
from .protocol import format_error
from .timers import Timers
from .workers import VERSION, Workers

if TYPE_CHECKING:
    from gevent.pywsgi import WSGIServer

log = logging.getLogger("mqks.server")

SHUTDOWN_FLUSH_SECONDS = 5.0
SHUTDOWN_CLEAN_UP_SECONDS = 2.0
MAX_PORT = 65535
MEMORY_CHECK_SECONDS = 0.01  # at 1M msg/s of 100 bytes, ~2 MB of messages come in between two checks
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def resident_bytes() -> int:
    """This process's resident set size (Linux)."""
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * PAGE_BYTES


class CannotListen(Exception):
    """A port the server must listen on cannot be bound (exit 1)."""


class AcceptFailed(Exception):
    """accept() ran out of descriptors or memory; gevent backs off and retries (up to 1 s apart)."""


class Listener(StreamServer):
    """The StreamServer, reporting a burst of failed accepts in one log line, not a traceback each."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.failed_accepts = 0

    def do_read(self):
        try:
            accepted = super().do_read()
        except OSError as e:
            if e.errno not in OUT_OF_RESOURCES:
                raise
            if not self.failed_accepts:
                log.error("cannot accept new connections: %s; retrying, existing clients are still served", e)
            self.failed_accepts += 1
            raise AcceptFailed(str(e)) from None
        if accepted and self.failed_accepts:
            log.warning("accepting again after %d failed accepts", self.failed_accepts)
            self.failed_accepts = 0
        return accepted


class ErrorIds:
    """24-character error ids, unique over the server's life and sortable by time, as the original's.

    UTC to the microsecond, kept strictly increasing (one id per microsecond at most, and a
    clock stepped back never repeats one), then 4 random hex digits that keep ids of
    separate processes apart.
    """

    __slots__ = ("last_us",)

    def __init__(self) -> None:
        self.last_us = 0

    def __call__(self) -> str:
        now_us = max(time.time_ns() // 1000, self.last_us + 1)
        self.last_us = now_us
        seconds, micros = divmod(now_us, 1_000_000)
        stamp = datetime.fromtimestamp(seconds, UTC).strftime("%Y%m%d%H%M%S")
        return f"{stamp}{micros:06d}{os.urandom(2).hex()}"


class Server:
    """The process: config, workers, timers, error ids, live connections, the listener."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.connections: set[Connection] = set()
        self.timers_due = Event()
        self.timers = Timers(on_earlier=self.timers_due.set)
        self.next_error_id = ErrorIds()
        self.journal = self.open_journal() if config.data_dir else None
        self.workers = Workers(config.workers, self.timers, self.journal)
        self.workers.error_line = self.error_line
        self.workers.max_memory_bytes = config.max_memory_bytes
        self.stream_server: Listener | None = None
        self.metrics_server: WSGIServer | None = None
        self.no_connections = Event()  # set whenever the last connection's clean-up is done
        self.no_connections.set()
        self.stopped = Event()  # shutdown is complete: serve_forever may return

    def open_journal(self) -> Journal:
        """The write-ahead log in --data-dir, woken from its writer thread through a gevent async watcher."""
        from .log import Log  # only durable servers load the storage layer

        config = self.config
        assert config.data_dir is not None
        self.log_wake = gevent.get_hub().loop.async_()
        log_ = Log(config.data_dir, config.fsync, segment_bytes=config.log_segment_bytes, wake=self.log_wake.send)
        return Journal(log_, self.error_line, config.compact_min_bytes)

    def error_line(self, rid: bytes, reason: str) -> bytes:
        error_id = self.next_error_id()
        self.workers.errors += 1
        log.warning("error %s: %s (rid %r)", error_id, reason, rid[:80])
        return format_error(rid, error_id, reason)

    def recover(self) -> None:
        """Replay the log into the workers before the first client is accepted."""
        journal = self.journal
        assert journal is not None
        from .log import LogCorrupt

        started = time.monotonic()
        records = journal.log.replay(repair=self.config.repair)
        try:
            recovery = recover(records)
            queues, messages = rebuild(recovery.queues, self.workers.worker_for)
            self.workers.restore(recovery)
        except LogCorrupt as e:
            log.error("cannot start: %s", e)  # names the file, the offset and --repair
            sys.exit(1)
        stats = journal.log.stats()
        # the whole log counts as churn: the first snapshot comes as soon as it is worth it
        journal.count_as_churn(stats.get("log_bytes", 0))
        log.info("recovered %d queues and %d messages from %s in %.3f s (%d records, %d bytes truncated)",
                 queues, messages, self.config.data_dir, time.monotonic() - started,
                 stats.get("replayed_records", 0), stats.get("truncated_bytes", 0))

    def on_log_wake(self) -> None:
        """The log made commits durable (or failed them): answer their confirms."""
        assert self.journal is not None
        self.journal.settle()
        self.workers.flush_pending()

    def run_timers(self) -> None:
        """The process's one timer greenlet: sleep until the earliest deadline, run what is due."""
        timers, due = self.timers, self.timers_due
        while True:
            due.wait(timers.next_delay())
            due.clear()
            if timers.run_due():
                self.workers.flush_pending()

    def check_memory(self) -> None:
        """Every MEMORY_CHECK_SECONDS with --max-memory: past the limit, publishes are refused until it drains.

        Refusal swaps each connection's handler table, so the publish path itself checks nothing.
        A broker that holds no message is never refusing, whatever its RSS: only messages can drain.
        """
        workers = self.workers
        limit = self.config.max_memory_bytes
        assert limit is not None
        over = resident_bytes() > limit and workers.holds_messages()
        if over != workers.memory_full:
            workers.memory_full = over
            log.warning("resident memory %s --max-memory=%d: publishes are %s", "over" if over else "back under",
                        limit, "refused until consumers drain the queues" if over else "accepted again")
            for conn in self.connections:
                conn.handlers = handlers_for(conn.eval_enabled, conn.peer_is_loopback, over)
        self.timers.call_later(MEMORY_CHECK_SECONDS, self.check_memory)

    def handle(self, sock: socket.socket, address: object) -> None:
        conn = Connection(sock, address, self.config, self.workers, self.next_error_id)
        if self.workers.memory_full:
            conn.handlers = handlers_for(conn.eval_enabled, conn.peer_is_loopback, True)
        self.connections.add(conn)
        self.no_connections.clear()
        try:
            conn.serve()
        finally:
            self.connections.discard(conn)
            if not self.connections:
                self.no_connections.set()

    def health(self) -> str | None:
        """None while the broker accepts connections and its log can write; else why not (`/healthz`)."""
        listener = self.stream_server
        if listener is None or listener.closed:
            return "not accepting connections: starting or stopping"
        if listener.failed_accepts:
            return "not accepting connections: out of file descriptors or memory"
        if self.journal is not None and self.journal.disk_full:
            return "disk full: the log cannot write, confirmed publishes are refused"
        return None

    def listen(self) -> None:
        """Bind the broker's port and, with --metrics-port, the HTTP one; CannotListen names the one that failed."""
        config = self.config
        self.stream_server = Listener((config.host, config.port), self.handle, backlog=1024)
        try:
            self.stream_server.init_socket()
        except OSError as e:
            raise CannotListen(f"cannot listen on {config.host}:{config.port}: {e}") from None
        if config.metrics_port is not None:
            from .metrics import metrics_server  # prometheus_client is loaded only when asked for

            self.metrics_server = metrics_server(config.metrics_host, config.metrics_port, self.workers,
                                                 config.metrics_max_queues, self.health)
            try:
                self.metrics_server.start()
            except OSError as e:
                raise CannotListen(f"cannot listen for metrics on {config.metrics_host}:{config.metrics_port}: "
                                   f"{e}") from None
            log.info("metrics on http://%s:%d/metrics and /healthz", config.metrics_host,
                     self.metrics_server.server_port)

    def serve_forever(self) -> None:
        config = self.config
        if self.journal is not None:
            self.recover()
            self.log_wake.start(self.on_log_wake)
        self.listen()
        assert self.stream_server is not None
        hub = gevent.get_hub()
        hub.NOT_ERROR = (*hub.NOT_ERROR, AcceptFailed)  # logged by Listener, once per burst
        gevent.spawn(self.run_timers)
        if config.max_memory_bytes is not None:
            self.check_memory()
        for signum in (signal.SIGTERM, signal.SIGINT):
            gevent.signal_handler(signum, gevent.spawn, self.shutdown)
        log.info("mqksd listening on %s:%d (workers=%d, eval=%s, %s)", config.host, self.stream_server.server_port,
                 config.workers, "on" if config.eval_enabled else "off",
                 f"data dir {config.data_dir}, fsync {config.fsync}" if config.data_dir else "in memory")
        self.stream_server.start()
        self.stopped.wait()  # not the listener's serve_forever: it returns as soon as the listener closes
        log.info("mqksd stopped")

    def shutdown(self) -> None:
        """Stop accepting, give every client what it is owed, then close.

        In this order: each connection is shut down and its reader cleans up (consumers
        detached, un-acked messages back in their queues, the log told) before the log
        closes; only then may `serve_forever` return and the process exit.
        """
        if self.stream_server is None or self.stream_server.closed:
            return
        log.info("stopping: no new connections, flushing %d clients", len(self.connections))
        self.stream_server.close()
        try:
            self.workers.flush_pending()
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
                self.journal.close()  # everything recorded reaches the disk before exit 0
        finally:
            self.stopped.set()


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


def parse_args(argv: list[str] | None = None) -> Config:
    """The command line as a Config; defaults and their help text come from `config.DEFAULTS`."""
    d = DEFAULTS
    parser = Parser(prog="mqksd", description="MQKS broker: Message Queue Kept Simple.")
    parser.add_argument("--version", action="version", version=f"mqksd {VERSION}")
    parser.add_argument("--host", default=d.host, help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=d.port, help="TCP port (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=d.workers,
                        help="workers; a queue belongs to crc32(queue) %% workers (default: %(default)s)")
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
    args = parser.parse_args(argv)
    for flag, value, minimum in (("--port", args.port, 0), ("--workers", args.workers, 1),
                                 ("--max-line-bytes", args.max_line_bytes, 64),
                                 ("--max-output-bytes", args.max_output_bytes, 4096),
                                 ("--log-segment-bytes", args.log_segment_bytes, 1),
                                 ("--compact-min-bytes", args.compact_min_bytes, 0),
                                 ("--metrics-port", args.metrics_port, 1),
                                 ("--metrics-max-queues", args.metrics_max_queues, 0),
                                 ("--max-memory", args.max_memory_bytes, 1 << 20)):
        if value is not None and value < minimum:
            parser.error(f"{flag} must be at least {minimum}, not {value}")
    for flag, value in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if value is not None and value > MAX_PORT:
            parser.error(f"{flag} must be a TCP port, at most {MAX_PORT}, not {value}")
    if args.metrics_port is not None and args.metrics_port == args.port and args.metrics_host == args.host:
        parser.error("--metrics-port must differ from --port")
    return Config(**vars(args))


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        Server(config).serve_forever()
    except CannotListen as e:
        log.error("%s", e)
        sys.exit(1)
    except OSError as e:  # the data dir, for one
        log.error("cannot start: %s", e)
        sys.exit(1)


if __name__ == "__main__":
    main()

"""The `mqksd` process: command line, logging, the listener, timers and signals.

One `Server` per process wires the parts together: the `Workers` (a queue belongs to
worker `crc32(queue) % workers`), the one timer heap and its greenlet, the error ids, and
a `Connection` per client, which gets the workers and an error-id source, never the
server itself. SIGTERM or SIGINT stops accepting, flushes what is owed, and exits 0.
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

import gevent
from gevent.event import Event
from gevent.server import StreamServer

from .config import DEFAULTS, Config
from .connection import Connection
from .timers import Timers
from .workers import Workers

log = logging.getLogger("mqks.server")

SHUTDOWN_FLUSH_SECONDS = 5.0
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


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
        self.workers = Workers(config.workers, self.timers.call_later)
        self.next_error_id = ErrorIds()
        self.stream_server: Listener | None = None

    def run_timers(self) -> None:
        """The process's one timer greenlet: sleep until the earliest deadline, run what is due."""
        timers, due = self.timers, self.timers_due
        while True:
            due.wait(timers.next_delay())
            due.clear()
            if timers.run_due():
                self.workers.flush_pending()

    def handle(self, sock: socket.socket, address: object) -> None:
        conn = Connection(sock, address, self.config, self.workers, self.next_error_id)
        self.connections.add(conn)
        try:
            conn.serve()
        finally:
            self.connections.discard(conn)

    def serve_forever(self) -> None:
        config = self.config
        self.stream_server = Listener((config.host, config.port), self.handle, backlog=1024)
        self.stream_server.init_socket()
        hub = gevent.get_hub()
        hub.NOT_ERROR = (*hub.NOT_ERROR, AcceptFailed)  # logged by Listener, once per burst
        gevent.spawn(self.run_timers)
        for signum in (signal.SIGTERM, signal.SIGINT):
            gevent.signal_handler(signum, gevent.spawn, self.shutdown)
        log.info("mqksd listening on %s:%d (workers=%d, eval=%s)", config.host, self.stream_server.server_port,
                 config.workers, "on" if config.eval_enabled else "off")
        self.stream_server.serve_forever()
        log.info("mqksd stopped")

    def shutdown(self) -> None:
        """Stop accepting, give every client what it is owed, then close."""
        if self.stream_server is None or self.stream_server.closed:
            return
        log.info("stopping: no new connections, flushing %d clients", len(self.connections))
        self.stream_server.close()
        self.workers.flush_pending()
        deadline = time.monotonic() + SHUTDOWN_FLUSH_SECONDS
        while any(conn.outbox.out for conn in self.connections) and time.monotonic() < deadline:
            gevent.sleep(0.01)
        for conn in list(self.connections):
            conn.close()
        self.stream_server.stop(timeout=1)


def parse_args(argv: list[str] | None = None) -> Config:
    """The command line as a Config; defaults and their help text come from `config.DEFAULTS`."""
    d = DEFAULTS
    parser = argparse.ArgumentParser(prog="mqksd", description="MQKS broker: Message Queue Kept Simple.")
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
    parser.add_argument("--eval", action="store_true", dest="eval_enabled", default=d.eval_enabled,
                        help="enable the _eval backdoor (remote code execution; loopback clients only)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.max_line_bytes < 64:
        parser.error("--max-line-bytes must be at least 64")
    if args.max_output_bytes < 4096:
        parser.error("--max-output-bytes must be at least 4096")
    return Config(**vars(args))


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        Server(config).serve_forever()
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, e)
        sys.exit(1)


if __name__ == "__main__":
    main()

"""The `mqksd` process: command line, logging, the StreamServer, shards and signals.

One `Server` per process holds the shards (`Broker`s; a queue belongs to shard
`crc32(queue) % workers`), the live connections and the list of outboxes waiting for a
flush. SIGTERM or SIGINT stops accepting, flushes what is owed, and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass

import gevent
from gevent.server import StreamServer

from .actions import shard_for
from .connection import Connection
from .protocol import DEFAULT_MAX_LINE_BYTES
from .state import Broker, Outbox

log = logging.getLogger("mqks.server")

SHUTDOWN_FLUSH_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class Config:
    host: str = "127.0.0.1"
    port: int = 25000
    workers: int = 1
    log_level: str = "info"
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    max_output_bytes: int = 64 << 20
    eval_enabled: bool = False


class Server:
    """Process-wide state: config, shards, connections, pending flushes."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.connections: set[Connection] = set()
        self.pending: list[Outbox] = []
        self.shards = [Broker(worker, config.workers, schedule, self.connections)
                       for worker in range(config.workers)]
        self.error_prefix = os.urandom(2).hex()
        self.errors = 0
        self.stream_server: StreamServer | None = None

    def next_error_id(self) -> str:
        self.errors += 1
        return f"{self.error_prefix}{self.errors:x}"

    def flush_pending(self) -> None:
        """Flush every connection that has output since the last flush."""
        pending = self.pending
        for outbox in pending:
            outbox.flush_pending = False
            outbox.flush()
        pending.clear()

    def resume(self, conn: Connection) -> None:
        """A paused connection drained: hand its consumers the messages that waited."""
        for consumer in list(conn.consumers_by_id.values()):
            shard_for(conn, consumer.queue.name).pump(consumer.queue)
        self.flush_pending()

    def handle(self, sock, address) -> None:
        Connection(sock, address, self).serve()

    def serve_forever(self) -> None:
        config = self.config
        self.stream_server = StreamServer((config.host, config.port), self.handle, backlog=1024)
        self.stream_server.init_socket()
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
        self.flush_pending()
        deadline = time.monotonic() + SHUTDOWN_FLUSH_SECONDS
        while any(conn.out for conn in self.connections) and time.monotonic() < deadline:
            gevent.sleep(0.01)
        for conn in list(self.connections):
            conn.close()
        self.stream_server.stop(timeout=1)


def schedule(seconds: float, fn) -> object:
    """Run `fn` after `seconds`; returns the cancel callable the broker keeps."""
    return gevent.spawn_later(seconds, fn).kill


def parse_args(argv: list[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(prog="mqksd", description="MQKS broker: Message Queue Kept Simple.")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=25000, help="TCP port (default: 25000)")
    parser.add_argument("--workers", type=int, default=1, help="shards; a queue belongs to crc32(queue) %% workers")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--max-line-bytes", type=int, default=DEFAULT_MAX_LINE_BYTES,
                        help="longest request line; longer lines are discarded with an error (default: 1 MiB)")
    parser.add_argument("--max-output-bytes", type=int, default=64 << 20,
                        help="unsent bytes after which a client that does not read is disconnected "
                             "(deliveries pause at a quarter of it; default: 64 MiB)")
    parser.add_argument("--eval", action="store_true", dest="eval_enabled",
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

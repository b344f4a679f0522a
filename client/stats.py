"""The broker's figures for people: read the `stats` action, print a table or JSON.

Used by the root `stats.py` and by `mqks stats`; `mqks top` reuses the formatting helpers. The
broker's `stats` answer is the whole broker's figures (summed over workers by the broker itself);
`stats --worker=N` is one worker's. With more than one worker the table has a column per worker.
Invariants: a figure the broker does not report shows as "-", never as a made-up 0; with `--json`
stdout holds only JSON, one object per print: the broker's figures, or `{"error": ...}`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import ssl
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import gevent
from gevent.event import Event

from mqks.common.figures import FIGURES as ALL_FIGURES
from mqks.common.figures import TOP_QUEUES

from . import wire
from .client import Client
from .errors import MqksError
from .placement import parse_seeds
from .tls import client_context, token_setting

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # `mqks`'s and stats.py's log lines on stderr
EXIT_INTERRUPTED = 130  # a one-shot command interrupted by Ctrl-C (a --watch ends with 0, as `mqks consume`)

# (key in the stats answer, label) in the order a message lives: published, queued, consumed, acked
FIGURES: tuple[tuple[str, str], ...] = tuple((key, figure.label) for key, figure in ALL_FIGURES.items() if figure.label)
# counted once for the whole process, not per worker: shown in the total column only
PROCESS_WIDE_FIGURES = frozenset(key for key, figure in ALL_FIGURES.items() if figure.label and not figure.per_worker)


class Parser(argparse.ArgumentParser):
    """argparse, except that with `json_errors` a usage error is also one JSON object on stdout."""

    def __init__(self, *args: Any, json_errors: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.json_errors = json_errors
        self.commands_by_name: Mapping[str, argparse.ArgumentParser] = {}  # `mqks`'s subcommands, for their errors

    def error(self, message: str) -> NoReturn:
        if self.json_errors:
            print_json_error(f"usage: {message}")
        super().error(message)


def print_json_error(reason: str) -> None:
    """`{"error": reason}` on stdout: what `--json` prints instead of the figures when they cannot be had."""
    print(json.dumps({"error": reason}), flush=True)


def said_by_a_command(error: MqksError) -> str:
    """A client's error as `mqks` and stats.py say it: a token is given there with --token, not Client(token=...)."""
    reason = str(error)
    head, found, _ = reason.partition(wire.TOKEN_REQUIRED)
    return f"{head}{wire.TOKEN_REQUIRED}: give --token or set MQKS_AUTH_TOKEN" if found else reason


def read_stats(client: Client, per_worker: bool = True) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the whole broker's figures, each worker's); the second is empty with one worker or `per_worker=False`."""
    total = client.stats()
    workers = total.get("workers")
    if not per_worker or not isinstance(workers, int) or workers <= 1:
        return total, []
    return total, [client.stats(worker=worker) for worker in range(workers)]


def render_table(total: dict[str, Any], per_worker: list[dict[str, Any]], address: str, heading: str = "total") -> str:
    """A plain-text table: one row per figure, a column per worker (when more than one), the total (`heading`
    names that last column: `worker 1` for `--worker 1`'s figures); then the log's figures (with a data dir) and
    the deepest queues."""
    columns = [*per_worker, total]
    headers = [f"worker {stats.get('worker', n)}" for n, stats in enumerate(per_worker)] + [heading]
    rows = []
    for key, label in FIGURES:
        if per_worker and key in PROCESS_WIDE_FIGURES:
            rows.append((label + " *", [""] * len(per_worker) + [cell(total.get(key))]))
        else:
            rows.append((label, [cell(stats.get(key)) for stats in columns]))
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(headers[i]), *(len(cells[i]) for _, cells in rows)) for i in range(len(headers))]
    lines = [f"MQKS {address}, version {total.get('version', '-')}, up {duration(total.get('uptime_seconds'))}, "
             f"{total.get('workers', '-')} worker(s), at {time.strftime('%Y-%m-%d %H:%M:%S')}",
             " " * label_width + "  " + "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    for label, cells in rows:
        padded = "  ".join(value.rjust(width) for value, width in zip(cells, widths, strict=True))
        lines.append(label.ljust(label_width) + "  " + padded)
    if per_worker:
        lines.append("* counted for the whole process, not per worker")
    log = total.get("log")
    if isinstance(log, dict) and log:
        lines.append("")
        lines.append("write-ahead log:")
        key_width = max(len(str(key)) for key in log)
        lines.extend(f"  {str(key).ljust(key_width)}  {cell(value)}" for key, value in sorted(log.items()))
    lines.append("")
    queues = top_queues(total)
    lines.append(f"top {TOP_QUEUES} queues by depth:" if queues else "top queues by depth: (no queues)")
    if queues:
        depth_width = max(len("depth"), *(len(cell(depth)) for _, depth in queues))
        lines.append("  " + "depth".rjust(depth_width) + "  queue")
        lines.extend(f"  {cell(depth).rjust(depth_width)}  {queue}" for queue, depth in queues)
    leased = top_queues(total, "top_leased_queues")
    if leased:  # out of their queues under fetch --lease: a queue of 10,000 leased messages looks empty
        lines.append("")
        lines.append("queues with messages under lease:")
        leased_width = max(len("leased"), *(len(cell(count)) for _, count in leased))
        lines.append("  " + "leased".rjust(leased_width) + "  queue")
        lines.extend(f"  {cell(count).rjust(leased_width)}  {queue}" for queue, count in leased)
    return "\n".join(lines)


def top_queues(stats: dict[str, Any], key: str = "top_queues") -> list[tuple[str, int]]:
    """The `top_queues` (or another such key) of a stats answer as (name, count), largest first; malformed
    rows are skipped."""
    rows = []
    for row in stats.get(key) or ():
        if isinstance(row, (list, tuple)) and len(row) == 2 and isinstance(row[1], int):
            rows.append((str(row[0]), row[1]))
    return rows


def cell(value: Any) -> str:
    """A figure as a table shows it: thousands separated, "-" when missing."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.3f}".rstrip("0").rstrip(".")
    return str(value)


def duration(seconds: Any) -> str:
    """An uptime as `3d 4h`, `2h 05m`, `7m 03s` or `12s`; "-" when missing."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        return "-"
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The stats options, shared by `python stats.py` and `mqks stats`."""
    parser.add_argument("--watch", type=float, metavar="SECONDS", default=None,
                        help="print again every SECONDS until Ctrl-C")
    parser.add_argument("--json", action="store_true",
                        help="print the broker's figures as one JSON object per print (on failure: {\"error\": ...})")
    parser.add_argument("--worker", type=int, default=None, metavar="N",
                        help="only worker N's figures (0 to --workers - 1)")


def add_connection_arguments(parser: argparse.ArgumentParser, defaults: bool = True) -> None:
    """--host, --port and --timeout, shared by every command.

    `defaults=False` leaves an option unset when it is not given, so that a subcommand's copy
    does not overwrite the value given before the subcommand (`mqks --port 1 ping`).
    """
    def default(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument("--host", default=default("127.0.0.1"), help="broker host (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=default(25000), help="broker port (default 25000)")
    parser.add_argument("--seeds", default=default(None), metavar="HOST:PORT,...",
                        help="more brokers to try when --host:--port cannot be reached (a cluster's other nodes)")
    parser.add_argument("--timeout", type=float, default=default(10.0), metavar="SECONDS",
                        help="connect and answer timeout (default 10)")
    parser.add_argument("--tls", action="store_true", default=default(False),
                        help="speak TLS (to the broker's --tls-port), checking its certificate")
    parser.add_argument("--tls-ca", default=default(None), metavar="FILE",
                        help="check the broker's certificate against this CA (PEM) instead of the system's; "
                             "implies --tls")
    parser.add_argument("--tls-cert", default=default(None), metavar="FILE",
                        help="this client's certificate (PEM), for a broker started with --tls-ca; implies --tls")
    parser.add_argument("--tls-key", default=default(None), metavar="FILE", help="its private key (PEM)")
    parser.add_argument("--token", default=default(None),
                        help="auth token (default: the environment's MQKS_AUTH_TOKEN, which `ps` does not show)")


def connection_settings(args: argparse.Namespace) -> dict[str, Any]:
    """`Client` keywords from --tls, --tls-ca, --tls-cert, --tls-key and --token; ValueError for a file that fails."""
    tls: ssl.SSLContext | bool = False
    if args.tls or args.tls_ca or args.tls_cert:
        try:
            tls = client_context(args.tls_ca, args.tls_cert, args.tls_key)
        except OSError as e:  # a missing file, or one that is not PEM (ssl.SSLError)
            raise ValueError(f"cannot load the TLS CA, certificate or key: {e}") from None
    token_setting(args.token)  # a token with whitespace: ValueError now, not from inside Client
    return {"tls": tls, "token": args.token, "fallbacks": seeds_setting(getattr(args, "seeds", None))}


def seeds_setting(text: str | None) -> list[tuple[str, int]]:
    """`--seeds host:port,host:port` as the client's fallbacks; ValueError for an item that is not host:port."""
    return parse_seeds(text, "--seeds")


def run(args: argparse.Namespace, program: str = "stats.py") -> int:
    """Print the stats once, or every --watch seconds; returns the exit code (0, 1 broker, 2 usage). An error line
    on stderr starts with `program`, as the user typed it (`stats.py`, `mqks stats`)."""
    address = f"{args.host}:{args.port}"

    def fail(reason: str, code: int) -> int:
        if args.json:
            print_json_error(reason)
        else:
            print(f"{program}: {reason}", file=sys.stderr)
        return code

    if args.watch is not None and args.watch <= 0:
        return fail("--watch needs a number of seconds > 0", 2)
    if args.worker is not None and args.worker < 0:
        return fail("--worker needs a worker number >= 0", 2)
    try:
        settings = connection_settings(args)
    except ValueError as e:
        return fail(str(e), 2)
    client = Client(args.host, args.port, timeout_seconds=args.timeout, connect_timeout_seconds=args.timeout,
                    reconnect_max_seconds=1.0, **settings)
    # Ctrl-C as an event, not a KeyboardInterrupt: that one is raised in whichever greenlet runs (the
    # client's reader, say), which dies with a traceback while the loop goes on; and it ends the
    # wait at once, even for a broker that stopped answering
    interrupted = Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        gevent.signal_handler(signum, interrupted.set)
    printing = gevent.spawn(print_stats, client, args, address, fail)
    gevent.wait([printing, interrupted], count=1)
    if interrupted.is_set():
        printing.kill(block=False)
        client.close(flush=False)
        return 0 if args.watch is not None else EXIT_INTERRUPTED
    return printing.get()


def print_stats(client: Client, args: argparse.Namespace, address: str, fail: Callable[[str, int], int]) -> int:
    """Connect and print the stats, once or every --watch seconds; the exit code (0 once the reader of stdout went).

    It runs in a greenlet of its own: a BrokenPipeError let out of here would be printed by gevent's hub as a
    traceback before any caller could catch it.
    """
    try:
        client.connect(retry=False)
        clear_screen = args.watch is not None and not args.json and sys.stdout.isatty()
        while True:
            per_worker: list[dict[str, Any]] = []
            if args.worker is not None:
                total = client.stats(worker=args.worker)
            else:
                total, per_worker = read_stats(client, per_worker=not args.json)
            if args.json:
                text = json.dumps(total, sort_keys=True)
            else:
                text = render_table(total, per_worker, address,
                                    "total" if args.worker is None else f"worker {args.worker}")
                if clear_screen:
                    text = "\x1b[H\x1b[2J" + text  # home and clear: each print replaces the last one
                elif args.watch is not None:
                    text += "\n"
            print(text, flush=True)
            if args.watch is None:
                return 0
            gevent.sleep(args.watch)
    except MqksError as e:
        reason = said_by_a_command(e)
        return fail(reason if reason.startswith(("cannot connect", address)) else f"{address}: {reason}", 1)
    except BrokenPipeError:
        stdout_closed()  # `| head -1`: as `mqks consume` does, nothing left to say and nothing wrong
        return 0
    finally:
        client.close()


def stdout_closed() -> None:
    """The reader of stdout is gone: send what is still buffered for it to /dev/null, so exit stays quiet."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """`python stats.py [--host H --port P] [--watch SECONDS] [--json] [--worker N]`."""
    argv = sys.argv[1:] if argv is None else argv
    parser = Parser(prog="stats.py", description="Print an MQKS broker's figures, per worker and in total.",
                    json_errors="--json" in argv)
    add_connection_arguments(parser)
    add_arguments(parser)
    args = parser.parse_args(argv)
    # a program's own output, as `mqks`'s: the client's loggers are silent until someone configures logging
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    return run(args)

"""The broker's figures for people: read every worker's `state.stats()` through `_eval`, print a table.

Used by the root `stats.py` and by `mqks stats`. `_eval` is off unless mqksd runs with `--eval`
(and answers loopback peers only); when the broker refuses it, the user is told how to enable it.
Invariant: a figure the broker does not report shows as "-", never as a made-up 0.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time
from typing import Any

import gevent

from .client import Client
from .errors import MqksConnectionError, MqksError

# (key in state.stats(), label) in the order a message lives: published, queued, consumed, acked
FIGURES: tuple[tuple[str, str], ...] = (
    ("published", "messages published"),
    ("queued", "messages queued"),
    ("consumed", "messages consumed"),
    ("acked", "messages acked"),
    ("rejected", "messages rejected"),
    ("queues", "queues"),
    ("consumers", "consumers"),
    ("messages_waiting", "messages waiting in queues"),
    ("messages_unacked", "messages waiting for ack"),
    ("clients", "clients"),
    ("events", "events subscribed"),
)
# counted once per process and repeated in each worker's dict: the total is one of them, not their sum
PROCESS_WIDE_FIGURES = frozenset({"published", "clients"})
TOP_QUEUES = 10
EVAL_HINT = ("Start mqksd with --eval to enable it; it then answers loopback peers only, so run this\n"
             "on the broker's machine:\n"
             "    mqksd --host {host} --port {port} --eval")


class StatsUnavailable(Exception):
    """The broker answered, but not with the stats: usually `_eval` is off."""


def read_worker_stats(client: Client, worker: int) -> dict[str, Any]:
    """One worker's `state.stats()` dict; StatsUnavailable when `_eval` is refused or odd."""
    try:
        answer = client.eval("state.stats()", worker=worker)
    except (MqksConnectionError, TimeoutError):
        raise
    except MqksError as e:
        raise StatsUnavailable(f"the broker refused _eval ({e})") from e
    try:
        stats = ast.literal_eval(answer)  # a repr of plain data: never eval() what a server sends
    except (ValueError, SyntaxError) as e:
        raise StatsUnavailable(f"unexpected _eval answer {answer[:200]!r}") from e
    if not isinstance(stats, dict):
        raise StatsUnavailable(f"unexpected _eval answer {answer[:200]!r}")
    return stats


def read_stats(client: Client) -> list[dict[str, Any]]:
    """Every worker's stats, worker 0 first; worker 0 says how many workers there are."""
    first = read_worker_stats(client, 0)
    workers = int(first.get("workers", 1) or 1)
    return [first] + [read_worker_stats(client, worker) for worker in range(1, workers)]


def total_stats(per_worker: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals across workers: sums, except the process-wide figures; top queues merged."""
    total: dict[str, Any] = {}
    for key, _ in FIGURES:
        values = [stats[key] for stats in per_worker if isinstance(stats.get(key), (int, float))]
        if not values:
            continue
        total[key] = values[0] if key in PROCESS_WIDE_FIGURES else sum(values)
    total["top_queues"] = top_queues(per_worker)
    return total


def top_queues(per_worker: list[dict[str, Any]], limit: int = TOP_QUEUES) -> list[tuple[str, int]]:
    """The deepest queues over all workers, deepest first (ties by name)."""
    merged = [(str(queue), int(depth)) for stats in per_worker for queue, depth in stats.get("top_queues") or ()]
    merged.sort(key=lambda item: (-item[1], item[0]))
    return merged[:limit]


def render_table(per_worker: list[dict[str, Any]], address: str) -> str:
    """A plain-text table: one row per figure, one column per worker, then the total; then top queues."""
    total = total_stats(per_worker)
    headers = [f"worker {stats.get('worker', n)}" for n, stats in enumerate(per_worker)] + ["total"]
    rows = []
    for key, label in FIGURES:
        cells = [_cell(stats.get(key)) for stats in per_worker] + [_cell(total.get(key))]
        rows.append((label + (" *" if key in PROCESS_WIDE_FIGURES else ""), cells))
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(headers[i]), *(len(cells[i]) for _, cells in rows)) for i in range(len(headers))]
    lines = [f"MQKS {address} at {time.strftime('%Y-%m-%d %H:%M:%S')}",
             " " * label_width + "  " + "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    for label, cells in rows:
        padded = "  ".join(cell.rjust(width) for cell, width in zip(cells, widths, strict=True))
        lines.append(label.ljust(label_width) + "  " + padded)
    lines.append("* counted per process: the total is not a sum")
    lines.append("")
    queues = total["top_queues"]
    lines.append(f"top {TOP_QUEUES} queues by depth:" if queues else "top queues by depth: (no queues)")
    if queues:
        depth_width = max(len("depth"), *(len(str(depth)) for _, depth in queues))
        lines.append("  " + "depth".rjust(depth_width) + "  queue")
        lines.extend(f"  {str(depth).rjust(depth_width)}  {queue}" for queue, depth in queues)
    return "\n".join(lines)


def render_json(per_worker: list[dict[str, Any]], address: str) -> str:
    """The same figures as one JSON object: workers, total, top_queues."""
    total = total_stats(per_worker)
    top = total.pop("top_queues")
    return json.dumps({"address": address, "workers": per_worker, "total": total,
                       "top_queues": [{"queue": queue, "depth": depth} for queue, depth in top]},
                      default=str, sort_keys=True)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The stats options, shared by `python stats.py` and `mqks stats`."""
    parser.add_argument("--watch", type=float, metavar="SECONDS", default=None,
                        help="print again every SECONDS until Ctrl-C")
    parser.add_argument("--json", action="store_true", help="one JSON object per print instead of a table")


def add_connection_arguments(parser: argparse.ArgumentParser, defaults: bool = True) -> None:
    """--host, --port and --timeout, shared by every command.

    `defaults=False` leaves an option unset when it is not given, so that a subcommand's copy
    does not overwrite the value given before the subcommand (`mqks --port 1 ping`).
    """
    def default(value):
        return value if defaults else argparse.SUPPRESS

    parser.add_argument("--host", default=default("127.0.0.1"), help="broker host (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=default(25000), help="broker port (default 25000)")
    parser.add_argument("--timeout", type=float, default=default(10.0), metavar="SECONDS",
                        help="connect and answer timeout (default 10)")


def run(args: argparse.Namespace) -> int:
    """Print the stats once, or every --watch seconds; returns the exit code."""
    if args.watch is not None and args.watch <= 0:
        print("stats: --watch needs a number of seconds > 0", file=sys.stderr)
        return 2
    address = f"{args.host}:{args.port}"
    client = Client(args.host, args.port, timeout_seconds=args.timeout, connect_timeout_seconds=args.timeout,
                    reconnect_max_seconds=1.0)
    try:
        client.connect()
    except MqksError as e:
        print(f"stats: {e}", file=sys.stderr)
        return 1
    clear_screen = args.watch is not None and not args.json and sys.stdout.isatty()
    try:
        while True:
            per_worker = read_stats(client)
            text = render_json(per_worker, address) if args.json else render_table(per_worker, address)
            if clear_screen:
                text = "\x1b[H\x1b[2J" + text
            elif args.watch is not None and not args.json:
                text += "\n"
            print(text, flush=True)
            if args.watch is None:
                return 0
            gevent.sleep(args.watch)
    except StatsUnavailable as e:
        print(f"stats: {e}.\n" + EVAL_HINT.format(host=args.host, port=args.port), file=sys.stderr)
        return 3
    except MqksError as e:
        print(f"stats: {address}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    """`python stats.py [--host H --port P] [--watch SECONDS] [--json]`."""
    parser = argparse.ArgumentParser(
        prog="stats.py", description="Print an MQKS broker's figures per worker and in total (needs mqksd --eval).")
    add_connection_arguments(parser)
    add_arguments(parser)
    return run(parser.parse_args(argv))

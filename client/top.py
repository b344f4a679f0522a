"""`mqks top`: a live view of a broker, redrawn in place every interval with rich.

Each tick reads `stats` and `queues` (one request each), keeps the previous sample, and shows
totals with rates (published/s, delivered/s = consumed, acked/s, rejected/s, bytes in and out
per second) and the queues that fit the terminal, with depth and depth change per second, sorted by
depth (`d`), name (`n`) or rate (`r`). `q`, Ctrl-C or SIGTERM quit; the terminal is restored.
Invariants: rich is imported only here (the `top` extra), the keys are read only from a tty
stdin, and a failed read keeps the last figures on screen with the error in the header.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import gevent
import gevent.socket
from gevent.event import Event
from rich.console import Console, Group, JustifyMethod, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .client import Client
from .errors import MqksError
from .stats import cell, duration

# (stats key, label): the totals that get a rate
RATED: tuple[tuple[str, str], ...] = (
    ("published", "published"),
    ("consumed", "delivered"),
    ("acked", "acked"),
    ("rejected", "rejected"),
    ("bytes_in", "bytes in"),
    ("bytes_out", "bytes out"),
)
# (stats key, label): the sizes shown as they are now
GAUGES: tuple[tuple[str, str], ...] = (
    ("queues", "queues"),
    ("consumers", "consumers"),
    ("messages_waiting", "waiting"),
    ("messages_unacked", "unacked"),
    ("connections", "connections"),
    ("errors", "errors"),
)
SORTS = {"d": "depth", "n": "name", "r": "rate"}
HEADER_LINES = 12  # what the header and the totals take, so the queue table gets the rest of the screen


@dataclass(slots=True)
class Sample:
    """One tick: when it was read, the broker's stats and its queues by name."""

    at: float
    stats: dict[str, Any]
    queues: dict[str, dict[str, Any]]


@dataclass(slots=True)
class View:
    """What the screen shows: the last two samples, the sort, and the last error (if any)."""

    address: str
    sort: str = "depth"
    previous: Sample | None = None
    current: Sample | None = None
    error: str = ""
    rates: dict[str, float] = field(default_factory=dict)
    depth_rates: dict[str, float] = field(default_factory=dict)

    def add(self, sample: Sample) -> None:
        """Take a new sample; rates are per second over the time since the previous one."""
        self.previous, self.current = self.current, sample
        self.error = ""
        self.rates, self.depth_rates = rates(self.previous, sample)


def rates(previous: Sample | None, current: Sample) -> tuple[dict[str, float], dict[str, float]]:
    """(total rates by stats key, depth change per second by queue); empty before a second sample.

    A queue that appeared since the previous sample started from depth 0.
    """
    if previous is None or current.at <= previous.at:
        return {}, {}
    seconds = current.at - previous.at
    totals: dict[str, float] = {}
    for key, _ in RATED:
        now, before = current.stats.get(key), previous.stats.get(key)
        if isinstance(now, (int, float)) and isinstance(before, (int, float)):
            totals[key] = max(0.0, (now - before) / seconds)  # counters only grow (a restart resets them)
    depths: dict[str, float] = {}
    for name, row in current.queues.items():
        old = previous.queues.get(name, {}).get("depth", 0)
        if isinstance(row.get("depth"), int) and isinstance(old, int):
            depths[name] = (row["depth"] - old) / seconds
    return totals, depths


def read_sample(client: Client, mask: str | None, timeout: float) -> Sample:
    """Read stats and queues once, each within `timeout`."""
    stats = client.stats(timeout=timeout)
    queues = {str(row.get("queue")): row for row in client.queues(mask, timeout=timeout)}
    return Sample(time.monotonic(), stats, queues)


def sorted_queues(view: View) -> list[dict[str, Any]]:
    """The current queues in the view's order: deepest, by name, or fastest-changing first."""
    if view.current is None:
        return []
    rows = list(view.current.queues.values())
    name: Callable[[dict[str, Any]], str] = lambda row: str(row.get("queue"))
    depth: Callable[[dict[str, Any]], int] = lambda row: row["depth"] if isinstance(row.get("depth"), int) else 0
    if view.sort == "name":
        rows.sort(key=name)
    elif view.sort == "rate":
        rows.sort(key=lambda row: (-abs(view.depth_rates.get(name(row), 0.0)), -depth(row), name(row)))
    else:
        rows.sort(key=lambda row: (-depth(row), name(row)))
    return rows


def human_bytes(value: Any) -> str:
    """1536 -> `1.5 KiB`; "-" when missing."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    amount = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(amount) < 1024 or unit == "TiB":
            return f"{amount:,.0f} {unit}" if unit == "B" else f"{amount:,.1f} {unit}"
        amount /= 1024
    return "-"


def rate_text(value: float | None, as_bytes: bool = False) -> str:
    """A rate as `12.5/s` (or `1.2 KiB/s`); "-" before there are two samples."""
    if value is None:
        return "-"
    return f"{human_bytes(value)}/s" if as_bytes else f"{value:,.1f}/s"


def render(view: View, height: int) -> RenderableType:
    """The whole screen for `view`, fitting `height` lines."""
    stats = view.current.stats if view.current is not None else {}
    header = Text()
    header.append(f"MQKS {view.address}", style="bold")
    header.append(f"  version {stats.get('version', '-')}  up {duration(stats.get('uptime_seconds'))}"
                  f"  workers {cell(stats.get('workers'))}\n")
    header.append(f"sort: {view.sort}", style="bold")
    header.append("   keys: d depth  n name  r rate  q quit")
    log_figures = log_line(stats.get("log"))
    if log_figures:
        header.append(f"\n{log_figures}")
    if view.error:
        header.append(f"\n{view.error}", style="bold red")

    totals = Table(box=None, pad_edge=False, show_edge=False, expand=False)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("", "left"), ("total", "right"), ("per second", "right"), ("", "left"), ("now", "right"))
    for title, justify in columns:
        totals.add_column(title, justify=justify)
    for (key, label), (gauge_key, gauge_label) in zip(RATED, GAUGES, strict=True):
        as_bytes = key.startswith("bytes")
        total = human_bytes(stats.get(key)) if as_bytes else cell(stats.get(key))
        totals.add_row(label, total, rate_text(view.rates.get(key), as_bytes), gauge_label,
                       cell(stats.get(gauge_key)))

    rows = sorted_queues(view)
    room = max(1, height - HEADER_LINES - (1 if view.error else 0) - (1 if log_figures else 0))
    shown = rows[:room]
    queues = Table(box=None, pad_edge=False, show_edge=False, title_justify="left",
                   title=f"queues: {len(shown)} of {len(rows)}, by {view.sort}")
    queues.add_column("queue", justify="left", no_wrap=True)
    for title in ("depth", "depth/s", "unacked", "leased", "consumers"):
        queues.add_column(title, justify="right")
    for row in shown:
        queue = str(row.get("queue"))
        depth_rate = view.depth_rates.get(queue)
        queues.add_row(queue, cell(row.get("depth")), "-" if depth_rate is None else f"{depth_rate:+,.1f}",
                       cell(row.get("unacked")), cell(row.get("leased")), cell(row.get("consumers")))
    return Group(header, Text(""), totals, Text(""), queues)


def log_line(figures: Any) -> str | None:
    """One line about the write-ahead log: the replicated log's stream, leader, epoch and PubAck latency, or the
    local log's size and fsync latency; None without a log."""
    if not isinstance(figures, dict) or not figures:
        return None
    trouble = "  BLOCKED: confirmed publishes are refused" if figures.get("blocked") else ""
    if "stream" in figures:
        return (f"log: stream {figures.get('stream')}  leader {figures.get('stream_leader') or '-'}  epoch "
                f"{cell(figures.get('epoch'))}  seq {cell(figures.get('last_seq'))}  in flight "
                f"{cell(figures.get('frames_in_flight'))} frames {human_bytes(figures.get('bytes_in_flight'))}  "
                f"PubAck p50/p99 {figures.get('puback_ms_p50', 0):.1f}/{figures.get('puback_ms_p99', 0):.1f} ms"
                f"{trouble}")
    return (f"log: {human_bytes(figures.get('log_bytes'))} in {cell(figures.get('segments'))} segments  fsync "
            f"p50/p99 {figures.get('fsync_ms_p50', 0):.2f}/{figures.get('fsync_ms_p99', 0):.2f} ms{trouble}")


@contextmanager
def keys(on_key: Callable[[str], None]) -> Iterator[None]:
    """Call `on_key(char)` for each key pressed, while inside; a no-op unless stdin is a terminal.

    cbreak mode: keys arrive without Enter and are not echoed; Ctrl-C still sends SIGINT.
    """
    if not sys.stdin.isatty():
        yield
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)

    def read_keys() -> None:
        while True:
            gevent.socket.wait_read(fd)
            try:
                chunk = os.read(fd, 64)
            except OSError:
                return
            if not chunk:
                return
            for char in chunk.decode("utf-8", errors="replace"):
                on_key(char)

    tty.setcbreak(fd, termios.TCSANOW)
    reader = gevent.spawn(read_keys)
    try:
        yield
    finally:
        reader.kill()
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run(client: Client, args: argparse.Namespace) -> int:
    """Show the live view until `q`, Ctrl-C or SIGTERM; returns the exit code."""
    if not sys.stdout.isatty():
        print("mqks top: needs a terminal; `mqks stats --watch SECONDS` (or --json) prints figures to a file",
              file=sys.stderr)
        return 2
    if args.interval <= 0:
        print("mqks top: --interval needs a number of seconds > 0", file=sys.stderr)
        return 2
    view = View(f"{args.host}:{args.port}", sort=SORTS.get(args.sort[:1], "depth"))
    stop, redraw = Event(), Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        gevent.signal_handler(signum, stop.set)

    def on_key(char: str) -> None:
        if char.lower() == "q":
            stop.set()
        elif char.lower() in SORTS:
            view.sort = SORTS[char.lower()]
            redraw.set()

    console = Console()
    with keys(on_key), Live(render(view, console.height), console=console, auto_refresh=False, screen=True) as live:
        next_tick = time.monotonic()
        # a broker that is gone must not freeze the screen for the whole --timeout
        read_timeout = min(args.timeout, max(1.0, args.interval))
        while not stop.is_set():
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + args.interval
                try:
                    view.add(read_sample(client, args.mask, read_timeout))
                except MqksError as e:
                    view.error = f"cannot read the broker: {e}"
            live.update(render(view, console.height), refresh=True)
            redraw.clear()
            gevent.wait([stop, redraw], timeout=max(0.0, next_tick - time.monotonic()), count=1)
    return 0


"""The `mqks` command: publish, consume, ping, stats, queues, top, eval, and the extensions request,
schedule, unschedule, schedules, purge and requeue-dead, from a terminal, through `Client`.

Exit codes (the README lists them too):
  0    done; also a consume, top or stats --watch stopped by Ctrl-C, SIGTERM or `q`, and any command
       whose stdout was closed by its reader (`mqks consume ... | head -1`)
  1    the broker answered an error, could not be reached, or does not speak MQKS
  2    bad usage: options, arguments, or data the protocol cannot carry
  3    a feature is off: `_eval` on the broker (`mqks eval`), or rich for `mqks top`
  4    `mqks request` got no reply in time
  130  a one-shot command interrupted by Ctrl-C
A consume prints one line per message, as the wire shows it: `{msg_id} event={event}[,retry={n}] {data}`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import select
import signal
import stat
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import gevent
import gevent.socket
from gevent.event import Event

from . import stats
from .client import Client, Message
from .errors import MqksConnectionError, MqksError, MqksTimeoutError

EXIT_OK = 0
EXIT_BROKER = 1
EXIT_USAGE = 2
EXIT_FEATURE_OFF = 3
EXIT_NO_REPLY = 4
EXIT_INTERRUPTED = stats.EXIT_INTERRUPTED
COMMANDS = frozenset({"publish", "consume", "ping", "stats", "queues", "top", "eval", "request", "schedule",
                      "unschedule", "schedules", "rebind", "delete-queue", "purge", "requeue-dead", "nats", "cluster"})
NATS_DIR = "nats-local"  # `mqks nats`'s files, under the current directory (.gitignore has it)
JSON_COMMANDS = frozenset({"stats", "queues", "schedules"})  # with --json, stdout holds JSON only, errors included
TOP_HINT = 'mqks top needs rich, which the broker does not: .venv/bin/pip install -e ".[top]" in the clone'


class FeatureOff(Exception):
    """What the command needs is not enabled (exit 3); the message says how to enable it."""


def version() -> str:
    """The installed mqks distribution's version, from its package metadata."""
    try:
        return importlib.metadata.version("mqks")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def cmd_publish(client: Client, args: argparse.Namespace) -> int:
    value = command_data(args)
    msg_id = client.publish(args.event, value, confirm=args.confirm, json=args.json, mandatory=args.mandatory)
    if args.confirm:
        print(msg_id, flush=True)
    return EXIT_OK


def command_data(args: argparse.Namespace) -> Any:
    """DATA joined by spaces: checked to fit one protocol line, or parsed as JSON text with --json."""
    data = " ".join(args.data)
    if args.json:
        try:
            return json.loads(data)
        except ValueError as e:
            raise ValueError(f"--json: DATA is not JSON text ({e})") from None
    for char in ("\n", "\r", "\t"):
        if char in data:
            raise ValueError(f"DATA holds {char!r}, which one protocol line cannot carry; "
                             "give JSON text with --json, and it is sent re-encoded on one line")
    return data


def cmd_request(client: Client, args: argparse.Namespace) -> int:
    """Print the first reply as it came, or exit 4 when none comes within --timeout."""
    data = command_data(args)
    if args.json:
        data = json.dumps(data)  # escapes newlines and tabs: one line
    try:
        reply = client.request(args.event, data, timeout=args.timeout)
    except MqksTimeoutError as e:
        print(f"mqks request: {e.reason}", file=sys.stderr)
        return EXIT_NO_REPLY
    print(reply, flush=True)
    return EXIT_OK


def cmd_schedule(client: Client, args: argparse.Namespace) -> int:
    client.schedule(args.name, args.event, command_data(args), every=args.every, cron=args.cron, count=args.count,
                    nohaste=args.nohaste, json=args.json)
    return EXIT_OK


def cmd_unschedule(client: Client, args: argparse.Namespace) -> int:
    client.unschedule(args.name)
    return EXIT_OK


def cmd_schedules(client: Client, args: argparse.Namespace) -> int:
    rows = client.schedules()
    print(json.dumps(rows) if args.json else render_schedules(rows), flush=True)
    return EXIT_OK


def render_schedules(rows: list[dict]) -> str:
    """The `schedules` answer as a table: name, rule, next due (UTC), fired, count, event, data."""
    headers = ("name", "rule", "next due (UTC)", "fired", "count", "event", "data")
    table = [headers]
    for row in rows:
        next_due = row.get("next_due")
        due = (datetime.fromtimestamp(next_due, UTC).strftime("%Y-%m-%d %H:%M:%S")
               if isinstance(next_due, (int, float)) else stats.cell(next_due))
        count = row.get("count")
        table.append((str(row.get("name", "-")), str(row.get("rule", "-")), due, stats.cell(row.get("fired")),
                      "-" if count is None else stats.cell(count), str(row.get("event", "-")),
                      str(row.get("data", ""))))
    return render_table(table, right_aligned=(3, 4), empty="(no schedules)")


def render_table(table: Sequence[tuple[str, ...]], right_aligned: tuple[int, ...], empty: str) -> str:
    """Rows (the headers first) in columns two spaces apart; the last column is left ragged; `empty` under no rows."""
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]) - 1)]
    lines = []
    for line in table:
        cells = [value.rjust(width) if i in right_aligned else value.ljust(width)
                 for i, (value, width) in enumerate(zip(line[:-1], widths, strict=True))]
        cells.append(line[-1])
        lines.append("  ".join(cells).rstrip())
    if len(table) == 1:
        lines.append(empty)
    return "\n".join(lines)


def cmd_consume(client: Client, args: argparse.Namespace) -> int:
    """Print each message until Ctrl-C, SIGTERM, or the reader of stdout goes away.

    With --manual-ack a message is acked only once printed; one that could not be printed comes
    back to the queue. Without it the broker acked at delivery: a message delivered after the
    reader went away is lost, so the consumer stops as soon as stdout is closed.
    """
    stop = Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        gevent.signal_handler(signum, stop.set)

    def on_msg(message: Message) -> None:
        if stop.is_set():
            return  # not printed, so not acked: with --manual-ack it goes back to the queue
        retry = f",retry={message.retry}" if message.retry else ""
        try:
            # print before ack: a message that was never shown must come back
            print(f"{message.id} event={message.event}{retry} {message.data}", flush=True)
        except BrokenPipeError:
            stats.stdout_closed()
            stop.set()
            return
        message.ack()

    def on_reconnect(old_id: str, new_id: str) -> None:
        print(f"mqks: reconnected, consumer {old_id} is now {new_id}", file=sys.stderr, flush=True)

    watcher = gevent.spawn(wait_stdout_closed, stop) if stdout_is_pipe() else None
    try:
        consumer_id = client.consume(args.queue, args.events, on_msg, manual_ack=args.manual_ack, add=args.add,
                                     delete_queue_when_unused=args.delete_queue_when_unused, confirm=True,
                                     on_reconnect=on_reconnect)
        print(f"mqks: consuming queue {args.queue} as consumer {consumer_id}; Ctrl-C to stop",
              file=sys.stderr, flush=True)
        stop.wait()
        # stop deliveries at once: without --manual-ack each one is acked as the broker sends it
        client.delete_consumer(consumer_id, confirm=False)
    finally:
        if watcher is not None:
            watcher.kill()
    return EXIT_OK


def stdout_is_pipe() -> bool:
    """True when stdout is a pipe, whose reader may go away (`| head -1`)."""
    try:
        return stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode)
    except (OSError, ValueError):
        return False


def wait_stdout_closed(stop: Event) -> None:
    """Set `stop` once the reader of the stdout pipe has gone, without writing to it.

    A pipe's write end polls as readable (POLLERR) once its reader closed; a pipe still read
    never does. The poll(0) confirms it, so a spurious wakeup cannot end the consume.
    """
    fd = sys.stdout.fileno()
    poller = select.poll()
    poller.register(fd, 0)  # POLLERR and POLLHUP are always reported
    while not stop.is_set():
        gevent.socket.wait_read(fd)
        if any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0)):
            stats.stdout_closed()
            stop.set()
            return
        gevent.sleep(0.1)  # not closed: a wakeup for some other reason, and it may repeat


class NoSuchQueue(Exception):
    """`delete-queue` names a queue the broker does not have (exit 1; a typo should not read as "deleted")."""


def require_queue(client: Client, queue: str) -> None:
    if not any(row["queue"] == queue for row in client.queues(queue)):
        raise NoSuchQueue(f"no queue {queue!r} on the broker (mqks queues lists them)")


def cmd_rebind(client: Client, args: argparse.Namespace) -> int:
    if args.add:
        client.rebind(args.queue, add=args.events, confirm=True)
    else:
        client.rebind(args.queue, args.events, confirm=True)
    row = next(row for row in client.queues(args.queue) if row["queue"] == args.queue)
    print(f"{args.queue}: {row['bindings']} bindings", flush=True)
    return EXIT_OK


def cmd_delete_queue(client: Client, args: argparse.Namespace) -> int:
    require_queue(client, args.queue)
    client.delete_queue(args.queue, confirm=True)
    print(f"deleted {args.queue}", flush=True)
    return EXIT_OK


def cmd_purge(client: Client, args: argparse.Namespace) -> int:
    purged = client.purge_queue(args.queue)
    print(f"purged {purged} messages from {args.queue}{absent(client, args.queue, purged)}", flush=True)
    return EXIT_OK


def cmd_requeue_dead(client: Client, args: argparse.Namespace) -> int:
    moved = client.requeue_dead(args.queue, limit=args.limit, msg_ids=args.msg_ids or None)
    dead = f"{args.queue}.dead"
    print(f"moved {moved} dead letters from {dead} back to {args.queue}{absent(client, dead, moved)}", flush=True)
    return EXIT_OK


def absent(client: Client, queue: str, count: int) -> str:
    """` (there is no queue 'q')` after a count of 0 from a queue the broker does not have, else "".

    The broker's rule, and client.purge_queue's: purging a queue that is not there, or moving back the dead
    letters of a queue none died in yet, does nothing and answers 0. The note lets a typo show all the same.
    """
    if count or any(row["queue"] == queue for row in client.queues(queue)):
        return ""
    return f" (there is no queue {queue!r})"


def cmd_ping(client: Client, args: argparse.Namespace) -> int:
    print(client.ping(" ".join(args.data) if args.data else "pong"), flush=True)
    return EXIT_OK


def cmd_eval(client: Client, args: argparse.Namespace) -> int:
    try:
        answer = client.eval(args.code, worker=args.worker)
    except MqksError as e:
        if e.error_id and e.reason.startswith("_eval ") and ("disabled" in e.reason or "loopback" in e.reason):
            raise FeatureOff(e.reason) from e
        raise
    print(answer, flush=True)
    return EXIT_OK


def cmd_queues(client: Client, args: argparse.Namespace) -> int:
    rows = client.queues(args.mask, detail=args.detail)
    if args.json:
        print(json.dumps(rows), flush=True)
        return EXIT_OK
    print(render_queues(rows), flush=True)
    if args.detail:
        print(render_details(rows), flush=True)
    return EXIT_OK


def render_details(rows: list[dict]) -> str:
    """`queues --detail`'s extra keys, a few lines per queue: its bindings, consumers and newest messages."""
    lines = []
    for row in rows:
        consumers = [f"{c.get('consumer')} ({'manual ack' if c.get('manual_ack') else 'auto ack'}, prefetch "
                     f"{c.get('prefetch') or 'none'}, {c.get('unacked', 0)} unacked)"
                     for c in row.get("consumer_list", [])]
        newest = [f"{m.get('msg_id')} (retry {m.get('retry', 0)}) event={m.get('event')} {m.get('data', '')}"
                  for m in row.get("newest", [])]
        lines += ["", f"{row.get('queue')}:", f"  bindings: {' '.join(row.get('events', [])) or '(none)'}",
                  f"  consumers: {', '.join(consumers) or '(none)'}", "  newest:" + "".join(
                      f"\n    {line}" for line in newest) if newest else "  newest: (none)"]
    return "\n".join(lines)


def render_queues(rows: list[dict]) -> str:
    """The `queues` answer as a table: queue, depth, unacked, leased, consumers, bindings, flags."""
    headers = ("queue", "depth", "unacked", "leased", "consumers", "bindings", "flags")
    table = [headers]
    for row in rows:
        flags = row.get("flags")
        table.append((str(row.get("queue", "-")), stats.cell(row.get("depth")), stats.cell(row.get("unacked")),
                      stats.cell(row.get("leased")), stats.cell(row.get("consumers")), stats.cell(row.get("bindings")),
                      " ".join(map(str, flags)) if isinstance(flags, list) else stats.cell(flags)))
    return render_table(table, right_aligned=(1, 2, 3, 4, 5), empty="(no queues)")


def cmd_top(client: Client, args: argparse.Namespace) -> int:
    from . import top  # rich is the `top` extra: loaded only here

    # a warning line on stderr would scribble over the live view: the header shows read errors
    if not args.verbose:
        logging.getLogger("mqks.client").setLevel(logging.ERROR)
    return top.run(client, args)


def build_parser(json_errors: bool = False) -> stats.Parser:
    """The `mqks` parser; `json_errors` makes a usage error of `stats --json` or `queues --json` JSON too."""
    parser = stats.Parser(prog="mqks", description="Talk to an MQKS broker.", json_errors=json_errors)
    parser.add_argument("--version", action="version", version=f"mqks {version()}")
    stats.add_connection_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log the client's connection events")
    # the same options after the command name: `mqks --port 1 ping` and `mqks ping --port 1` both work
    common = stats.Parser(add_help=False)
    stats.add_connection_arguments(common, defaults=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log the client's connection events")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=stats.Parser)
    parser.commands_by_name = commands.choices

    publish = commands.add_parser("publish", parents=[common], help="publish one message")
    publish.add_argument("event", metavar="EVENT")
    publish.add_argument("data", nargs="*", default=[], metavar="DATA",
                         help="the message text: the rest of the line, joined by spaces (no newlines or tabs)")
    publish.add_argument("--json", action="store_true",
                         help="DATA is JSON text (it may span lines); it is sent re-encoded on one line")
    publish.add_argument("--confirm", action="store_true", help="wait for the broker's ok and print the msg id")
    publish.add_argument("--mandatory", action="store_true",
                         help="an error (exit 1) when no queue is bound to EVENT, instead of a message gone at once")
    publish.set_defaults(run=cmd_publish)

    consume = commands.add_parser("consume", parents=[common], help="print each message of a queue until Ctrl-C")
    consume.add_argument("queue", metavar="QUEUE")
    consume.add_argument("events", nargs="*", default=[], metavar="EVENT",
                         help="events or masks (user.*.created) that replace the queue's bindings")
    consume.add_argument("--add", action="store_true", help="add the events to the queue's bindings instead")
    consume.add_argument("--manual-ack", action="store_true",
                         help="ack each message once printed (a message not printed goes back to the queue)")
    consume.add_argument("--delete-queue-when-unused", nargs="?", type=float, const=True, default=None,
                         metavar="SECONDS", help="delete the queue once unused (for SECONDS)")
    consume.set_defaults(run=cmd_consume)

    ping = commands.add_parser("ping", parents=[common], help="check the broker answers")
    ping.add_argument("data", nargs="*", default=[], metavar="DATA",
                      help="what the broker echoes: the rest of the line (default pong)")
    ping.set_defaults(run=cmd_ping)

    stats_parser = commands.add_parser("stats", parents=[common], json_errors=json_errors,
                                       help="the broker's figures, per worker and in total")
    stats.add_arguments(stats_parser)
    stats_parser.set_defaults(run=None)  # stats.run connects on its own

    queues = commands.add_parser("queues", parents=[common], json_errors=json_errors,
                                 help="every queue: depth, unacked, consumers, bindings, flags")
    queues.add_argument("mask", nargs="?", default=None, metavar="MASK",
                        help="only queues whose name matches (a name, or a mask such as 'orders.*')")
    queues.add_argument("--json", action="store_true", help="one JSON array instead of a table")
    queues.add_argument("--detail", action="store_true",
                        help="also each queue's bindings, consumers and newest messages (the console's queue page)")
    queues.set_defaults(run=cmd_queues)

    top = commands.add_parser("top", parents=[common], help="a live view: rates, connections, busiest queues")
    top.add_argument("mask", nargs="?", default=None, metavar="MASK", help="only queues whose name matches")
    top.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="refresh period (default 1)")
    top.add_argument("--sort", choices=("depth", "name", "rate"), default="depth",
                     help="first order of the queues (keys d, n, r change it)")
    top.set_defaults(run=cmd_top)

    eval_parser = commands.add_parser("eval", parents=[common], help="evaluate a Python expression in the broker")
    eval_parser.add_argument("code", metavar="EXPRESSION")
    eval_parser.add_argument("--worker", type=int, default=None, metavar="N",
                             help="evaluate it in worker N of mqksd --workers (default: the one this connection "
                                  "reached)")
    eval_parser.set_defaults(run=cmd_eval)

    request = commands.add_parser(
        "request", parents=[common], help="(ext) publish a request and print the first reply",
        description="Publish EVENT DATA as a request and print the first worker's reply. --timeout is how "
                    "long to wait for it (default 10 s); no reply by then exits 4.")
    request.add_argument("event", metavar="EVENT")
    request.add_argument("data", nargs="*", default=[], metavar="DATA",
                         help="the request text: the rest of the line, joined by spaces (no newlines or tabs)")
    request.add_argument("--json", action="store_true",
                         help="DATA is JSON text (it may span lines); it is sent re-encoded on one line")
    request.set_defaults(run=cmd_request)

    schedule = commands.add_parser(
        "schedule", parents=[common], help="(ext) publish EVENT DATA on a schedule, under NAME",
        description="Publish EVENT DATA every SECONDS or on a cron rule; firing n has msg id NAME.n. A schedule "
                    "of the same NAME is replaced. It fires at once unless --nohaste.")
    schedule.add_argument("name", metavar="NAME")
    schedule.add_argument("event", metavar="EVENT")
    schedule.add_argument("data", nargs="*", default=[], metavar="DATA",
                          help="the message text: the rest of the line, joined by spaces (no newlines or tabs)")
    rule = schedule.add_mutually_exclusive_group(required=True)
    rule.add_argument("--every", type=float, metavar="SECONDS", help="fire every SECONDS (> 0)")
    rule.add_argument("--cron", metavar="'M H DOM MON DOW'",
                      help="fire on a cron rule: five fields in one quoted argument, e.g. '*/5 * * * *'")
    schedule.add_argument("--count", type=int, default=None, metavar="N", help="stop after N firings")
    schedule.add_argument("--nohaste", action="store_true", help="wait one interval before the first firing")
    schedule.add_argument("--json", action="store_true",
                          help="DATA is JSON text (it may span lines); it is sent re-encoded on one line")
    schedule.set_defaults(run=cmd_schedule)

    unschedule = commands.add_parser("unschedule", parents=[common], help="(ext) remove the schedule NAME")
    unschedule.add_argument("name", metavar="NAME")
    unschedule.set_defaults(run=cmd_unschedule)

    schedules = commands.add_parser("schedules", parents=[common], json_errors=json_errors,
                                    help="(ext) every schedule: rule, next due time, firings so far")
    schedules.add_argument("--json", action="store_true", help="one JSON array instead of a table")
    schedules.set_defaults(run=cmd_schedules)

    rebind = commands.add_parser("rebind", parents=[common],
                                 help="create QUEUE if missing, and set its bindings to EVENTs (or --add them)")
    rebind.add_argument("queue", metavar="QUEUE")
    rebind.add_argument("events", nargs="*", default=[], metavar="EVENT", help="events or masks (user.*.created)")
    rebind.add_argument("--add", action="store_true", help="add the events to the queue's bindings instead")
    rebind.set_defaults(run=cmd_rebind)

    delete_queue = commands.add_parser("delete-queue", parents=[common],
                                       help="delete QUEUE: its messages, bindings and consumers (told with --update)")
    delete_queue.add_argument("queue", metavar="QUEUE")
    delete_queue.set_defaults(run=cmd_delete_queue)

    purge = commands.add_parser("purge", parents=[common],
                                help="(ext) drop every message waiting in QUEUE (not those consumers hold)")
    purge.add_argument("queue", metavar="QUEUE")
    purge.set_defaults(run=cmd_purge)

    requeue_dead = commands.add_parser("requeue-dead", parents=[common],
                                       help="(ext) move the dead letters in QUEUE.dead back to QUEUE, retries at 0")
    requeue_dead.add_argument("queue", metavar="QUEUE")
    requeue_dead.add_argument("msg_ids", nargs="*", default=[], metavar="MSG_ID", help="only these (default: all)")
    requeue_dead.add_argument("--limit", type=int, default=None, metavar="N", help="only the oldest N")
    requeue_dead.set_defaults(run=cmd_requeue_dead)

    nats = commands.add_parser("nats", help="(cluster extra) a local NATS JetStream cluster for the replicated log")
    nats_actions = nats.add_subparsers(dest="nats_action", required=True, metavar="ACTION",
                                       parser_class=stats.Parser)
    nats_up = nats_actions.add_parser("up", help="start the nodes on loopback (again, after down: same data and "
                                                 "ports), print their URLs")
    nats_up.add_argument("--nodes", type=int, default=3, help="nats-server processes (default: %(default)s)")
    nats_up.add_argument("--base-port", type=int, default=None, metavar="PORT",
                         help="node i listens on PORT+i, its routes on PORT+100+i, its HTTP on PORT+200+i "
                              "(default: free ports below 32768)")
    nats_up.add_argument("--cluster", default="mqks", help="the cluster's name (default: %(default)s)")
    nats_down = nats_actions.add_parser("down", help="stop the nodes (their files stay: up starts them again)")
    nats_down.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",  # nats_local.STOP_SECONDS
                           help="SIGKILL a node still running this long after its SIGTERM (default: %(default)s)")
    for action in (nats_up, nats_down, nats_actions.add_parser("status", help="each node's URL, pid and health")):
        action.add_argument("--dir", default=NATS_DIR, help="where the configs, data and logs are (default: "
                                                            "%(default)s)")
    nats.set_defaults(run=None)

    cluster = commands.add_parser("cluster", help="(cluster extra) a cluster's groups, owners and standbys; move one")
    cluster_actions = cluster.add_subparsers(dest="cluster_action", required=True, metavar="ACTION",
                                             parser_class=stats.Parser)
    cluster_status = cluster_actions.add_parser("status", help="each group: owner, epoch, NATS leader, standbys' lag")
    cluster_status.add_argument("--json", action="store_true", help="one JSON array instead of a table")
    cluster_move = cluster_actions.add_parser("move", help="hand a group to a node that stands by for it, and pin it "
                                                           "there (the nodes' balancing leaves it alone)")
    cluster_move.add_argument("group", type=int)
    cluster_move.add_argument("node")
    cluster_unpin = cluster_actions.add_parser("unpin", help="let the nodes balance pinned groups again")
    cluster_unpin.add_argument("groups", type=int, nargs="*", default=[], help="(default: every pinned group)")
    cluster_remove = cluster_actions.add_parser("remove", help="delete a cluster's streams made with --groups N (and "
                                                               "its map once no stream is left); refused while "
                                                               "any of their groups has an owner that answers")
    cluster_remove.add_argument("--groups", type=int, required=True, metavar="N", help="the group count to remove")
    for action in (cluster_status, cluster_move, cluster_unpin, cluster_remove):
        action.add_argument("--log", required=True, metavar="NATS_URLS", help="the cluster's NATS servers, as mqksd's")
        action.add_argument("--cluster", required=True, metavar="NAME", help="the cluster's name, as mqksd's")
        for flag in ("--log-ca", "--log-cert", "--log-key", "--log-creds", "--log-nkey"):
            action.add_argument(flag, default=None, metavar="FILE", help=f"as mqksd's {flag} (TLS and credentials for "
                                "NATS; MQKS_NATS_USER, MQKS_NATS_PASSWORD, MQKS_NATS_TOKEN from the environment)")
    cluster.set_defaults(run=None)
    return parser


def duration(seconds: float) -> str:
    """`45 s`, `12 min`, `3 h`: how long a standby has been silent, as a person reads it."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.0f} h"


def cmd_cluster(args: argparse.Namespace) -> int:
    """`mqks cluster status|move`: read from NATS (the groups' streams and the cluster's bucket), not from a broker."""
    import asyncio

    from mqks.client.cluster import move_group, read_cluster, remove_cluster, unpin_groups
    from mqks.common.nats_urls import log_urls, nats_access

    urls = log_urls(args.log)
    access = nats_access(args)
    problem = access.problem()
    if problem is not None:
        print(f"mqks cluster {args.cluster_action}: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.cluster_action == "unpin":
            unpinned = asyncio.run(unpin_groups(urls, args.cluster, args.groups, access))
            print(f"unpinned groups: {', '.join(map(str, unpinned))}" if unpinned else "no group was pinned")
            return EXIT_OK
        if args.cluster_action == "remove":
            removed = asyncio.run(remove_cluster(urls, args.cluster, args.groups, access))
            print(f"removed {len(removed)} stream{'' if len(removed) == 1 else 's'}: {', '.join(removed)}" if removed
                  else f"cluster {args.cluster!r} has no streams of {args.groups} groups")
            return EXIT_OK
        if args.cluster_action == "move":
            row = asyncio.run(move_group(urls, args.cluster, args.group, args.node, access=access))
            print(f"group {row['group']}: owned by node {row['owner']} (epoch {row['epoch']}) at {row['address']}")
            return EXIT_OK
        rows = asyncio.run(read_cluster(urls, args.cluster, access))
    except (ValueError, TimeoutError, OSError) as e:
        print(f"mqks cluster {args.cluster_action}: {e}", file=sys.stderr)
        return EXIT_BROKER
    except Exception as e:  # nats-py's own errors: no servers, no JetStream
        print(f"mqks cluster {args.cluster_action}: {nats_error(e, urls)}", file=sys.stderr)
        return EXIT_BROKER
    if args.json:
        print(json.dumps(rows))
        return EXIT_OK
    print(render_cluster(rows))
    return EXIT_OK


def nats_error(error: Exception, urls: list[str]) -> str:
    """One of nats-py's errors as the operator reads it: a 503 means NATS is electing a JetStream leader."""
    from nats.js.errors import ServiceUnavailableError

    from mqks.client.cluster import electing

    return electing(urls) if isinstance(error, ServiceUnavailableError) else f"{type(error).__name__}: {error}"


LEADER_CHARS = 8  # a NATS server without server_name is named by its 56-character id: cut to this, with ".."


def render_cluster(rows: list[dict]) -> str:
    """`mqks cluster status`'s table, within 80 columns for three nodes; then how old the standbys' reports are, and
    the pins.

    A lag is frames behind LAST SEQ at the standby's last report (each node process reports every 20 s, and within
    10 s of a change); `100+`: counted up to 100, and more; `down`: not reported for 30 s (the line under the table
    says since when).
    """
    table = [("GROUP", "OWNER", "EPOCH", "ADDRESS", "ANSWERS", "LEADER", "LAST SEQ", "STANDBY LAG")]
    ages: dict[str, float] = {}  # node: its oldest report shown
    pins = []
    for row in rows:
        lags = []
        for standby in row["standbys"]:
            node = str(standby["node"])
            ages[node] = max(ages.get(node, 0.0), float(standby["seen_seconds_ago"]))
            if standby["down"]:
                lags.append(f"{node} down")
            else:
                lags.append(f"{node} {standby['lag']}{'+' if standby.get('lag_capped') else ''}")
        leader = str(row["leader"] or "-")
        if len(leader) > LEADER_CHARS:
            leader = leader[:LEADER_CHARS - 2] + ".."
        if row["pinned"]:
            pins.append(f"group {row['group']} to {row['pinned']}")
        table.append((str(row["group"]), str(row["owner"] or "-"), str(row["epoch"] or "-"), str(row["address"] or "-"),
                      "yes" if row["answering"] == row["owner"] and row["owner"] else "NO", leader,
                      str(row["last_seq"]), ", ".join(lags) or "-"))
    lines = [render_table(table, (0, 2, 6), "no groups")]
    if ages:
        reported = ", ".join(f"{node} {duration(age)}" for node, age in sorted(ages.items()))
        lines.append(f"STANDBY LAG in frames, as reported {reported} ago")
    if pins:
        lines.append(f"pinned (mqks cluster unpin lets them go): {', '.join(pins)}")
    return "\n".join(lines)


def cmd_nats(args: argparse.Namespace) -> int:
    """`mqks nats up|down|status`: no broker involved, only nats-server processes (client/nats_local.py)."""
    from mqks.client import nats_local

    try:
        if args.nats_action == "up":
            try:
                nodes = nats_local.up(args.dir, args.nodes, args.cluster, args.base_port)
            except nats_local.AlreadyUp as e:  # as the first `up` printed it: NATS=$(mqks nats up | sed -n 1p)
                print(f"mqks nats up: {e}", file=sys.stderr)
                nodes = e.nodes
            print(",".join(node.url for node in nodes))
            for node in nodes:
                print(f"  {node.name}  {node.url}  pid {node.pid}  http://127.0.0.1:{node.http_port}  log {node.log}")
        elif args.nats_action == "down":
            for node in nats_local.down(args.dir, args.timeout):
                print(f"  {node.name}  stopped (pid {node.pid})" if node.pid else f"  {node.name}  was not running")
        else:
            nodes = nats_local.load(args.dir)
            print(",".join(node.url for node in nodes))  # as `up` printed it: NATS=$(mqks nats status | sed -n 1p)
            for node in nodes:
                if not node.pid:
                    state = f"stopped (mqks nats up --dir {args.dir} starts it again, with its data)"
                elif nats_local.healthy(node):
                    state = "up"
                else:
                    state = "running, not ready" if nats_local.alive(node.pid) else "down"
                print(f"  {node.name}  {node.url}  pid {node.pid or '-'}  {state}")
    except nats_local.NatsError as e:
        print(f"mqks nats {args.nats_action}: {e}", file=sys.stderr)
        return EXIT_BROKER
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `mqks` console script."""
    argv = sys.argv[1:] if argv is None else argv
    command = next((arg for arg in argv if arg in COMMANDS), None)
    parser = build_parser(json_errors=command in JSON_COMMANDS and "--json" in argv)
    args, extras = parser.parse_known_args(argv)
    if extras:
        command_parser = parser.commands_by_name.get(args.command, parser)
        if "data" in args and not any(extra.startswith("-") for extra in extras):
            # argparse reads DATA up to the first option: the words after one are not DATA any more
            command_parser.error(f"DATA comes in one piece, before the options: {' '.join(extras)!r} came after "
                                 "one; quote DATA that has spaces (mqks publish EVENT 'hello world' --confirm)")
        command_parser.error(f"unrecognized arguments: {' '.join(extras)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format=stats.LOG_FORMAT)
    try:
        if args.command == "nats":
            return cmd_nats(args)
        if args.command == "cluster":
            return cmd_cluster(args)
        if args.run is None:
            return stats.run(args, f"mqks {args.command}")
        return run_command(args)
    except BrokenPipeError:
        stats.stdout_closed()  # the reader of stdout went away (`| head -1`): nothing left to say to it
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def run_command(args: argparse.Namespace) -> int:
    """Connect, run the command, close; maps what went wrong to an exit code with one line on stderr."""
    if args.command == "top":
        try:
            import rich  # noqa: F401 - only to tell the user how to get it before connecting
        except ImportError:
            print(TOP_HINT, file=sys.stderr)
            return EXIT_FEATURE_OFF
    run: Callable[[Client, argparse.Namespace], int] = args.run
    json_output = args.command in JSON_COMMANDS and args.json

    def fail(reason: str, code: int) -> int:
        if json_output:
            stats.print_json_error(reason)
        else:
            print(f"mqks {args.command}: {reason}", file=sys.stderr)
        return code

    try:
        settings = stats.connection_settings(args)
    except ValueError as e:
        return fail(str(e), EXIT_USAGE)
    # the errors answered to lines nobody waits for (a publish without --confirm): in by close()'s barrier
    refusals: list[MqksError] = []
    # ping needs no token (the broker answers it before auth), as at nc
    client = Client(args.host, args.port, timeout_seconds=args.timeout, connect_timeout_seconds=args.timeout,
                    anonymous=args.command == "ping", on_refused=refusals.append, **settings)
    flushed = False
    try:
        client.connect(retry=False)
        code = run(client, args)
        try:
            client.flush()  # every line read, every refusal in: else exit 0 could stand for lines never done
        except MqksTimeoutError:
            raise MqksConnectionError(f"{args.host}:{args.port} did not say within {args.timeout:g}s that it read "
                                      "every line sent: what they asked may not have been done") from None
        flushed = True
    except (ValueError, TypeError) as e:
        code = fail(str(e), EXIT_USAGE)
    except FeatureOff as e:
        code = fail(str(e), EXIT_FEATURE_OFF)
    except NoSuchQueue as e:
        code = fail(str(e), EXIT_BROKER)
    except MqksConnectionError as e:
        code = fail(stats.said_by_a_command(e), EXIT_BROKER)
    except MqksError as e:
        code = fail(f"{args.host}:{args.port} answered {e}", EXIT_BROKER)
    finally:
        client.close(flush=not flushed)
    for error in refusals:
        fail(f"{args.host}:{args.port} answered {error}", EXIT_BROKER)
    return EXIT_BROKER if refusals and code == EXIT_OK else code


if __name__ == "__main__":
    sys.exit(main())

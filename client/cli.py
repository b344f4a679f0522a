"""The `mqks` command: publish, consume, ping, stats and eval from a terminal, through `Client`.

Exit codes: 0 done (a consume stopped by Ctrl-C or SIGTERM included), 1 the broker said error or
could not be reached, 2 bad usage, 3 stats without `_eval` on the broker.
A consume prints one line per message, as the wire shows it: `{msg_id} event={event}[,retry={n}] {data}`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable

import gevent
from gevent.event import Event

from . import stats
from .client import Client, Message
from .errors import MqksError


def cmd_publish(client: Client, args: argparse.Namespace) -> int:
    msg_id = client.publish(args.event, args.data, confirm=args.confirm)
    if args.confirm:
        print(msg_id, flush=True)
    return 0


def cmd_consume(client: Client, args: argparse.Namespace) -> int:
    stop = Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        gevent.signal_handler(signum, stop.set)

    def on_msg(message: Message) -> None:
        retry = f",retry={message.retry}" if message.retry else ""
        # print before ack: a message that was never shown must come back
        print(f"{message.id} event={message.event}{retry} {message.data}", flush=True)
        message.ack()

    def on_reconnect(old_id: str, new_id: str) -> None:
        print(f"mqks: reconnected, consumer {old_id} is now {new_id}", file=sys.stderr, flush=True)

    consumer_id = client.consume(args.queue, args.events, on_msg, manual_ack=args.manual_ack, add=args.add,
                                 delete_queue_when_unused=args.delete_queue_when_unused, confirm=True,
                                 on_reconnect=on_reconnect)
    print(f"mqks: consuming queue {args.queue} as consumer {consumer_id}; Ctrl-C to stop",
          file=sys.stderr, flush=True)
    stop.wait()
    return 0


def cmd_ping(client: Client, args: argparse.Namespace) -> int:
    print(client.ping(args.data), flush=True)
    return 0


def cmd_eval(client: Client, args: argparse.Namespace) -> int:
    print(client.eval(args.code, worker=args.worker), flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mqks", description="Talk to an MQKS broker.")
    stats.add_connection_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log the client's connection events")
    # the same options after the command name: `mqks --port 1 ping` and `mqks ping --port 1` both work
    common = argparse.ArgumentParser(add_help=False)
    stats.add_connection_arguments(common, defaults=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log the client's connection events")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    publish = commands.add_parser("publish", parents=[common], help="publish one message")
    publish.add_argument("event", metavar="EVENT")
    publish.add_argument("data", nargs="?", default="", metavar="DATA",
                         help="the message text (may hold spaces, not newlines)")
    publish.add_argument("--confirm", action="store_true", help="wait for the broker's ok and print the msg id")
    publish.set_defaults(run=cmd_publish)

    consume = commands.add_parser("consume", parents=[common], help="print each message of a queue until Ctrl-C")
    consume.add_argument("queue", metavar="QUEUE")
    consume.add_argument("events", nargs="*", metavar="EVENT",
                         help="events or masks (user.*.created) that replace the queue's bindings")
    consume.add_argument("--add", action="store_true", help="add the events to the queue's bindings instead")
    consume.add_argument("--manual-ack", action="store_true", help="ack each message after printing it")
    consume.add_argument("--delete-queue-when-unused", nargs="?", type=float, const=True, default=None,
                         metavar="SECONDS", help="delete the queue once unused (for SECONDS)")
    consume.set_defaults(run=cmd_consume)

    ping = commands.add_parser("ping", parents=[common], help="check the broker answers")
    ping.add_argument("data", nargs="?", default="pong", metavar="DATA", help="what the broker echoes (default pong)")
    ping.set_defaults(run=cmd_ping)

    stats_parser = commands.add_parser("stats", parents=[common],
                                       help="figures per worker and in total (needs mqksd --eval)")
    stats.add_arguments(stats_parser)
    stats_parser.set_defaults(run=None)

    eval_parser = commands.add_parser("eval", parents=[common], help="evaluate a Python expression in the broker")
    eval_parser.add_argument("code", metavar="EXPRESSION")
    eval_parser.add_argument("--worker", type=int, default=None)
    eval_parser.set_defaults(run=cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `mqks` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.run is None:
        return stats.run(args)
    run: Callable[[Client, argparse.Namespace], int] = args.run
    client = Client(args.host, args.port, timeout_seconds=args.timeout, connect_timeout_seconds=args.timeout)
    try:
        client.connect()
        return run(client, args)
    except (ValueError, TypeError) as e:
        print(f"mqks {args.command}: {e}", file=sys.stderr)
        return 2
    except MqksError as e:
        print(f"mqks {args.command}: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())

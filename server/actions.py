"""Steps 3-4 of the flow: one small handler per action, and the dispatcher that runs lines.

`run_lines` does the checks every action shares (a line that will not split, an unknown
action, `--confirm` as the first word, protected actions); each `handle_<action>` parses
only its own arguments and calls the broker of the shard that owns the queue. A handler
answers through the connection (`ok`, `write`) and reports client mistakes by raising
`ProtocolError`.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

from .protocol import ProtocolError, looks_like_http, parse_count, parse_flag_value, parse_seconds, text
from .state import Broker, Consumer

if TYPE_CHECKING:
    from .connection import Connection

log = logging.getLogger("mqks.actions")

Handler: TypeAlias = Callable[["Connection", bytes, bytes, bool], None]


def shard_for(conn: Connection, queue: bytes) -> Broker:
    """The shard that owns `queue`: crc32 is stable across processes, unlike hash()."""
    shards = conn.shards
    return shards[zlib.crc32(queue) % len(shards)] if len(shards) > 1 else shards[0]


def check_name(name: bytes, what: str) -> bytes:
    if not name or name.startswith(b"--"):
        raise ProtocolError(f"{what} expected, got {text(name)!r}" if name else f"{what} expected")
    return name


def handle_publish(conn: Connection, rid: bytes, args: bytes, confirm: bool) -> None:
    space = args.find(b" ")
    if space < 0:
        event = args
        # the spec's delivery always has a space before {data}, even an empty one
        tail = b"".join((b" ok ", rid, b" event=", args, b" "))
    else:
        event = args[:space]
        tail = b"".join((b" ok ", rid, b" event=", args))
    if not event or event[0] == 45 and event.startswith(b"--"):
        check_name(event, "publish: event")
    for shard in conn.shards:
        shard.publish(rid, event, tail)
    if confirm:
        conn.ok(rid)


def parse_consume(args: bytes) -> tuple[bytes, list[bytes], list[bytes] | None, dict]:
    """`{queue} [events] [--add events] [flags]` -> (queue, events, added or None without --add, flags)."""
    tokens = args.split()
    if not tokens:
        raise ProtocolError("consume: queue expected: {consumer_id} consume {queue} [{event} ...] [flags]")
    queue = check_name(tokens[0], "consume: queue")
    events: list[bytes] = []
    added: list[bytes] | None = None
    flags: dict = {"manual_ack": False, "prefetch": 0, "delete_when_unused_seconds": None}
    target: list[bytes] | None = events
    for token in tokens[1:]:
        if not token.startswith(b"--"):
            if target is None:
                raise ProtocolError(f"consume: event {text(token)!r} after a flag; put events before flags or after --add")
            target.append(token)
            continue
        target = None
        if token == b"--add":
            target = added = added if added is not None else []
        elif token == b"--manual-ack":
            flags["manual_ack"] = True
        elif (value := parse_flag_value(token, b"--delete-queue-when-unused")) is not None:
            flags["delete_when_unused_seconds"] = parse_seconds(value, "--delete-queue-when-unused") if value else 0.0
        elif (value := parse_flag_value(token, b"--prefetch")) is not None:
            flags["prefetch"] = parse_count(value, "--prefetch")
        else:
            raise ProtocolError(f"consume: unknown flag {text(token)!r}")
    if flags["prefetch"] and not flags["manual_ack"]:
        raise ProtocolError("consume: --prefetch needs --manual-ack (auto-ack messages are never in flight)")
    return queue, events, added, flags


def handle_consume(conn: Connection, rid: bytes, args: bytes, confirm: bool) -> None:
    name, events, added, flags = parse_consume(args)
    if rid in conn.consumers_by_id:
        raise ProtocolError(f"consume: consumer {text(rid)!r} is already consuming on this connection")
    shard = shard_for(conn, name)
    queue = shard.queue(name)
    consumer = Consumer(rid, queue, conn, **flags)
    shard.consume(consumer, events, added)
    if confirm:
        conn.ok(rid)
    shard.pump(queue)


def handle_rebind(conn: Connection, rid: bytes, args: bytes, confirm: bool) -> None:
    tokens = args.split()
    if not tokens:
        raise ProtocolError("rebind: queue expected: {id} rebind {queue} [{event} ...] [--remove ...] [--remove-mask ...] [--add ...]")
    name = check_name(tokens[0], "rebind: queue")
    lists: dict[bytes, list[bytes]] = {b"": [], b"--remove": [], b"--remove-mask": [], b"--add": []}
    target = lists[b""]
    for token in tokens[1:]:
        if token.startswith(b"--"):
            if token not in lists:
                raise ProtocolError(f"rebind: unknown flag {text(token)!r}")
            target = lists[token]
        else:
            target.append(token)
    shard = shard_for(conn, name)
    queue = shard.queue(name)
    if shard.rebind(queue, replace=lists[b""] or None, add=lists[b"--add"], remove=lists[b"--remove"],
                    remove_masks=lists[b"--remove-mask"]):
        shard.updates(queue)
    if confirm:
        conn.ok(rid)


def parse_ack(conn: Connection, action: str, args: bytes) -> tuple[Consumer, list[bytes] | None]:
    """`{consumer_id} {msg_id} ...|--all` -> (consumer, msg ids or None for --all)."""
    tokens = args.split()
    if len(tokens) < 2:
        raise ProtocolError(f"{action}: expected {{consumer_id}} {{msg_id}}|--all")
    consumer = conn.consumers_by_id.get(tokens[0])
    if consumer is None:
        raise ProtocolError(f"{action}: unknown consumer {text(tokens[0])!r} on this connection")
    if tokens[1] == b"--all":
        if len(tokens) > 2:
            raise ProtocolError(f"{action}: --all takes no message ids")
        return consumer, None
    if tokens[1].startswith(b"--"):
        raise ProtocolError(f"{action}: unknown flag {text(tokens[1])!r}")
    return consumer, tokens[1:]


def handle_ack(conn: Connection, rid: bytes, args: bytes, confirm: bool) -> None:
    settle(conn, rid, args, confirm, "ack")


def handle_reject(conn: Connection, rid: bytes, args: bytes, confirm: bool) -> None:
    settle(conn, rid, args, confirm, "reject")


def settle(conn: Connection, rid: bytes, args: bytes, confirm: bool, action: str) -> None:
    """`ack` or `reject` one, several or all un-acked messages of a consumer."""
    consumer, msg_ids = parse_ack(conn, action, args)
    shard = shard_for(conn, consumer.queue.name)
    if msg_ids is None:
        (shard.ack_all if action == "ack" else shard.reject_all)(consumer)
    elif unknown := (shard.ack if action == "ack" else shard.reject)(consumer, msg_ids):
        raise ProtocolError(f"{action}: no un-acked message {text(b' '.join(unknown))!r} "
                            f"for consumer {text(consumer.consumer_id)!r}")
    if confirm:
        conn.ok(rid)


def handle_delete_consumer(conn: Connection, rid: bytes, args: bytes, confirm: bool) -> None:
    tokens = args.split()
    if len(tokens) != 1:
        raise ProtocolError("delete_consumer: expected {consumer_id}")
    consumer = conn.consumers_by_id.get(tokens[0])
    if consumer is None:
        raise ProtocolError(f"delete_consumer: unknown consumer {text(tokens[0])!r} on this connection")
    shard_for(conn, consumer.queue.name).remove_consumer(consumer)
    if confirm:
        conn.ok(rid)


def handle_delete_queue(conn: Connection, rid: bytes, args: bytes, confirm: bool) -> None:
    tokens = args.split()
    if len(tokens) != 1:
        raise ProtocolError("delete_queue: expected {queue}")
    name = check_name(tokens[0], "delete_queue: queue")
    shard_for(conn, name).delete_queue(name)
    if confirm:
        conn.ok(rid)


def handle_ping(conn: Connection, rid: bytes, args: bytes, confirm: bool) -> None:
    conn.ok(rid, args)


def handle_eval(conn: Connection, rid: bytes, args: bytes, confirm: bool) -> None:
    if not conn.server.config.eval_enabled:
        raise ProtocolError("_eval is disabled: start mqksd with --eval to enable it (loopback clients only)")
    if not conn.peer_is_loopback:
        raise ProtocolError("_eval answers loopback clients only")
    worker = 0
    first, _, code = args.partition(b" ")
    if (value := parse_flag_value(first, b"--worker")) is not None:
        worker = parse_count(value, "--worker")
        if worker >= len(conn.shards):
            raise ProtocolError(f"_eval: no worker {worker}: this server has {len(conn.shards)} (0..{len(conn.shards) - 1})")
    else:
        code = args
    if not code.strip():
        raise ProtocolError("_eval: expected a Python expression")
    namespace = {"state": conn.shards[worker], "server": conn.server}
    try:
        result = eval(code.decode(), namespace)  # noqa: S307 - operator-enabled, loopback-only backdoor
    except Exception as e:
        raise ProtocolError(f"_eval: {type(e).__name__}: {e}") from None
    conn.ok(rid, repr(result).replace("\n", "\\n").encode())


ACTIONS: dict[bytes, Handler] = {
    b"publish": handle_publish,
    b"consume": handle_consume,
    b"ack": handle_ack,
    b"reject": handle_reject,
    b"rebind": handle_rebind,
    b"delete_consumer": handle_delete_consumer,
    b"delete_queue": handle_delete_queue,
    b"ping": handle_ping,
    b"_eval": handle_eval,
}


def run_lines(conn: Connection, lines: list) -> None:
    """Run complete lines in order; a bad line costs only its own error answer."""
    actions = ACTIONS
    for line in lines:
        if not line:
            if line is None:
                rid, reason = conn.splitter.rejected.popleft()
                conn.error(rid, reason, line=b"")
            continue  # an empty line is ignored
        # `{rid} {action} {data}`, split inline: a helper call per line costs measurably here
        rid, _, rest = line.partition(b" ")
        action, _, args = rest.partition(b" ")
        handler = actions.get(action)
        if handler is None or not rid:
            unknown_action(conn, rid, action, line)
            if conn.closed:
                return  # nothing after an HTTP header may run: it could be a browser's payload
            continue
        confirm = False
        if args.startswith(b"--confirm") and (len(args) == 9 or args[9] == 32):
            confirm = True
            args = args[10:]
        try:
            handler(conn, rid, args, confirm)
        except ProtocolError as e:
            conn.error(rid, str(e), line)
        except Exception:
            log.exception("internal error on line %r", line[:200])
            conn.error(rid, "internal error", line)


def unknown_action(conn: Connection, rid: bytes, action: bytes, line: bytes) -> None:
    if looks_like_http(line):
        # a browser page must not be able to speak MQKS to a broker on localhost
        log.warning("closing %s: its line looks like HTTP: %r", conn.peer, line[:80])
        conn.close()
    elif not rid or not action:
        conn.error(b"-", "expected {request_id} {action} {data}", line)
    else:
        conn.error(rid, f'unknown action "{text(action)}"', line)

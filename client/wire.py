"""Client side of the line protocol: requests to bytes, answer lines to parts. Pure, no I/O.

Step in the flow: both clients (the gevent `Client` and the Spark data source) build request lines
here, and split every answer line here. Invariants: a token (queue, event, id) never holds
whitespace, nor, from `Client`, a leading `--`; a data field never holds a newline, carriage return
or tab, so one request is always exactly one line. No gevent: Spark workers import this.
"""

from __future__ import annotations

import itertools
import json as stdjson
import math
import re
import secrets
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeAlias

import ujson

from .errors import MqksError, MqksTimeoutError

# whitespace would split a token; a leading "--" would make the server read it as a flag
_BAD_TOKEN = re.compile(r"\s|^--")
_WHITESPACE = re.compile(r"\s")
_FORBIDDEN_IN_DATA = ("\n", "\r", "\t")
CRON_FIELDS = 5  # minute hour day-of-month month day-of-week

# a queue setting (max_retries, max_length): a count, "none" to clear it on the broker, None to leave it
QueueSetting: TypeAlias = int | str | None


def rid_maker() -> Callable[[], bytes]:
    """A source of request and msg ids: `{random prefix}{counter in hex}`.

    The prefix makes them unique across clients: the broker keys un-acked messages by msg id.
    """
    prefix = secrets.token_hex(6).encode()
    counter = itertools.count(1)

    def new_rid() -> bytes:
        return b"%b%x" % (prefix, next(counter))

    return new_rid


def encode_token(value: Any, kind: str, dashes_ok: bool = False) -> bytes:
    """`value` as UTF-8, or ValueError when it cannot be one protocol token.

    `dashes_ok` lets a leading `--` through: the Spark side leaves that verdict to the broker.
    """
    if not isinstance(value, str) or not value or (_WHITESPACE if dashes_ok else _BAD_TOKEN).search(value):
        rule = "without whitespace" if dashes_ok else "without whitespace or a leading '--'"
        raise ValueError(f"bad {kind} {value!r}: it must be a non-empty string {rule}")
    return value.encode()


def encode_tokens(values: list[str] | tuple[str, ...] | None, kind: str) -> list[bytes]:
    """Every value of `values` as a token (an empty list for None)."""
    if values is None:
        return []
    if isinstance(values, str):
        # a bare str would be iterated per character: a classic mistake worth a clear error
        raise TypeError(f"{kind}s must be a list of strings, not the string {values!r}")
    return [encode_token(value, kind) for value in values]


def encode_data(value: str | bytes, kind: str = "data") -> bytes:
    """`value` as the free-text tail of a line, or ValueError when it holds a line break or tab."""
    if isinstance(value, str):
        for char in _FORBIDDEN_IN_DATA:
            if char in value:
                raise ValueError(
                    f"{kind} holds {char!r}, which the protocol forbids; use json=True to escape it")
        return value.encode()
    if isinstance(value, (bytes, bytearray)):
        for byte in (b"\n", b"\r", b"\t"):
            if byte in value:
                raise ValueError(f"{kind} holds {byte!r}, which the protocol forbids")
        return bytes(value)
    raise TypeError(f"{kind} must be str or bytes, not {type(value).__name__}; use json=True for other types")


def event_token(event: Any) -> bytes:
    """`encode_token(event, "event")`, remembered: a publisher sends few distinct events, many times each."""
    try:
        return _EVENT_TOKENS[event]
    except (KeyError, TypeError):
        token = encode_token(event, "event")
    if len(_EVENT_TOKENS) >= EVENT_TOKENS_KEPT:
        _EVENT_TOKENS.clear()  # many distinct events: start over rather than grow without bound
    _EVENT_TOKENS[event] = token
    return token


_EVENT_TOKENS: dict[str, bytes] = {}
EVENT_TOKENS_KEPT = 4096


def publish_line(rid: bytes, event: str, data: str | bytes) -> bytes:
    """`{rid} publish {event} {data}\n` of a plain publish (the hot path of both clients)."""
    if type(data) is str and "\n" not in data and "\r" not in data and "\t" not in data:
        return b"%b publish %b %b\n" % (rid, event_token(event), data.encode())
    return b"%b publish %b %b\n" % (rid, event_token(event), encode_data(data))


def split_answer(line: bytes) -> tuple[bytes, bytes, bytes]:
    """`{rid} ok {data}` or `{rid} error {error_id} {reason}` -> (rid, status, rest)."""
    rid, _, rest = line.partition(b" ")
    status, _, data = rest.partition(b" ")
    return rid, status, data


def split_error(rest: bytes) -> tuple[str, str]:
    """The tail of an error answer -> (error_id, human reason, maybe empty)."""
    error_id, _, reason = rest.partition(b" ")
    return error_id.decode(errors="replace"), reason.decode(errors="replace")


def answer_error(rid: bytes, rest: bytes, context: str = "") -> MqksError:
    """The exception for `{rid} error {error_id} {reason}`, given what follows `error`; `context` leads the reason."""
    error_id, reason = split_error(rest)
    return MqksError(context + reason, error_id, rid.decode(errors="replace"))


def split_delivery(data: bytes) -> tuple[bytes, bytes, int, bytes]:
    """`{msg_id} event={event}[,retry={n}] {data}` -> (msg_id, event, retry, data); ValueError if not one."""
    msg_id, event, retry, _, body = split_delivery_reply(data)
    return msg_id, event, retry, body


def split_delivery_reply(data: bytes) -> tuple[bytes, bytes, int, bytes, bytes]:
    """`split_delivery` plus the reply token of a `request`'s delivery (b"" for a publish's) before the data."""
    msg_id, _, rest = data.partition(b" ")
    meta, _, body = rest.partition(b" ")
    if not msg_id or not meta.startswith(b"event="):
        raise ValueError(f"not a delivery: {data[:200]!r}")
    event, fields, reply_token = split_header(meta[6:])
    return msg_id, event, fields.get(b"retry", 0), reply_token, body


def split_header_fields(meta: bytes) -> tuple[bytes, dict[bytes, int]]:
    """`{event}[,reply={token}][,{name}={n}]...` -> (event, {name: n}): `split_header` without the reply token."""
    event, fields, _ = split_header(meta)
    return event, fields


def split_header(meta: bytes) -> tuple[bytes, dict[bytes, int], bytes]:
    """`{event}[,reply={token}][,{name}={n}]...` -> (event, {name: n}, reply token or b"").

    The server's fields come last and look like `,retry=2` (lowercase name, digits); they are
    read from the right, each name once, so an event holding a comma, an `=` or even
    `,retry=z` comes back whole, and a field a newer server adds (`,seq=7`) is skipped, not
    glued to the event. `,reply={token}` ([0-9a-z]) is the one field that is not a number; the
    server puts it right after the event, so nothing left of it is read as a field:
    `x,seq=5,reply=k7` is event `x,seq=5`. Only an event that itself ends in `,{name}={digits}`
    or `,reply={token}` is ambiguous.
    """
    fields: dict[bytes, int] = {}
    while True:
        cut = meta.rfind(b",")
        if cut < 0:
            break
        name, equals, value = meta[cut + 1 :].partition(b"=")
        if name == b"reply" and equals and is_reply_token(value):
            return meta[:cut], fields, value
        if not equals or not value.isdigit() or not name.isalpha() or not name.islower() or name in fields:
            break
        fields[name] = int(value)
        meta = meta[:cut]
    return meta, fields, b""


def is_reply_token(value: bytes) -> bool:
    """True for a token the broker hands out for a `request`: ASCII digits and lowercase letters only."""
    return value.isalnum() and value == value.lower()  # bytes.isalnum() is ASCII only


def is_update(data: bytes) -> bool:
    """True for `--update {queue} ...`; a delivery whose msg_id is "--update" has `event=` next."""
    return data.startswith(b"--update ") and not data[9:].startswith(b"event=")


def split_update(data: bytes) -> tuple[str, list[str]]:
    """`--update {queue} {events...} [flags]` -> (queue, events); the flags are the consumer's own."""
    tokens = data.split()
    queue = tokens[1].decode() if len(tokens) > 1 else ""
    events = [token.decode() for token in tokens[2:] if not token.startswith(b"--")]
    return queue, events


def is_fire_and_forget_publish(line: bytes) -> bool:
    """True for a publish line without --confirm: the only kind of unsent line worth resending."""
    parts = line.split(b" ", 3)
    return len(parts) >= 3 and parts[1] == b"publish" and parts[2] != b"--confirm"


def consume_line(consumer_id: bytes, queue: bytes, events: list[bytes], *, add: bool, confirm: bool,
                 manual_ack: bool, delete_queue_when_unused: float | bool | None, prefetch: int,
                 ack_timeout: float | None = None, max_retries: QueueSetting = None,
                 max_length: QueueSetting = None) -> bytes:
    """`{consumer_id} consume [--confirm] {queue} [--add] {events...} {flags...}`, without its newline.

    `add` keeps the queue's other bindings; without it, the events replace them (none: left as they are).
    """
    parts = [consumer_id, b"consume"]
    if confirm:
        parts.append(b"--confirm")
    parts.append(queue)
    if add and events:
        parts.append(b"--add")
    parts += events
    parts += consume_flags(manual_ack, delete_queue_when_unused, prefetch, ack_timeout=ack_timeout,
                           max_retries=max_retries, max_length=max_length)
    return b" ".join(parts)


def consume_flags(manual_ack: bool, delete_queue_when_unused: float | bool | None, prefetch: int, *,
                  ack_timeout: float | None = None, max_retries: QueueSetting = None,
                  max_length: QueueSetting = None) -> list[bytes]:
    """The flag tokens of a consume line, as the server prints them back in `--update`; ValueError for a bad one."""
    flags: list[bytes] = []
    if delete_queue_when_unused is True:
        flags.append(b"--delete-queue-when-unused")
    elif delete_queue_when_unused is not None and delete_queue_when_unused is not False:
        seconds = float(delete_queue_when_unused)
        if seconds < 0:
            raise ValueError(f"delete_queue_when_unused must be >= 0, not {delete_queue_when_unused!r}")
        flags.append(b"--delete-queue-when-unused=" + repr(seconds).encode())
    if manual_ack:
        flags.append(b"--manual-ack")
    if prefetch:
        if not manual_ack or prefetch < 0:
            raise ValueError("prefetch needs manual_ack=True and a count >= 0")
        flags.append(b"--prefetch=" + str(int(prefetch)).encode())
    if ack_timeout is not None:
        if not manual_ack:
            raise ValueError("ack_timeout needs manual_ack=True (auto-ack messages are never in flight)")
        flags.append(b"--ack-timeout=" + seconds_token(ack_timeout, "ack_timeout", zero_ok=False))
    return flags + queue_setting_flags(max_retries, max_length)



def queue_setting_flags(max_retries: QueueSetting, max_length: QueueSetting) -> list[bytes]:
    """`--max-retries=N` and `--max-length=N` (or `=none`) of a consume or rebind line; ValueError for a bad one."""
    flags: list[bytes] = []
    if max_retries is not None:
        flags.append(b"--max-retries=" + count_token(max_retries, "max_retries", minimum=0))
    if max_length is not None:
        flags.append(b"--max-length=" + count_token(max_length, "max_length", minimum=1))
    return flags


def update_queue_settings(data: bytes) -> tuple[int | None, int | None]:
    """(max_retries, max_length) of an `--update` line: the queue's settings now, None when unset."""
    max_retries = max_length = None
    for token in data.split()[2:]:
        if token.startswith(b"--max-retries=") and token[14:].isdigit():
            max_retries = int(token[14:])
        elif token.startswith(b"--max-length=") and token[13:].isdigit():
            max_length = int(token[13:])
    return max_retries, max_length


def seconds_token(value: Any, kind: str, *, zero_ok: bool) -> bytes:
    """A finite number of seconds (> 0, or >= 0 with `zero_ok`) as the broker reads it, or ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{kind} must be a number of seconds, not {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero_ok):
        rule = ">= 0" if zero_ok else "> 0"
        raise ValueError(f"{kind} must be a finite number of seconds {rule}, not {value!r}")
    return repr(seconds).encode()


def count_token(value: Any, kind: str, minimum: int) -> bytes:
    """An int >= `minimum`, or "none" (clears the setting), as a flag value; ValueError otherwise."""
    if value == "none":
        return b"none"
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f'{kind} must be an int >= {minimum} or "none", not {value!r}')
    return str(value).encode()


def publish_flags(delay: float | None, at: float | datetime | None) -> list[bytes]:
    """`--delay=S` or `--at=UNIX_SECONDS` of a publish or request line; ValueError for a bad or doubled one."""
    if delay is not None and at is not None:
        raise ValueError("give delay or at, not both")
    if delay is not None:
        return [b"--delay=" + seconds_token(delay, "delay", zero_ok=True)]
    if at is not None:
        when = at.timestamp() if isinstance(at, datetime) else at
        if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when):
            raise ValueError(f"at must be a datetime or finite unix seconds, not {at!r}")
        return [b"--at=" + repr(float(when)).encode()]
    return []


def schedule_args(name: str, event: str, data: bytes, *, every: float | None, cron: str | list[str] | None,
                  count: int | None, nohaste: bool) -> list[bytes]:
    """The arguments of `schedule {name} --every=S|--cron M H DOM MON DOW [--count=N] [--nohaste] {event} {data}`."""
    args = [encode_token(name, "schedule name")]
    if (every is None) == (cron is None):
        raise ValueError("a schedule needs every= or cron=, and not both")
    if every is not None:
        args.append(b"--every=" + seconds_token(every, "every", zero_ok=False))
    else:
        fields = cron.split() if isinstance(cron, str) else cron
        if not isinstance(fields, (list, tuple)) or len(fields) != CRON_FIELDS:
            raise ValueError(f"cron must be {CRON_FIELDS} fields (minute hour day-of-month month day-of-week), "
                             f"not {cron!r}")
        args += [b"--cron", *(encode_token(field, "cron field") for field in fields)]
    if count is not None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be an int >= 1, not {count!r}")
        args.append(b"--count=%d" % count)
    if nohaste:
        args.append(b"--nohaste")
    return [*args, encode_token(event, "event"), data]


# --- requests as both clients build them (the gevent `Client` and `mqks.aio.Client`): one encoder per action ---

REPLY_PREFIX = b"--reply "  # the answer to a `request`: `{rid} ok --reply {data}`
NO_REPLY_REASON = "no reply within"  # the broker's reason when a request times out
AUTH_FREE_REASONS = ("takes no token", "unknown action")  # an `auth` refusal that only means "no tokens here"
TOKEN_WANTED_REASON = "authentication required"  # a hello refused until `auth`
TOKEN_REQUIRED = "the broker requires a token"  # what a client says then; the commands say how to give one their way


def body(data: Any, json: bool, kind: str = "data") -> bytes:
    """A publish's, request's or reply's data as the tail of its line; JSON-encoded with `json`."""
    return encode_data(ujson.dumps(data) if json else data, kind)


def publish_args(event: str, data: Any, json: bool, delay: float | None, at: float | datetime | None,
                 mandatory: bool = False) -> list[bytes]:
    """The arguments of `publish [--mandatory] [--delay=S|--at=T] {event} {data}`; ValueError/TypeError before
    anything is sent."""
    return [*((b"--mandatory",) if mandatory else ()), *publish_flags(delay, at), event_token(event),
            body(data, json)]


def settle_args(action: bytes, consumer_id: str, msg_ids: tuple[str, ...] | list[str], all: bool,
                flags: tuple[bytes, ...] = ()) -> list[bytes]:
    """The arguments of `ack|reject|touch {consumer_id} {msg_ids...}|--all [flags]`."""
    if not msg_ids and not all:
        raise ValueError(f"{action.decode()} needs msg ids or all=True")
    args = [encode_token(consumer_id, "consumer id")]
    args += [b"--all"] if all else encode_tokens(list(msg_ids), "msg id")
    return [*args, *flags]


def reject_flags(delay: float | None) -> tuple[bytes, ...]:
    """`--delay=S` of a reject (extension): requeue after that many seconds."""
    return () if delay is None else (b"--delay=" + seconds_token(delay, "delay", zero_ok=True),)


def rebind_args(queue: str, events: list[str] | None, remove: list[str] | tuple[str, ...],
                remove_mask: list[str] | tuple[str, ...], add: list[str] | tuple[str, ...],
                max_retries: QueueSetting, max_length: QueueSetting) -> list[bytes]:
    """The arguments of `rebind {queue} [events] [--remove ...] [--remove-mask ...] [--add ...] [settings]`."""
    args = [encode_token(queue, "queue"), *encode_tokens(events, "event")]
    for flag, values, kind in ((b"--remove", remove, "event"), (b"--remove-mask", remove_mask, "mask"),
                               (b"--add", add, "event")):
        if values:
            args += [flag, *encode_tokens(values, kind)]
    return args + queue_setting_flags(max_retries, max_length)


def request_args(event: str, data: Any, timeout: float, json: bool) -> list[bytes]:
    """The arguments of `request --timeout=S {event} {data}` (extension)."""
    return [b"--timeout=" + seconds_token(timeout, "timeout", zero_ok=False), encode_token(event, "event"),
            body(data, json)]


def request_failure(error: MqksError) -> MqksError:
    """The exception a failed `request` raises: the broker's "no reply" becomes a timeout, the rest as they are."""
    # only the broker's answer has an error id: a lost connection or the client's own timeout pass as they are
    if error.error_id and error.reason.startswith(NO_REPLY_REASON):
        return MqksTimeoutError(error.reason, error.error_id, error.rid)
    return error


def reply_data(answer: bytes, json: bool) -> Any:
    """The reply inside a `request`'s answer (`--reply {data}`): str, or decoded with `json`."""
    if not answer.startswith(REPLY_PREFIX):
        raise MqksError(f"unexpected answer to request: {answer[:200]!r}")
    reply = answer[len(REPLY_PREFIX):].decode()
    return ujson.loads(reply) if json else reply


def reply_args(token: str, data: Any, json: bool) -> list[bytes]:
    """The arguments of `reply {token} {data}` (extension)."""
    return [encode_token(token, "reply token"), body(data, json)]


def worker_number(worker: Any) -> int:
    """`worker` as a worker number, or ValueError."""
    if isinstance(worker, bool) or not isinstance(worker, int) or worker < 0:
        raise ValueError(f"worker must be an int >= 0, not {worker!r}")
    return worker


def queues_args(mask: str | None, detail: bool) -> bytes:
    """The arguments of `queues [--detail] [{mask}]`."""
    args = [b"--detail"] if detail else []
    if mask is not None:
        args.append(encode_token(mask, "mask"))
    return b" ".join(args)


def stats_args(worker: int | None) -> bytes:
    """The arguments of `stats [--worker=N]`."""
    return b"" if worker is None else b"--worker=%d" % worker_number(worker)


def requeue_dead_args(queue: str, limit: int | None, msg_ids: list[str] | tuple[str, ...] | None) -> bytes:
    """The arguments of `requeue_dead {queue} [--limit=N | {msg_id}...]`."""
    args = [encode_token(queue, "queue")]
    if limit is not None and msg_ids is not None:
        raise ValueError("requeue_dead: give limit or msg_ids, not both")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"bad limit {limit!r}: a whole number >= 0")
        args.append(b"--limit=%d" % limit)
    args += encode_tokens(msg_ids, "message id")
    return b" ".join(args)


def count_answer(answer: bytes, action: str) -> int:
    """The count of an `ok {count}` answer (purge_queue, requeue_dead)."""
    try:
        return int(answer)
    except ValueError:
        raise MqksError(f"{action}: expected a count, got {answer[:200]!r}") from None


def eval_args(code: str, worker: int | None) -> bytes:
    """The arguments of `_eval [--worker=N] {code}`."""
    prefix = b"" if worker is None else b"--worker=%d " % int(worker)
    return prefix + encode_data(code, "code")


def json_object(answer: bytes, action: str) -> dict[str, Any]:
    """The JSON object of one answer line (stats, queues, schedules), or MqksError naming what came instead."""
    try:
        value = stdjson.loads(answer)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise MqksError(f"unexpected answer to {action}: {answer[:200]!r}")
    return value


def hello_info(answer: bytes) -> dict[str, Any] | None:
    """A `hello` answer's JSON object; None when it is not one (then there is no slot map to follow)."""
    try:
        info = stdjson.loads(answer)
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


def hello_line(rid: bytes, ttl_seconds: float | None) -> bytes:
    """`{rid} hello [--ttl=S]` with its newline: the broker drops a client silent for 2x that TTL."""
    return rid + b" hello" + (b" --ttl=%g" % ttl_seconds if ttl_seconds else b"") + b"\n"


def auth_refusal(error: MqksError) -> MqksError | None:
    """The error to raise for a refused `auth`; None when the broker only takes no tokens (then it serves anyone)."""
    if any(reason in error.reason for reason in AUTH_FREE_REASONS):
        return None
    return MqksError(f"the broker refused the token: {error}")


def hello_refusal(error: MqksError, have_token: bool, anonymous: bool) -> MqksError | None:
    """The error to raise for a refused `hello`; None when the broker predates hello or the client is anonymous."""
    if TOKEN_WANTED_REASON in error.reason and (have_token or not anonymous):
        return MqksError(f"{TOKEN_REQUIRED}: pass Client(token=...) or set MQKS_AUTH_TOKEN")
    return None


def connect_failure(error: BaseException) -> str:
    """The reason of a failed connect, as a person reads it: `Connection refused`, not `[Errno 111] ...`."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error) or type(error).__name__

"""A NATS connection read and written by the gevent hub itself, for the replicated log's hot traffic: a writer's
frames and their PubAcks, an idle owner's heartbeats, owner pings, and the frames NATS pushes to a standby. No thread
and no asyncio on that path: `bench/bridge_cost.py` measured a stored frame at 256 µs of the broker's CPU through the
bridge (nats_bridge.py: a pipe write, a thread wake and a hub wake per hop) and 82 through one socket in the hub.
The JetStream API (streams, consumers, tail reads, the cluster map) stays on the bridge, which has nats-py.

Core NATS only: CONNECT with what the bridge proves itself with (a user and password or a token in the URL or the
options, an nkey seed, a .creds file, TLS), SUB/UNSUB, PUB/HPUB in, MSG/HMSG out, PING/PONG. Callbacks run in the
reader's greenlet and must not block. Writes from a hub turn go out together, in one send. A lost connection
(a closed socket, or two PINGs unanswered) is made again to any server known, those given and those NATS advertises,
and its subscriptions with it; what was published meanwhile is lost, as core NATS loses it: a writer whose PubAcks
do not come reads its log's tail and sends again, and a standby's consumer count shows the gap."""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import random
import urllib.parse
from collections import deque
from collections.abc import Callable
from typing import Any

import gevent
import gevent.ssl
from gevent import socket as gsocket
from gevent.event import AsyncResult, Event

from ...common.nats_urls import shown

log = logging.getLogger("mqks.journal")

Headers = dict[str, str]
Callback = Callable[[str, str, "Headers | None", bytes], None]  # subject, reply ("" for none), headers, data

PING_SECONDS = 1.0  # as the bridge: a dead connection is found within seconds, not minutes
MAX_PINGS_OUT = 2
RECONNECT_WAIT_SECONDS = 1.0
READ_BYTES = 1 << 16
HEADER_LINE = b"NATS/1.0"


class BridgeError(Exception):
    """NATS cannot be reached, or the bridge is closed; the message says why."""


class NatsUnreachable(BridgeError):
    """No server of the list answers, or NATS refused this connection (the text says which and why)."""


def parse_headers(block: bytes) -> Headers:
    """A message's `NATS/1.0[ status description]` block as nats-py shows it: the status under "Status"."""
    lines = block.decode(errors="replace").split("\r\n")
    headers: Headers = {}
    status = lines[0][len("NATS/1.0"):].strip()
    if status:
        code, _, description = status.partition(" ")
        headers["Status"] = code
        if description:
            headers["Description"] = description
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if colon:
            headers[name.strip()] = value.strip()
    return headers


def header_block(headers: Headers) -> bytes:
    return ("NATS/1.0\r\n" + "".join(f"{name}: {value}\r\n" for name, value in headers.items()) + "\r\n").encode()


def ack_sequences(reply: str) -> tuple[int, int]:
    """A JetStream delivery's stream and consumer sequences, from its `$JS.ACK...` reply subject (the old form has 9
    tokens, the one with a domain and an account hash 12 or more)."""
    tokens = reply.split(".")
    if len(tokens) == 9:
        return int(tokens[5]), int(tokens[6])
    return int(tokens[7]), int(tokens[8])


class HubNats:
    """One core NATS connection in the hub; `connect()` from a greenlet, then publish and subscribe from any."""

    def __init__(self, servers: list[str], options: dict[str, Any] | None = None, connect_timeout: float = 5.0,
                 name: str = "mqks") -> None:
        self.servers = list(servers)
        self.options = options or {}
        self.connect_timeout = connect_timeout
        self.name = name
        self.max_payload = 1 << 20
        self.connected = False
        self.reconnects = 0
        self._known = list(servers)  # and the servers NATS advertises (INFO connect_urls)
        self._auth_url = next((url for url in servers if "@" in urllib.parse.urlsplit(url).netloc), None)
        self._subscriptions: dict[int, tuple[str, Callback]] = {}
        self._sids = itertools.count(1)
        self._inbox = f"_INBOX.{os.urandom(8).hex()}"
        self._inboxes = itertools.count(1)
        self._sock: Any = None
        self._out: list[bytes] = []
        self._out_ready = Event()
        self._pongs: deque[AsyncResult | None] = deque()  # one per PING sent: a sync's waiter, or None
        self._closed = False
        self._runner: gevent.Greenlet | None = None
        self._helpers: list[gevent.Greenlet] = []
        self._refused_once: set[str] = set()
        self._pending_read = b""  # what the connect read past its PONG
        self._subscribed: set[int] = set()  # the sids the connect subscribed

    # -- the calls --------------------------------------------------------------------------------

    def connect(self) -> None:
        """Connect to one of the servers (in random order); raises NatsUnreachable when none answers."""
        self._sock = self._connect_any(self.servers)
        self._serve_in_background()

    def new_inbox(self) -> str:
        return f"{self._inbox}.{next(self._inboxes)}"

    def subscribe(self, subject: str, callback: Callback) -> int:
        sid = next(self._sids)
        self._subscriptions[sid] = (subject, callback)
        if self.connected:
            self._write(b"SUB %b %d\r\n" % (subject.encode(), sid))
        return sid

    def unsubscribe(self, sid: int) -> None:
        if self._subscriptions.pop(sid, None) is not None and self.connected:
            self._write(b"UNSUB %d\r\n" % sid)

    def publish(self, subject: str, data: bytes, reply: str = "", headers: Headers | None = None) -> None:
        """Queue a message for this hub turn's send; raises NatsUnreachable while the connection is being made anew."""
        if not self.connected:
            raise NatsUnreachable("not connected to NATS (reconnecting)")
        target = f"{subject} {reply}" if reply else subject
        if headers:
            block = header_block(headers)
            self._out.append(b"HPUB %b %d %d\r\n" % (target.encode(), len(block), len(block) + len(data)))
            self._out.append(block)
        else:
            self._out.append(b"PUB %b %d\r\n" % (target.encode(), len(data)))
        self._out.append(data)
        self._out.append(b"\r\n")
        self._out_ready.set()

    def sync(self, timeout: float = 5.0) -> None:
        """Return once NATS has read everything sent before (a PING's PONG): a subscription made before a consumer
        that delivers to it is in place by then. Raises NatsUnreachable (or gevent.Timeout's text) if not."""
        if not self.connected:
            raise NatsUnreachable("not connected to NATS (reconnecting)")
        waiter: AsyncResult = AsyncResult()
        self._pongs.append(waiter)
        self._write(b"PING\r\n")
        try:
            waiter.get(timeout=timeout)
        except gevent.Timeout:
            raise NatsUnreachable(f"NATS did not answer a PING within {timeout:g} s") from None

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (for at most `timeout`), then close."""
        if self._closed:
            return
        if self.connected and self._out:
            try:
                self.sync(timeout)
            except NatsUnreachable:
                pass
        self._closed = True
        self.connected = False
        gevent.killall([g for g in (self._runner, *self._helpers) if g is not None and g is not gevent.getcurrent()],
                       block=False)
        if self._sock is not None:
            self._sock.close()

    # -- connecting -------------------------------------------------------------------------------

    def _connect_any(self, servers: list[str]) -> Any:
        reasons = []
        for url in random.sample(servers, len(servers)):
            try:
                return self._open(url)
            except NatsUnreachable as e:
                reasons.append(str(e))
            except (OSError, ValueError, gevent.Timeout) as e:
                reasons.append(f"{shown([url])}: {type(e).__name__}: {e}")
        raise NatsUnreachable("; ".join(reasons) or "no server")

    def _open(self, url: str) -> Any:
        """A connection to `url`, CONNECT sent and answered, subscriptions made; buffers empty."""
        parts = urllib.parse.urlsplit(url if "://" in url else f"nats://{url}")
        host, port = parts.hostname or "127.0.0.1", parts.port or 4222
        sock = gsocket.create_connection((host, port), timeout=self.connect_timeout)
        try:
            pending = b""
            while b"\r\n" not in pending:
                chunk = sock.recv(READ_BYTES)
                if not chunk:
                    raise NatsUnreachable(f"{shown([url])}: closed before INFO")
                pending += chunk
            line, _, pending = pending.partition(b"\r\n")
            if not line.startswith(b"INFO "):
                raise NatsUnreachable(f"{shown([url])}: not a NATS server (it said {line[:40]!r})")
            info = json.loads(line[5:])
            context = self.options.get("tls")
            if info.get("tls_required") or context is not None or parts.scheme == "tls":
                if context is None:
                    context = gevent.ssl.create_default_context()
                sock = gevent.ssl.SSLSocket(sock=sock, server_hostname=host, _context=context)
            self._note_info(info)
            sock.sendall(b"CONNECT %b\r\nPING\r\n" % json.dumps(self._connect_options(parts, info)).encode())
            while True:
                while b"\r\n" not in pending:
                    chunk = sock.recv(READ_BYTES)
                    if not chunk:
                        raise NatsUnreachable(f"{shown([url])}: closed the connection at CONNECT")
                    pending += chunk
                line, _, pending = pending.partition(b"\r\n")
                if line.startswith(b"-ERR"):
                    raise NatsUnreachable(f"{shown([url])} refused the connection: "
                                          f"{line[5:].decode(errors='replace').strip(chr(39))}")
                if line == b"PONG":
                    break
                if line.startswith(b"INFO "):
                    self._note_info(json.loads(line[5:]))
            sock.settimeout(None)
            self._subscribed = set(self._subscriptions)
            subscribing = b"".join(b"SUB %b %d\r\n" % (subject.encode(), sid)
                                   for sid, (subject, _) in self._subscriptions.items())
            if subscribing:
                sock.sendall(subscribing)
            self._pending_read = pending
            return sock
        except BaseException:
            sock.close()
            raise

    def _connect_options(self, parts: urllib.parse.SplitResult, info: dict[str, Any]) -> dict[str, Any]:
        options: dict[str, Any] = {"verbose": False, "pedantic": False, "lang": "python-mqks-hub", "version": "1",
                                   "protocol": 1, "headers": True, "no_responders": True, "name": self.name,
                                   "echo": False,  # a writer hears a rival's frames on its subject, never its own
                                   "tls_required": bool(info.get("tls_required"))}
        auth = parts if "@" in parts.netloc else (urllib.parse.urlsplit(self._auth_url) if self._auth_url else None)
        if auth is not None:
            user = urllib.parse.unquote(auth.username or "")
            if auth.password is not None:
                options["user"], options["pass"] = user, urllib.parse.unquote(auth.password)
            else:
                options["auth_token"] = user
        if self.options.get("user") is not None:
            options["user"], options["pass"] = self.options["user"], self.options.get("password") or ""
        if self.options.get("token"):
            options["auth_token"] = self.options["token"]
        nonce = info.get("nonce")
        creds, seed_file = self.options.get("user_credentials"), self.options.get("nkeys_seed")
        if nonce and (creds or seed_file):
            import nkeys  # nats-py[nkeys], the cluster extra

            if creds:
                jwt, seed = _read_creds(str(creds))
                options["jwt"] = jwt
            else:
                with open(str(seed_file), "rb") as f:
                    seed = bytearray(f.read().strip())
            pair = nkeys.from_seed(seed)
            try:
                options["sig"] = base64.b64encode(pair.sign(nonce.encode())).decode()
                if not creds:
                    options["nkey"] = pair.public_key.decode()
            finally:
                pair.wipe()
        return options

    def _note_info(self, info: dict[str, Any]) -> None:
        self.max_payload = int(info.get("max_payload") or self.max_payload)
        scheme = "tls" if self.options.get("tls") is not None else "nats"
        for address in info.get("connect_urls") or []:
            url = f"{scheme}://{address}"
            if url not in self._known and not any(address in known for known in self._known):
                self._known.append(url)

    # -- serving ----------------------------------------------------------------------------------

    def _serve_in_background(self) -> None:
        self._now_connected()
        self._runner = gevent.spawn(self._run)

    def _now_connected(self) -> None:
        self.connected = True
        for sid, (subject, _) in self._subscriptions.items():  # made while the connect's own SUBs were being sent
            if sid not in self._subscribed:
                self._write(b"SUB %b %d\r\n" % (subject.encode(), sid))

    def _run(self) -> None:
        """The connection's life: read until it is lost, then make it anew, for as long as it is not closed."""
        while not self._closed:
            reason = self._serve(self._sock)
            self.connected = False
            for helper in self._helpers:
                helper.kill(block=False)
            self._helpers = []
            self._sock.close()
            self._out.clear()
            waiters, self._pongs = self._pongs, deque()
            for waiter in waiters:
                if waiter is not None:
                    waiter.set_exception(NatsUnreachable(f"the connection to NATS was lost ({reason})"))
            if self._closed:
                return
            log.warning("NATS (hub): the connection was lost (%s); connecting again", reason)
            while not self._closed:
                try:
                    self._sock = self._connect_any(self._known)
                    break
                except NatsUnreachable as e:
                    log.warning("NATS (hub): cannot connect again (%s); trying in %g s", e, RECONNECT_WAIT_SECONDS)
                    gevent.sleep(RECONNECT_WAIT_SECONDS)
            if self._closed:
                return
            self.reconnects += 1
            self._now_connected()
            log.info("NATS (hub): connected again")

    def _serve(self, sock: Any) -> str:
        """Read and dispatch until the connection ends; why it ended."""
        self._helpers = [gevent.spawn(self._send_loop, sock), gevent.spawn(self._ping_loop)]
        if self._out:
            self._out_ready.set()
        pending, self._pending_read = self._pending_read, b""
        try:
            if pending:
                pending = self._dispatch(sock, pending)
            recv = sock.recv
            while True:
                chunk = recv(READ_BYTES)
                if not chunk:
                    return "closed by NATS"
                pending = self._dispatch(sock, pending + chunk if pending else chunk)
        except _Lost as e:
            return str(e)
        except (OSError, ValueError) as e:
            return f"{type(e).__name__}: {e}"

    def _dispatch(self, sock: Any, data: bytes) -> bytes:
        """Handle every whole operation in `data`; the incomplete rest."""
        pos, size = 0, len(data)
        subscriptions = self._subscriptions
        while pos < size:
            end = data.find(b"\r\n", pos)
            if end < 0:
                break
            op = data[pos:pos + 4]
            if op == b"MSG " or op == b"HMSG":
                fields = data[pos:end].split(b" ")
                if op == b"MSG ":
                    header_size, total = 0, int(fields[-1])
                else:
                    header_size, total = int(fields[-2]), int(fields[-1])
                body = end + 2
                if body + total + 2 > size:
                    break
                subject, sid = fields[1].decode(), int(fields[2])
                reply = fields[3].decode() if len(fields) == (5 if op == b"MSG " else 6) else ""
                headers = parse_headers(data[body:body + header_size]) if header_size else None
                payload = data[body + header_size:body + total]
                pos = body + total + 2
                subscription = subscriptions.get(sid)
                if subscription is not None:
                    try:
                        subscription[1](subject, reply, headers, payload)
                    except Exception:
                        log.exception("NATS (hub): a callback of %s failed", subscription[0])
                continue
            line = data[pos:end]
            pos = end + 2
            if line == b"PING":
                self._write(b"PONG\r\n")
            elif line == b"PONG":
                if self._pongs:
                    waiter = self._pongs.popleft()
                    if waiter is not None:
                        waiter.set(True)
            elif line.startswith(b"INFO "):
                self._note_info(json.loads(line[5:]))
            elif line.startswith(b"-ERR"):
                text = line[5:].decode(errors="replace").strip().strip("'")
                if "violation" in text.lower() and "permissions" in text.lower():
                    if text not in self._refused_once:  # NATS goes on; once per subject is enough to see
                        self._refused_once.add(text)
                        log.error("NATS (hub): %s", text)
                else:
                    raise _Lost(f"NATS said: {text}")
        return data[pos:] if pos < size else b""

    def _write(self, data: bytes) -> None:
        self._out.append(data)
        self._out_ready.set()

    def _send_loop(self, sock: Any) -> None:
        out, ready = self._out, self._out_ready
        while True:
            ready.wait()
            ready.clear()
            if out:
                data = b"".join(out)
                out.clear()
                try:
                    sock.sendall(data)
                except OSError:
                    sock.close()  # the reader sees it and connects again
                    return

    def _ping_loop(self) -> None:
        while True:
            gevent.sleep(PING_SECONDS)
            if len(self._pongs) >= MAX_PINGS_OUT:
                log.warning("NATS (hub): %d PINGs unanswered", len(self._pongs))
                self._sock.close()
                return
            self._pongs.append(None)
            self._write(b"PING\r\n")


class _Lost(Exception):
    """NATS ended the connection with an error."""


def _read_creds(path: str) -> tuple[str, bytearray]:
    """The user JWT and the nkey seed of a .creds file."""
    with open(path, "rb") as f:
        lines = [line.strip() for line in f.read().splitlines()]
    jwt = seed = None
    for i, line in enumerate(lines):
        if b"BEGIN NATS USER JWT" in line and i + 1 < len(lines):
            jwt = lines[i + 1].decode()
        if b"BEGIN USER NKEY SEED" in line and i + 1 < len(lines):
            seed = bytearray(lines[i + 1])
    if jwt is None or seed is None:
        raise NatsUnreachable(f"{path}: not a .creds file (no user JWT and nkey seed)")
    return jwt, seed

"""The web console on the metrics port: pages for people, and the JSON they are drawn from.

Beside the flow, like /metrics: `mqksd --metrics-port P` serves it from the broker's own gevent loop
(metrics.py hands it every path that is not /metrics or /healthz). The figures are the broker's own
answers, asked the way a client asks (`stats`, `queues [--detail]`, `schedules`, and `hello`'s
topology) over one loopback connection to the broker's port: one source of truth, merged over the
workers by the relay exactly as for `nc`, nothing counted twice. The pages are static files shipped in
the package (console/), drawn by a small script that polls the JSON every 2 s; names are put in with
textContent only, so a queue named `<script>` shows as text. With tokens, every page and JSON wants
one: a login form sets it in a cookie (HttpOnly, SameSite=Strict), or a script sends
`Authorization: Bearer {token}`. Read-only unless `--console-actions`: then deleting or purging a queue
and moving dead letters back take a POST with the token and a CSRF token (an HMAC of the session) in
`X-CSRF-Token`, from the console's own origin.
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import os
import secrets
import socket
import ssl
from collections.abc import Callable, Iterable
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import gevent
from gevent.lock import Semaphore

from .sessions import Tokens

log = logging.getLogger("mqks.console")

STATIC = Path(__file__).with_name("console")
FILES = {"/": ("index.html", "text/html; charset=utf-8"), "/console.js": ("console.js", "text/javascript"),
         "/console.css": ("console.css", "text/css")}
COOKIE = "mqks_console"
MAX_FORM_BYTES = 4096
ASK_TIMEOUT_SECONDS = 10.0
# the POSTs of --console-actions: the broker action each runs on `?name=` (requeue-dead: and its `&msg_id=`s),
# and the key of the JSON answer (the queue deleted, or how many messages went)
ACTIONS = {"/api/queue/delete": ("delete_queue", "deleted"), "/api/queue/purge": ("purge_queue", "purged"),
           "/api/queue/requeue-dead": ("requeue_dead", "requeued")}
# no framing by other sites, no scripts or styles but our own files, no guessing of content types
SECURITY_HEADERS = [("Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'; form-action 'self'"),
                    ("X-Content-Type-Options", "nosniff"), ("Referrer-Policy", "no-referrer"),
                    ("Cache-Control", "no-store")]
LOGIN_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>MQKS console: sign in</title>
<link rel="stylesheet" href="/console.css"></head><body class="login"><form method="post" action="/login">
<h1>MQKS</h1><p>{message}</p><label>Token <input type="password" name="token" autofocus autocomplete="off"></label>
<button type="submit">Sign in</button></form></body></html>"""

Answer = list[bytes]
StartResponse = Callable[..., Any]


class BrokerLine:
    """One loopback connection to the broker's own port, asked one request at a time (the console's only way in)."""

    def __init__(self, host: str, port: int, tls: bool) -> None:
        self.address = ("127.0.0.1" if host in ("", "0.0.0.0", "::") else host, port)
        self.tls = tls  # --port 0: our own TLS port, on loopback to ourselves (no certificate to check)
        self.token = b""  # the token the connection proved last: each request goes as the person who asks
        self.sock: socket.socket | None = None
        self.buffer = b""
        self.counter = 0
        self.lock = Semaphore()  # one request at a time: two pages polling at once share the connection

    def ask(self, action: str, args: str = "", retry: bool = True, token: str = "") -> list[bytes]:
        """The `ok` data of one request (the lines up to `--end` for queues, schedules); RuntimeError if refused.

        `token`: the one the person asking proved ("" without tokens); the request goes with its scope.
        `retry=False` for a request that must not run twice (requeue_dead --limit): a lost line is an error then.
        """
        with self.lock:
            try:
                return self._ask(action, args, token.encode())
            except OSError:  # a connection the broker closed (a restarted worker): made again once
                self.close()
                if not retry:
                    raise
            try:
                return self._ask(action, args, token.encode())
            except OSError:
                self.close()
                raise

    def _ask(self, action: str, args: str, token: bytes) -> list[bytes]:
        if self.sock is None:
            from gevent import socket as gsocket
            from gevent import ssl as gssl

            sock = gsocket.create_connection(self.address, timeout=ASK_TIMEOUT_SECONDS)
            if self.tls:
                context = ssl.create_default_context()
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
                sock = gssl.SSLSocket(sock=sock, _context=context)
            self.sock = sock
            self.token = b""
        if token != self.token:
            self._answer(b"console.auth", b"console.auth auth " + token + b"\n")
            self.token = token
        self.counter += 1
        rid = b"console.%d" % self.counter
        line = b" ".join(filter(None, (rid, action.encode(), args.encode()))) + b"\n"
        return self._answer(rid, line, many=action in ("queues", "schedules"))

    def _answer(self, rid: bytes, line: bytes, many: bool = False) -> list[bytes]:
        assert self.sock is not None
        self.sock.sendall(line)
        found: list[bytes] = []
        while True:
            while b"\n" not in self.buffer:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise ConnectionError("the broker closed the console's connection")
                self.buffer += chunk
            answer, _, self.buffer = self.buffer.partition(b"\n")
            got, _, rest = answer.partition(b" ")
            status, _, data = rest.partition(b" ")
            if got != rid:
                continue  # an answer to a request given up on
            if status != b"ok":
                raise RuntimeError(data.decode(errors="replace"))
            if not many:
                return [data]
            if data == b"--end":
                return found
            found.append(data)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = None
        self.buffer = b""
        self.token = b""


class Console:
    """The console's WSGI routes; `answer` returns None for a path that is not the console's."""

    def __init__(self, broker: BrokerLine, tokens: Tokens | None, actions: bool) -> None:
        self.broker = broker
        self.tokens = tokens
        self.actions = actions
        self.secret = secrets.token_bytes(32)  # signs CSRF tokens; a restart invalidates the open pages' ones

    def answer(self, environ: dict[str, Any], start_response: StartResponse) -> Answer | None:
        path = environ.get("PATH_INFO", "")
        method = environ.get("REQUEST_METHOD", "GET")
        if path in ("/console.js", "/console.css"):  # no figures in them: served to anyone
            return self._file(path, start_response)
        if path == "/login":
            return self._login(environ, method, start_response)
        if path == "/logout" and method == "POST":
            return _respond(start_response, "303 See Other", b"", extra=[("Location", "/login" if self.tokens else "/"),
                                                                         _cookie_header("", expire=True)])
        session = self._session(environ)
        if path == "/":
            if session is None:
                return _respond(start_response, "303 See Other", b"", extra=[("Location", "/login")])
            return self._file(path, start_response)
        if not path.startswith("/api/"):
            return None
        if session is None:
            return _json(start_response, {"error": "a token is required: sign in at /login, or send "
                                          "Authorization: Bearer {token}"}, "401 Unauthorized")
        if method == "POST":
            return self._act(environ, path, session, start_response)
        if method not in ("GET", "HEAD"):
            return _json(start_response, {"error": "GET or POST only"}, "405 Method Not Allowed")
        query = parse_qs(environ.get("QUERY_STRING", ""))
        try:
            body = self._read(path, query, session)
        except (RuntimeError, OSError) as e:
            log.warning("console: %s failed: %s", path, e)
            return _json(start_response, {"error": str(e)}, "502 Bad Gateway")
        if body is None:
            return _json(start_response, {"error": f"no such endpoint: {path}"}, "404 Not Found")
        return _json(start_response, body)

    def _read(self, path: str, query: dict[str, list[str]], session: str) -> Any:
        """The JSON of a GET; None for an unknown path."""
        if path == "/api/stats":
            return json.loads(self.broker.ask("stats", token=session)[0])
        if path == "/api/queues":
            return [json.loads(row) for row in self.broker.ask("queues", token=session)]
        if path == "/api/schedules":
            return [json.loads(row) for row in self.broker.ask("schedules", token=session)]
        if path == "/api/topology":  # `hello`'s workers, slot map and cluster, and this process's memory
            return {**json.loads(self.broker.ask("hello", token=session)[0]), "rss_bytes": _rss_bytes()}
        if path == "/api/queue":
            name = (query.get("name") or [""])[0]
            if not _is_name(name):
                raise RuntimeError(f"not a queue name: {name!r}")
            rows = [json.loads(row) for row in self.broker.ask("queues", f"--detail {name}", token=session)]
            dead = [json.loads(row) for row in self.broker.ask("queues", f"--detail {name}.dead", token=session)]
            return {"queue": rows[0] if rows else None, "dead_letters": dead[0] if dead else None}
        if path == "/api/session":  # the page shows the action buttons only where `actions` is true
            return {"auth": self.tokens is not None, "actions": self.actions and self._may_manage(session),
                    "csrf": self._csrf(session)}
        return None

    def _may_manage(self, session: str) -> bool:
        """True if the session's token may purge, delete and requeue (a scoped token needs `manage`); the broker
        checks it again on each action."""
        if self.tokens is None:
            return True
        found = self.tokens.find(session.encode())
        return found is not None and (found.scope is None or found.scope.manage)

    def _act(self, environ: dict[str, Any], path: str, session: str, start_response: StartResponse) -> Answer:
        """A POST that changes something: off unless --console-actions; the CSRF token and our own origin only."""
        if not self.actions:
            return _json(start_response, {"error": "the console is read-only: start mqksd with --console-actions "
                                          "to allow changes"}, "403 Forbidden")
        sent = environ.get("HTTP_X_CSRF_TOKEN", "")
        if not hmac.compare_digest(sent.encode(), self._csrf(session).encode()) or not _same_origin(environ):
            return _json(start_response, {"error": "missing or wrong CSRF token"}, "403 Forbidden")
        query = parse_qs(environ.get("QUERY_STRING", ""))
        name = (query.get("name") or [""])[0]
        msg_ids = query.get("msg_id", [])
        if path not in ACTIONS:
            return _json(start_response, {"error": f"no such action: {path}"}, "404 Not Found")
        if not _is_name(name) or not all(_is_name(msg_id) for msg_id in msg_ids):
            return _json(start_response, {"error": f"not a queue name or message id: {name!r} {msg_ids!r}"},
                         "400 Bad Request")
        action, key = ACTIONS[path]
        args = {"delete_queue": f"--confirm {name}", "requeue_dead": " ".join([name, *msg_ids])}.get(action, name)
        try:
            [answer] = self.broker.ask(action, args, retry=action != "requeue_dead", token=session)
        except (RuntimeError, OSError) as e:  # the token's scope refused it: the broker's own words
            status = "403 Forbidden" if "permission denied" in str(e) else "502 Bad Gateway"
            return _json(start_response, {"error": str(e).partition(" ")[2] if status[0] == "4" else str(e)}, status)
        log.info("console: %s %s%s", action, name, f" ({len(msg_ids)} ids)" if msg_ids else "")
        return _json(start_response, {key: name if action == "delete_queue" else int(answer)})

    def _session(self, environ: dict[str, Any]) -> str | None:
        """Who asks: "" without tokens, else the token they proved (cookie or bearer header); None: nobody."""
        if self.tokens is None:
            return ""
        bearer = environ.get("HTTP_AUTHORIZATION", "")
        token = bearer[7:].strip() if bearer.startswith("Bearer ") else _cookie(environ)
        return token if token and self.tokens.check(token.encode()) else None

    def _csrf(self, session: str) -> str:
        return hmac.new(self.secret, b"csrf:" + session.encode(), "sha256").hexdigest()

    def _login(self, environ: dict[str, Any], method: str, start_response: StartResponse) -> Answer:
        if self.tokens is None:
            return _respond(start_response, "303 See Other", b"", extra=[("Location", "/")])
        if method != "POST":
            return _page(start_response, LOGIN_PAGE.format(message="This broker wants a token."))
        try:
            size = min(int(environ.get("CONTENT_LENGTH") or 0), MAX_FORM_BYTES)
        except ValueError:
            size = 0
        form = parse_qs(environ["wsgi.input"].read(size).decode(errors="replace"))
        token = (form.get("token") or [""])[0].strip()
        address = environ.get("REMOTE_ADDR", "")
        throttle = self.tokens.throttle
        wait = throttle.wait_seconds(address)
        if wait:  # this address failed too often: as on the broker's port, its attempts wait their turn
            gevent.sleep(wait)
        if not token or any(char.isspace() for char in token) or not self.tokens.check(token.encode()):
            failures, _ = throttle.failed(address)
            log.warning("console: sign-in failed from %s (%d failures from it)", address, failures)
            return _page(start_response, LOGIN_PAGE.format(message="That token is not one of this broker's."),
                         "401 Unauthorized")
        throttle.succeeded(address)
        return _respond(start_response, "303 See Other", b"", extra=[("Location", "/"), _cookie_header(token)])

    def _file(self, path: str, start_response: StartResponse) -> Answer:
        name, content_type = FILES[path]
        return _respond(start_response, "200 OK", _static(name), content_type)


@functools.cache
def _static(name: str) -> bytes:
    """A page file, read once, on first request (a broker whose console nobody opens reads none)."""
    return (STATIC / name).read_bytes()


def _rss_bytes() -> int | None:
    """This process's resident memory, from /proc (None where there is none)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _is_name(name: str) -> bool:
    return bool(name) and not any(char.isspace() for char in name) and not name.startswith("--")


def _cookie(environ: dict[str, Any]) -> str | None:
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(environ.get("HTTP_COOKIE", ""))
    except Exception:  # a malformed Cookie header is no session, not an error page
        return None
    morsel = jar.get(COOKIE)
    return morsel.value if morsel is not None else None


def _cookie_header(token: str, expire: bool = False) -> tuple[str, str]:
    # HttpOnly: no script reads it; SameSite=Strict: no other site's page sends it
    age = "; Max-Age=0" if expire else ""
    return "Set-Cookie", f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict{age}"


def _same_origin(environ: dict[str, Any]) -> bool:
    """A browser's POST names where its page came from: it must be this console (a missing Origin is a script)."""
    origin = environ.get("HTTP_ORIGIN")
    return origin is None or origin.split("://", 1)[-1] == environ.get("HTTP_HOST", "")


def _json(start_response: StartResponse, body: Any, status: str = "200 OK") -> Answer:
    return _respond(start_response, status, json.dumps(body).encode(), "application/json")


def _page(start_response: StartResponse, html: str, status: str = "200 OK") -> Answer:
    return _respond(start_response, status, html.encode(), "text/html; charset=utf-8")


def _respond(start_response: StartResponse, status: str, body: bytes, content_type: str = "text/plain",
             extra: Iterable[tuple[str, str]] = ()) -> Answer:
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body))), *SECURITY_HEADERS,
                            *extra])
    return [body]

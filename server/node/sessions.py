"""Beside step 1 of the flow: what a connection must prove before it may speak, and how long it may keep quiet.

`Tokens` are the secrets of token auth (`--auth-token-file`, `MQKS_AUTH_TOKEN`): checked in
constant time, re-read on SIGHUP, never logged. `tls_server_context` builds the TLS 1.2+
context of `--tls-port`. `SilenceWatch` closes connections that said `hello --ttl=S` (or
got `--client-ttl`) and then sent nothing for 2xS: one periodic check on the process's
timer heap, never a timer per line; a connection only counts its reads.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import ssl
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("mqks.sessions")

AUTH_TOKEN_ENV = "MQKS_AUTH_TOKEN"
SILENCE_FACTOR = 2  # a TTL of S closes after 2xS without a byte: one lost ping is not a dead peer
MIN_CHECK_SECONDS = 0.05
CHECKS_PER_TTL = 4  # a silent peer is closed at most a quarter TTL late


class Tokens:
    """The accepted auth tokens: one per line of a file (re-read on `reload`), plus one from the environment."""

    __slots__ = ("path", "env_token", "tokens")

    def __init__(self, path: str | None, env_token: str | None) -> None:
        self.path = path
        self.env_token = env_token.strip().encode() if env_token and env_token.strip() else None
        self.tokens: list[bytes] = []
        self.tokens = self._read()  # a file that cannot be read stops the start (OSError, exit 1)
        if not self.tokens:
            raise ValueError(f"no token in {path}: token auth needs at least one (one per line)")

    def _read(self) -> list[bytes]:
        tokens = [] if self.env_token is None else [self.env_token]
        if self.path is not None:
            with open(self.path, "rb") as f:
                tokens += [line.strip() for line in f if line.strip() and not line.startswith(b"#")]
        return tokens

    def reload(self) -> None:
        """Re-read the file (SIGHUP); a file that cannot be read, or holds no token, keeps the old tokens."""
        try:
            tokens = self._read()
        except OSError as e:
            log.error("cannot re-read the token file, keeping the %d tokens in use: %s", len(self.tokens), e)
            return
        if not tokens:
            log.error("the token file %s holds no token now; keeping the %d tokens in use", self.path,
                      len(self.tokens))
            return
        self.tokens = tokens
        log.info("token file re-read: %d tokens", len(tokens))  # never the tokens themselves

    def check(self, token: bytes) -> bool:
        """True if `token` is one of ours; compares with every token in constant time, so timing tells nothing."""
        found = False
        for known in self.tokens:
            found |= hmac.compare_digest(known, token)
        return found and bool(token)


def is_loopback_host(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def eval_lock_reason(host: str, auth_required: bool) -> str | None:
    """Why `_eval` stays off whatever `--eval` says, or None.

    With token auth on a broker reachable beyond this machine, every token holder would get
    remote code execution; the loopback-peer check alone is no guard there.
    """
    if auth_required and not is_loopback_host(host):
        return (f"_eval is refused: token auth is on and mqksd listens beyond loopback (--host {host}), so it would "
                "hand remote code execution to every token holder; run with --host 127.0.0.1 to use it")
    return None


def tls_server_context(cert_file: str, key_file: str, ca_file: str | None) -> ssl.SSLContext:
    """A TLS 1.2+ server context; with `ca_file`, clients must present a certificate signed by it."""
    from gevent import ssl as gevent_ssl  # its context hands out cooperative sockets

    context = gevent_ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    if ca_file is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(ca_file)
    return context


def check_seconds(ttl_seconds: float) -> float:
    """How often to check connections with this TTL."""
    return max(MIN_CHECK_SECONDS, ttl_seconds / CHECKS_PER_TTL)


class Quiet(Protocol):
    """What the watch needs of a connection."""

    peer: str
    closed: bool
    reads: int
    ttl_seconds: float | None

    def close(self) -> None: ...


class SilenceWatch:
    """One periodic check over the connections with a TTL: a peer silent for 2xTTL is closed.

    A connection counts its reads (one increment per recv, not per line); a check that sees
    the count unchanged since the last one knows the peer has been quiet since then.
    """

    __slots__ = ("call_later", "clock", "watched", "cancel", "armed_seconds")

    def __init__(self, call_later: Callable[[float, Callable[[], None]], Callable[[], None]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.call_later = call_later
        self.clock = clock
        self.watched: dict[Quiet, list] = {}  # connection -> [reads at the last check, quiet since]
        self.cancel: Callable[[], None] | None = None
        self.armed_seconds = 0.0  # the interval the next check was armed with

    def watch(self, conn: Quiet) -> None:
        """Start (or restart, after a new TTL) watching `conn`."""
        self.watched[conn] = [conn.reads, self.clock()]
        if self.cancel is None or check_seconds(conn.ttl_seconds or 0.0) < self.armed_seconds:
            # a shorter TTL than any so far needs an earlier check; otherwise the armed one comes soon enough
            if self.cancel is not None:
                self.cancel()
            self._arm()

    def forget(self, conn: Quiet) -> None:
        self.watched.pop(conn, None)

    def _arm(self) -> None:
        ttls = [conn.ttl_seconds for conn in self.watched if conn.ttl_seconds]
        self.cancel = None
        if ttls:
            self.armed_seconds = check_seconds(min(ttls))
            self.cancel = self.call_later(self.armed_seconds, self.check)

    def check(self) -> None:
        """Close every watched connection silent for 2xTTL; their consumers' messages go back at once."""
        self.cancel = None
        now = self.clock()
        for conn, seen in list(self.watched.items()):
            ttl = conn.ttl_seconds
            if conn.closed or not ttl:
                del self.watched[conn]
            elif conn.reads != seen[0]:
                seen[0], seen[1] = conn.reads, now
            elif now - seen[1] >= SILENCE_FACTOR * ttl:
                log.warning("closing %s: nothing received for %.1f s (ttl %g s)", conn.peer, now - seen[1], ttl)
                del self.watched[conn]
                conn.close()
        self._arm()

"""Beside step 1 of the flow: what a connection must prove before it may speak, and how long it may keep quiet.

`Tokens` are the secrets of token auth (`--auth-token-file`, `MQKS_AUTH_TOKEN`): checked in
constant time, re-read on SIGHUP, never logged. `tls_server_context` builds the TLS 1.2+
context of `--tls-port`. `SilenceWatch` closes connections that said `hello --ttl=S` (or
got `--client-ttl`) and then sent nothing for 2xS: one periodic check on the process's
timer heap, never a timer per line; a connection only counts its reads.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
import ssl
import time
import tomllib
from collections.abc import Callable
from typing import Any, Protocol

from ..dispatch.scopes import Scope

log = logging.getLogger("mqks.sessions")

AUTH_TOKEN_ENV = "MQKS_AUTH_TOKEN"
FREE_FAILURES = 3  # failed auths a peer address gets before each next one waits
FIRST_DELAY_SECONDS = 0.5  # then the wait doubles with each failure, up to
MAX_DELAY_SECONDS = 10.0
FORGET_SECONDS = 600.0  # an address that failed nothing for this long starts afresh
MAX_ADDRESSES = 10_000  # addresses remembered at most: a scan from many addresses must not grow it forever
SILENCE_FACTOR = 2  # a TTL of S closes after 2xS without a byte: one lost ping is not a dead peer
MIN_CHECK_SECONDS = 0.05
CHECKS_PER_TTL = 4  # a silent peer is closed at most a quarter TTL late


class Token:
    """One accepted secret: its name (what logs, errors and stats show) and its scope (None: full access)."""

    __slots__ = ("name", "secret", "digest", "scope")

    def __init__(self, name: str, secret: bytes | None, digest: bytes | None = None,
                 scope: Scope | None = None) -> None:
        self.name = name
        self.secret = secret
        self.digest = digest  # sha256 hex of the secret, when the file holds no secret (secret_sha256)
        self.scope = scope

    def matches(self, token: bytes) -> bool:
        """In constant time for a given length: timing tells nothing of how much of a secret was right."""
        if self.secret is not None:
            return hmac.compare_digest(self.secret, token)
        assert self.digest is not None
        return hmac.compare_digest(self.digest, hashlib.sha256(token).hexdigest().encode())


class Tokens:
    """The accepted auth tokens, re-read on `reload`: one per line of a file (full access), or the tables of a
    TOML file (scoped tokens, and the cluster's link secret: a file named *.toml, or any file that parses as TOML
    with a [[token]] or [cluster] table); plus one from the environment."""

    __slots__ = ("path", "env_token", "entries", "cluster_secret", "throttle")

    def __init__(self, path: str | None, env_token: str | None) -> None:
        self.path = path
        self.throttle = AuthThrottle()
        self.env_token = env_token.strip().encode() if env_token and env_token.strip() else None
        self.entries: list[Token] = []
        self.cluster_secret: bytes | None = None
        # a file that cannot be read stops the start (OSError), and so does one that is wrong (ValueError)
        self.entries, self.cluster_secret = self._read()
        if not self.entries:
            raise ValueError(f"no token in {path}: token auth needs at least one")

    @property
    def tokens(self) -> list[bytes]:
        """The secrets the file holds in plain (a secret_sha256 token has none to give)."""
        return [entry.secret for entry in self.entries if entry.secret is not None]

    @property
    def scoped(self) -> int:
        return sum(entry.scope is not None for entry in self.entries)

    def describe(self) -> str:
        """How many tokens are accepted and how many of them are scoped: the start-up and the reload lines say it."""
        count = len(self.entries)
        return f"{count} token{'' if count == 1 else 's'} ({self.scoped} scoped)"

    def _read(self) -> tuple[list[Token], bytes | None]:
        """The file's format is decided by its content, never by its name alone: a scoped file read one token per
        line would make each of its lines (`[[token]]` among them) a full-access token."""
        entries = [] if self.env_token is None else [Token("env", self.env_token)]
        cluster_secret = None
        if self.path is not None:
            with open(self.path, "rb") as f:
                content = f.read()
            try:
                document = tomllib.loads(content.decode())
                why_not = "it parses as TOML, with no [[token]] and no [cluster] table"
            except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
                if self.path.endswith(".toml"):
                    raise ValueError(f"{self.path}: not TOML: {e}") from None
                document, why_not = {}, "not UTF-8" if isinstance(e, UnicodeDecodeError) else _where(e)
            # not any TOML: a one-per-line file could parse as one (a token `key=1`), whose error would quote it
            if self.path.endswith(".toml") or "token" in document or "cluster" in document:
                tables, cluster_secret = token_tables(document, self.path)
                entries += tables
            else:
                entries += token_lines(content, self.path, why_not)
        return entries, cluster_secret

    def reload(self) -> None:
        """Re-read the file (SIGHUP); a file that cannot be read, is wrong, or holds no token keeps the old tokens.
        Connections keep the scope they authenticated with until they reconnect."""
        try:
            entries, cluster_secret = self._read()
        except (OSError, ValueError) as e:
            log.error("cannot re-read the token file, keeping the %d tokens in use: %s", len(self.entries), e)
            return
        if not entries:
            log.error("the token file %s holds no token now; keeping the %d tokens in use", self.path,
                      len(self.entries))
            return
        self.entries, self.cluster_secret = entries, cluster_secret
        log.info("token file re-read: %s", self.describe())  # never a secret

    def find(self, token: bytes) -> Token | None:
        """The entry `token` is the secret of, or None; every entry is compared, so timing tells nothing."""
        found = None
        for entry in self.entries:
            if entry.matches(token) and found is None:
                found = entry
        return found if token else None

    def check(self, token: bytes) -> bool:
        """True if `token` is one of ours."""
        return self.find(token) is not None

    def check_link(self, secret: bytes) -> bool:
        """True if another node's link may come in with `secret`: the cluster's secret when the file has one (a
        user's token then opens no link), else a full-access token."""
        if self.cluster_secret is not None:
            return bool(secret) and hmac.compare_digest(self.cluster_secret, secret)
        found = self.find(secret)
        return found is not None and found.scope is None


class AuthThrottle:
    """Failed auths slow their peer address down: after FREE_FAILURES, each attempt from it waits for a delay that
    doubles with each failure (one queue per address: parallel connections from it wait their turns)."""

    __slots__ = ("failures", "clock")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.failures: dict[str, tuple[int, float]] = {}  # address -> (failures, when its next attempt may run)
        self.clock = clock

    def wait_seconds(self, address: str) -> float:
        """How long the next attempt from `address` waits before it is checked (0: at once)."""
        count, allowed_at = self.failures.get(address, (0, 0.0))
        return max(0.0, allowed_at - self.clock()) if count > FREE_FAILURES else 0.0

    def failed(self, address: str) -> tuple[int, float]:
        """Count a failure; (the address's failures, the wait its next attempt gets)."""
        now = self.clock()
        count, allowed_at = self.failures.pop(address, (0, 0.0))
        if count and now - allowed_at > FORGET_SECONDS:
            count = 0
        count += 1
        delay = (min(MAX_DELAY_SECONDS, FIRST_DELAY_SECONDS * 2 ** (count - FREE_FAILURES - 1))
                 if count > FREE_FAILURES else 0.0)
        if len(self.failures) >= MAX_ADDRESSES:
            del self.failures[next(iter(self.failures))]  # the address that failed longest ago
        self.failures[address] = (count, max(now, allowed_at) + delay)
        return count, delay

    def succeeded(self, address: str) -> None:
        self.failures.pop(address, None)


TOKEN_KEYS = {"name", "secret", "secret_sha256", "publish", "consume", "manage"}


def token_lines(content: bytes, path: str, why_not: str) -> list[Token]:
    """The full-access tokens of a one-per-line file; ValueError names the first line that looks like TOML (a
    `[table]`, a `key = value`, a quote) by its number, never its content, which may be a secret. `why_not`
    says why the file is not read as TOML."""
    entries = []
    for number, line in enumerate(content.split(b"\n"), 1):
        token = line.strip()
        if not token or line.startswith(b"#"):
            continue
        # `=` only at the end is base64's padding (`openssl rand -base64 16`), never TOML: a key wants a value
        if token[:1] == b"[" or b"=" in token.rstrip(b"=") or b'"' in token or b"'" in token:
            raise ValueError(f"{path}: line {number} looks like TOML ([, = or a quote), but the file is no TOML "
                             f"token file ({why_not}); read one token per line, that line would be a full-access "
                             "token")
        entries.append(Token(f"line {number}", token))
    return entries


def _where(error: tomllib.TOMLDecodeError) -> str:
    """Where TOML's parser stopped, without its words: they may quote the file."""
    found = re.search(r"\((at [^()]*)\)$", str(error))
    return f"TOML stops {found.group(1) if found else 'somewhere'}"


def token_tables(document: dict[str, Any], path: str) -> tuple[list[Token], bytes | None]:
    """The `[[token]]` tables of a TOML token file, and its `[cluster] secret`; ValueError names what is wrong."""
    unknown = set(document) - {"token", "cluster"}
    if unknown:
        raise ValueError(f"{path}: unknown table {sorted(unknown)[0]!r} (expected [[token]] and [cluster])")
    entries = []
    names: set[str] = set()
    for number, table in enumerate(document.get("token", []), 1):
        where = f"{path}: token {number}"
        if not isinstance(table, dict):
            raise ValueError(f"{where}: expected a [[token]] table")
        unknown = set(table) - TOKEN_KEYS
        if unknown:
            raise ValueError(f"{where}: unknown key {sorted(unknown)[0]!r} (expected {', '.join(sorted(TOKEN_KEYS))})")
        name = table.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where}: a name is required (what logs and errors show instead of the secret)")
        if name in names:
            raise ValueError(f"{where}: the name {name!r} is given twice")
        names.add(name)
        where = f"{path}: token {name!r}"
        secret, digest = table.get("secret"), table.get("secret_sha256")
        if (secret is None) == (digest is None):
            raise ValueError(f"{where}: give one of secret and secret_sha256")
        if secret is not None and (not isinstance(secret, str) or not secret or any(c.isspace() for c in secret)):
            raise ValueError(f"{where}: the secret must be a string with no spaces")
        if digest is not None and not (isinstance(digest, str) and re.fullmatch(r"[0-9a-fA-F]{64}", digest)):
            raise ValueError(f"{where}: secret_sha256 must be 64 hex digits (sha256sum of the secret)")
        publish, consume, manage = table.get("publish", []), table.get("consume", []), table.get("manage", False)
        for key, patterns in (("publish", publish), ("consume", consume)):
            if not isinstance(patterns, list) or not all(isinstance(p, str) and p and " " not in p for p in patterns):
                raise ValueError(f"{where}: {key} must be a list of names or patterns")
        if not isinstance(manage, bool):
            raise ValueError(f"{where}: manage must be true or false")
        full = "*" in publish and "*" in consume and manage
        scope = None if full else Scope(name, publish, consume, manage)
        entries.append(Token(name, secret.encode() if secret is not None else None,
                             digest.lower().encode() if digest is not None else None, scope))
    cluster = document.get("cluster", {})
    if not isinstance(cluster, dict) or set(cluster) - {"secret"}:
        raise ValueError(f"{path}: [cluster] takes one key, secret")
    cluster_secret = cluster.get("secret")
    if cluster_secret is not None and (not isinstance(cluster_secret, str) or len(cluster_secret) < 16
                                       or any(c.isspace() for c in cluster_secret)):
        raise ValueError(f"{path}: [cluster] secret must be at least 16 characters, no spaces")
    return entries, cluster_secret.encode() if cluster_secret is not None else None


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


def link_tls_contexts(cert_file: str, key_file: str, ca_file: str | None) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A cluster node's TLS for its links to other nodes: (the context its link port accepts with, the one it dials
    with). It presents its certificate both ways; with `ca_file` it verifies the other node's certificate against
    that CA both ways (mutual TLS), else a dialled node's against the system's CAs. The advertised host is checked
    against the certificate, as for any TLS client."""
    from gevent import ssl as gevent_ssl

    server = tls_server_context(cert_file, key_file, ca_file)
    client = gevent_ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.minimum_version = ssl.TLSVersion.TLSv1_2
    client.load_cert_chain(cert_file, key_file)
    if ca_file is not None:
        client.load_verify_locations(ca_file)
    else:
        client.load_default_certs()
    return server, client


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

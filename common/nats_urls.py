"""NATS URLs as `--log` takes them and as a log line, an error or a page may show them."""

from __future__ import annotations

import logging
import os
import ssl
import urllib.parse
from typing import Any


def log_urls(text: str) -> list[str]:
    """`nats://a:4222,b:4223` (or hosts without a scheme) as nats-py's server list."""
    urls = [url.strip() for url in text.split(",") if url.strip()]
    return [url if "://" in url else f"nats://{url}" for url in urls]


def shown(servers: list[str]) -> str:
    """NATS URLs as a log line or an error may show them: a password or a token in one is never shown
    (`nats://mqks:***@host:4222`; a user part alone is a token to NATS: `nats://***@host:4222`)."""
    return ",".join(_shown_url(url) for url in servers)


def _shown_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    user_info, _, host = parts.netloc.rpartition("@")
    user, colon, _ = user_info.partition(":")
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}" if colon else f"***@{host}"))


NATS_USER_ENV, NATS_PASSWORD_ENV, NATS_TOKEN_ENV = "MQKS_NATS_USER", "MQKS_NATS_PASSWORD", "MQKS_NATS_TOKEN"


class NatsAccess:
    """How this side proves itself to NATS, beside the URLs: TLS (a CA, a client certificate for mutual TLS), a
    `.creds` file (a JWT and its nkey) or an nkey seed file, and a user and password or a token from the environment
    (MQKS_NATS_USER, MQKS_NATS_PASSWORD, MQKS_NATS_TOKEN), which `ps` does not show, as well as in the URL."""

    __slots__ = ("ca", "cert", "key", "creds", "nkey")

    def __init__(self, ca: str | None = None, cert: str | None = None, key: str | None = None,
                 creds: str | None = None, nkey: str | None = None) -> None:
        self.ca, self.cert, self.key, self.creds, self.nkey = ca, cert, key, creds, nkey

    def files(self) -> list[tuple[str, str]]:
        """(flag, path) of every file given."""
        return [(f"--log-{name}", path) for name, path in (("ca", self.ca), ("cert", self.cert), ("key", self.key),
                                                          ("creds", self.creds), ("nkey", self.nkey)) if path]

    def problem(self) -> str | None:
        """Why these files cannot be used (one line naming the flag and the file), or None."""
        if (self.cert is None) != (self.key is None):
            return "--log-cert and --log-key go together (a client certificate and its key)"
        if self.creds and self.nkey:
            return "--log-creds and --log-nkey are two ways to prove the same thing: give one"
        for flag, path in self.files():
            try:
                with open(path, "rb"):
                    pass
            except OSError as e:
                return f"{flag} {path}: cannot read it: {e.strerror}"
        return None

    def connect_options(self, servers: list[str]) -> dict[str, Any]:
        """nats-py's connect() arguments for these files and the environment's credentials."""
        options: dict[str, Any] = {}
        if self.ca or self.cert or any(url.startswith("tls://") for url in servers):
            context = ssl.create_default_context(cafile=self.ca)  # without --log-ca: the system's CAs
            if self.cert:
                context.load_cert_chain(self.cert, self.key)
            options["tls"] = context
        if self.creds:
            options["user_credentials"] = self.creds
        if self.nkey:
            options["nkeys_seed"] = self.nkey
        user, token = os.environ.get(NATS_USER_ENV), os.environ.get(NATS_TOKEN_ENV)
        if user:
            options["user"], options["password"] = user, os.environ.get(NATS_PASSWORD_ENV, "")
        if token:
            options["token"] = token
        return options


def nats_access(settings: Any) -> NatsAccess:
    """The NatsAccess of mqksd's Config or of `mqks cluster`'s arguments (their log_ca, log_cert, ... fields)."""
    return NatsAccess(settings.log_ca, settings.log_cert, settings.log_key, settings.log_creds, settings.log_nkey)


class _TlsEofNoise(logging.Filter):
    """asyncio warns "returning true from eof_received() has no effect when using ssl" at each TLS connection
    nats-py makes: a line for nobody."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("returning true from eof_received()")


def quiet_tls_noise() -> None:
    """Drop asyncio's TLS warning that nats-py's connections cause (once per process is enough)."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _TlsEofNoise) for f in logger.filters):
        logger.addFilter(_TlsEofNoise())

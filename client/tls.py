"""Client-side TLS and token settings shared by `Client`, the `mqks` CLI, stats.py and the Spark data source.

Plain `ssl`, no gevent: Spark's Python workers import this. A context verifies the broker's
certificate (the system's CAs, or `ca_file` for a private or self-signed one) and its host
name, and speaks TLS 1.2 or newer, as the broker does.
"""

from __future__ import annotations

import os
import ssl

AUTH_TOKEN_ENV = "MQKS_AUTH_TOKEN"  # the broker reads the same name


def client_context(ca_file: str | None = None, cert_file: str | None = None,
                   key_file: str | None = None) -> ssl.SSLContext:
    """A context that checks the broker's certificate against `ca_file` (or the system's CAs).

    `cert_file` (and `key_file`, unless the key is in it) is this client's own certificate, for
    a broker started with `--tls-ca`.
    """
    context = ssl.create_default_context(cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file:
        context.load_cert_chain(cert_file, key_file)
    return context


def tls_setting(tls: bool | ssl.SSLContext | None, ca_file: str | None = None) -> ssl.SSLContext | None:
    """`Client(tls=...)` as a context: True for the system's CAs (or `ca_file`), a context as is, else None."""
    if isinstance(tls, ssl.SSLContext):
        return tls
    if tls or ca_file:
        return client_context(ca_file)
    return None


def token_setting(token: str | None) -> bytes | None:
    """The token to send: the one given, else MQKS_AUTH_TOKEN, else None; ValueError if it cannot be one token."""
    if token is None:
        token = os.environ.get(AUTH_TOKEN_ENV) or None
    if token is None:
        return None
    if not token or any(char.isspace() for char in token):
        raise ValueError("an auth token must be a non-empty string without whitespace")
    return token.encode()

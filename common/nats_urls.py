"""NATS URLs as `--log` takes them and as a log line, an error or a page may show them."""

from __future__ import annotations

import urllib.parse


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

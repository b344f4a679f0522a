"""The `mqks` format's options: every one checked on the driver before a query starts.

A bad value names its option and the accepted range; an option nobody reads (a typo such
as `maxRecordPerBatch`) is refused with the list of known ones, since Spark would pass it
on silently. Spark hands options over lower-cased, so names compare case-insensitively.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from mqks.client.placement import parse_seeds
from mqks.client.wire import encode_token
from mqks.spark.line_client import Security

# options Spark itself adds to a data source's options, never ours to refuse
SPARK_OWN_OPTIONS = frozenset({"path", "checkpointlocation", "queryname"})


def check_known(options: Mapping[str, str], known: tuple[str, ...], what: str) -> None:
    """Refuse any option not in `known` (case-insensitive), listing the known ones."""
    wanted = {name.lower() for name in known}
    unknown = sorted(name for name in options if name.lower() not in wanted and name.lower() not in SPARK_OWN_OPTIONS)
    if unknown:
        raise ValueError(f"mqks {what}: unknown option(s) {', '.join(unknown)}; known options: {', '.join(known)}")


def lowered(options: Mapping[str, str]) -> dict[str, str]:
    """The options with lower-case names, as Spark hands them over (a plain dict from a test too)."""
    return {str(name).lower(): value for name, value in options.items()}


def text_option(options: Mapping[str, str], name: str, default: str | None = None) -> str | None:
    """`name`'s value, stripped; `default` when absent or blank. `options` must come from `lowered`."""
    value = options.get(name.lower())
    return default if value is None or str(value).strip() == "" else str(value).strip()


def int_option(options: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    """An integer option in [low, high]; the error names the option and the range."""
    raw = text_option(options, name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"mqks option {name}={raw!r} is not a whole number; expected {low}..{high}") from None
    if not low <= value <= high:
        raise ValueError(f"mqks option {name}={value} is out of range; expected {low}..{high}")
    return value


def float_option(options: Mapping[str, str], name: str, default: float, low: float, high: float) -> float:
    raw = text_option(options, name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"mqks option {name}={raw!r} is not a number; expected {low:g}..{high:g}") from None
    if not low <= value <= high:  # also refuses nan
        raise ValueError(f"mqks option {name}={value:g} is out of range; expected {low:g}..{high:g}")
    return value


def host_option(options: Mapping[str, str]) -> str:
    host = text_option(options, "host", "127.0.0.1")
    assert host is not None
    if any(c.isspace() for c in host):
        raise ValueError(f"mqks option host={host!r} holds a space")
    return host


def port_option(options: Mapping[str, str]) -> int:
    return int_option(options, "port", 25000, 1, 65535)


def seeds_option(options: Mapping[str, str]) -> tuple[tuple[str, int], ...]:
    """`seeds=host:port,host:port`: more nodes of a cluster (or brokers behind one name) to connect to when
    `host`:`port` cannot be reached; each is tried in turn."""
    text = text_option(options, "seeds")
    return tuple(parse_seeds(text, f"mqks option seeds={text!r}"))


def token_option(options: Mapping[str, str], name: str) -> str | None:
    value = text_option(options, name)
    if value is not None:
        encode_token(value, f"mqks option {name}", dashes_ok=False)
    return value


def security_option(options: Mapping[str, str]) -> Security:
    """`tls`, `tlsCa` and `token` (default: the driver's MQKS_AUTH_TOKEN), checked as the line client wants them."""
    given = {name: value for name in ("tls", "tlsCa", "token") if (value := text_option(options, name)) is not None}
    return Security.parse(given, os.environ)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the broker is, how to talk to it, and how long to keep trying it when it is away."""

    host: str
    port: int
    reconnect_seconds: float
    security: Security = field(default_factory=Security)
    seeds: tuple[tuple[str, int], ...] = ()  # tried in turn after host:port

    def addresses(self) -> list[tuple[str, int]]:
        return [(self.host, self.port), *(seed for seed in self.seeds if seed != (self.host, self.port))]

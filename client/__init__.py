"""mqks.client: the Python client of MQKS, plus the `mqks` command and the stats view.

`from mqks.client import Client, Message, MqksError`. Importing it never monkey-patches:
the client uses gevent's own sockets, so it works in any gevent program. The names load on
first use, so `mqks.client.wire` (pure line helpers) can be imported without gevent, as the
Spark data source does.
"""

from typing import Any

__all__ = ["Client", "Message", "MqksError", "MqksConnectionError", "MqksTimeoutError"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

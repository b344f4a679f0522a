"""mqks.client: the Python client of MQKS, plus the `mqks` command and the stats view.

`from mqks.client import Client, ClientSettings, Message, MqksError`. Importing it never monkey-patches:
the client uses gevent's own sockets, so it works in any gevent program. The names load on
first use, so `mqks.client.wire` (pure line helpers) and `mqks.client.errors` can be imported
without gevent, as the Spark data source does. A library's convention for its log: the `mqks.client`
logger has a NullHandler, so an application that configures no logging hears nothing from it (Python's
last-resort handler would print every reconnect's WARNING on stderr); one that does gets every record.
"""

import logging
from importlib import import_module
from typing import Any

logging.getLogger("mqks.client").addHandler(logging.NullHandler())

_MODULE_BY_NAME = {
    "Client": "client",
    "ClientSettings": "linking",
    "Message": "consumers",
    "MqksError": "errors",
    "MqksConnectionError": "errors",
    "MqksProtocolError": "errors",
    "MqksTimeoutError": "errors",
}
__all__ = list(_MODULE_BY_NAME)


def __getattr__(name: str) -> Any:
    module = _MODULE_BY_NAME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)

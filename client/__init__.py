"""mqks.client: the Python client of MQKS, plus the `mqks` command and the stats view.

`from mqks.client import Client, Message, MqksError`. Importing it never monkey-patches:
the client uses gevent's own sockets, so it works in any gevent program and in Spark workers.
"""

from .client import Client, Message, MqksConnectionError, MqksError, MqksTimeoutError

__all__ = ["Client", "Message", "MqksError", "MqksConnectionError", "MqksTimeoutError"]

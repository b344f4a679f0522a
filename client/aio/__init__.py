"""mqks.aio: the asyncio client of MQKS, for services on asyncio (FastAPI, Starlette, aiohttp, `asyncio.run`).

    from mqks import aio

    async with aio.Client("127.0.0.1", 25000) as client:
        consumer = await client.consume("greetings", ["hello"], manual_ack=True)
        await client.publish("hello", "world", confirm=True)
        async for message in consumer:
            await message.ack()

The same features as the gevent client (`mqks.client`), built on the same wire code (`mqks.client.wire`,
`answers`, `consuming`, `placement`, `errors`, `tls`): only the transport differs. Importing it never
imports gevent. The errors are the gevent client's, so one `except MqksError` serves both. Its logger
`mqks.aio` has a NullHandler, as `mqks.client`'s: silent unless the application configures logging.
"""

import logging

from mqks.client.errors import MqksConnectionError, MqksError, MqksProtocolError, MqksTimeoutError
from mqks.client.linking import ClientSettings
from mqks.client.tls import client_context

from .client import Client
from .consumers import Consumer, Message

logging.getLogger("mqks.aio").addHandler(logging.NullHandler())

__all__ = ["Client", "ClientSettings", "Consumer", "Message", "MqksConnectionError", "MqksError", "MqksProtocolError",
           "MqksTimeoutError", "client_context"]

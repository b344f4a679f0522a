"""What the asyncio client's tests share (test_aio.py, and test_cluster.py's aio scenario): a checked loop, a
bounded poll, a bounded take."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from conftest import BrokerProcess
from waiting import WAIT_SECONDS

from mqks import aio

T = TypeVar("T")


def run(main: Callable[[], Awaitable[T]], loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> T:
    """`main()` on a fresh loop; fails on a task left pending or an error the loop reported."""
    reported: list[dict[str, Any]] = []

    async def checked() -> T:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: reported.append(context))
        result = await main()
        left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        assert not left, f"tasks left pending: {left}"
        return result

    if loop_factory is None:
        result = asyncio.run(checked())
    else:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            result = runner.run(checked())
    gc.collect()
    assert not reported, f"the loop reported: {reported}"
    return result


def client_of(server: BrokerProcess | int, **options: Any) -> aio.Client:
    """An unconnected client with the tests' timeouts: frequent pings, a generous pong timeout."""
    settings: dict[str, Any] = {"ping_seconds": 0.5, "ping_timeout_seconds": 5.0, "timeout_seconds": 5.0,
                                "reconnect_max_seconds": 0.2}
    settings.update(options)
    port = server if isinstance(server, int) else server.port
    return aio.Client("127.0.0.1", port, **settings)


async def take(consumer: aio.Consumer, count: int) -> list[aio.Message]:
    """The next `count` messages of `consumer`, or fail after the tests' wait."""
    messages = []
    async with asyncio.timeout(WAIT_SECONDS):
        async for message in consumer:
            messages.append(message)
            if len(messages) == count:
                break
    return messages

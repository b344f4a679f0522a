"""How a test waits. Every wait in the suite goes through this module; a test that sleeps to wait is a defect.

- Wait on the thing itself: a socket read with a timeout (`Wire.expect`), a client call that blocks until its
  answer, an `Inbox.wait(n)`. When there is nothing to block on, poll a condition with `wait_for` (or `until` on
  an asyncio loop), which returns what the condition returned and fails naming what it waited for.
- A timeout is a bound for a loaded machine, not a claim about speed: make it generous (the default is
  WAIT_SECONDS; a failover waits for its lease plus margin), and never assert how long something took.
- Never poll for a window the code under test opens for a moment (a process between two states, a queue
  between two deliveries): hold the window open instead (SIGSTOP the process, stop the consumer), then look.
- Read a page or an answer only after waiting for it to be there; never read, then hope it was complete.
- A sleep is right only when time must pass for the scenario itself (a delay must expire, a TTL must be
  outlived, a publisher paces its sends), never to let something else finish: say which in a comment.

The polls are cooperative (gevent.sleep): a test's gevent clients keep running while it waits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import gevent

T = TypeVar("T")

WAIT_SECONDS = 10.0
POLL_SECONDS = 0.01


def wait_for(condition: Callable[[], T], what: str, timeout: float = WAIT_SECONDS, interval: float = 0.05) -> T:
    """Poll `condition()` until it returns something truthy and return that; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        gevent.sleep(interval)


def wait_until(predicate: Callable[[], object], what: str, timeout: float = WAIT_SECONDS,
               interval: float = POLL_SECONDS) -> None:
    """`wait_for` polling more often, for code beside the Python client whose greenlets must run meanwhile."""
    wait_for(predicate, what, timeout, interval)


async def until(predicate: Callable[[], object], what: str, timeout: float = WAIT_SECONDS) -> None:
    """`wait_for` on an asyncio loop: poll `predicate` until true, or fail after `timeout`."""
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(POLL_SECONDS)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None


async def until_awaited(check: Callable[[], Awaitable[object]], what: str, timeout: float = WAIT_SECONDS,
                        interval: float = 0.2) -> None:
    """`until` for a check that must be awaited (an asyncio client's question to a server)."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(interval)

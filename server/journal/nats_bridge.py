"""The hop between the broker's gevent hub and nats-py, which is asyncio only: its event loop runs in an OS
thread of its own, and frames cross once per group commit, never once per message (the cluster extra).

Hub -> asyncio: `publish` appends a batch of frames to a deque and calls `call_soon_threadsafe` once; one
pump coroutine publishes them in order, each with a reply subject of its own on one inbox subscription,
without waiting for acks (many in flight). The PubAcks are parsed here: nats-py's `publish_async` never
resolves when the server answers an error, and leaks its slot. asyncio -> hub: results go to a deque and a
ref'd libev async watcher (`ev_async_send`, safe from any thread; several sends coalesce) wakes the hub,
which hands them to `on_results` in one call. `run` runs a coroutine (stream management, reads) and waits
for it in the calling greenlet only. Nothing is monkey-patched. shared/notes/replication.md has the
measurements and the traps this follows.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import gevent
from gevent.event import AsyncResult, Event

log = logging.getLogger("mqks.journal")

PING_SECONDS = 1  # nats-py's default (120 s, 2 missed) notices a dead connection only after minutes
START_SECONDS = 10.0


class BridgeError(Exception):
    """NATS cannot be reached, or the bridge is closed; the message says why."""


class PubAck:
    """The answer to one published frame: its stream sequence, or the server's error (code and text)."""

    __slots__ = ("frame", "seq", "duplicate", "error_code", "error")

    def __init__(self, frame: int, seq: int = 0, duplicate: bool = False, error_code: int = 0,
                 error: str = "") -> None:
        self.frame = frame
        self.seq = seq
        self.duplicate = duplicate
        self.error_code = error_code  # JetStream's err_code (10071: wrong last sequence); -1: no answer
        self.error = error

    def __repr__(self) -> str:
        if self.error:
            return f"PubAck(frame={self.frame}, error={self.error_code} {self.error!r})"
        return f"PubAck(frame={self.frame}, seq={self.seq}{', duplicate' if self.duplicate else ''})"


def parse_puback(frame: int, data: bytes) -> PubAck:
    """A JetStream PubAck (`{"stream":..,"seq":N}` or `{"error":{"err_code":..,"description":..}}`)."""
    try:
        answer = json.loads(data)
    except ValueError:
        return PubAck(frame, error_code=-1, error=f"not a PubAck: {data[:80]!r}")
    error = answer.get("error")
    if error:
        return PubAck(frame, error_code=int(error.get("err_code", 0)), error=str(error.get("description", error)))
    return PubAck(frame, seq=int(answer["seq"]), duplicate=bool(answer.get("duplicate")))


class NatsBridge:
    """One connection to a NATS cluster, driven from the gevent hub."""

    def __init__(self, servers: list[str], on_results: Callable[[list[PubAck]], None],
                 connect_timeout: float = 5.0) -> None:
        self.servers = servers
        self.on_results = on_results
        self.connect_timeout = connect_timeout
        self.outgoing: deque[tuple[int, str, bytes, dict[str, str] | None]] = deque()
        self.results: deque[Any] = deque()  # PubAcks, and (AsyncResult, value, error) of `run`
        self.frame_ids = itertools.count(1)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wake: asyncio.Event | None = None
        self.nc: Any = None
        self.inbox = ""
        self.thread: threading.Thread | None = None
        self.watcher: Any = None
        self.started = Event()
        self.start_error: str | None = None
        self.closing = False

    # -- the hub's side -----------------------------------------------------------------------

    def start(self) -> None:
        """Connect (in the thread) and wait for it in this greenlet; raises BridgeError if NATS is not there."""
        self.watcher = gevent.get_hub().loop.async_()  # ref'd: the hub waits for it, no LoopExit
        self.watcher.start(self.drain)
        self.thread = threading.Thread(target=self.thread_main, name="mqks-nats", daemon=True)
        self.thread.start()
        if not self.started.wait(self.connect_timeout + START_SECONDS):
            raise BridgeError(f"no answer from NATS at {','.join(self.servers)} within {self.connect_timeout:g} s")
        if self.start_error is not None:
            self.stop_watcher()
            raise BridgeError(self.start_error)

    def publish(self, frames: list[tuple[str, bytes, dict[str, str] | None]]) -> list[int]:
        """Send `frames` (subject, payload, headers) in order; their PubAcks come to `on_results` later.
        Returns the frame numbers, in the same order."""
        if self.loop is None or self.closing:
            raise BridgeError("the NATS bridge is closed")
        numbers = []
        for subject, payload, headers in frames:
            number = next(self.frame_ids)
            numbers.append(number)
            self.outgoing.append((number, subject, payload, headers))
        assert self.wake is not None
        self.loop.call_soon_threadsafe(self.wake.set)  # once per batch, never per frame
        return numbers

    def run(self, make: Callable[[Any], Awaitable[Any]], timeout: float = 10.0) -> Any:
        """`await make(nc)` in the asyncio thread; this greenlet waits for it (the hub goes on)."""
        if self.loop is None or self.closing:
            raise BridgeError("the NATS bridge is closed")
        result: AsyncResult = AsyncResult()

        async def call() -> None:
            try:
                value, error = await make(self.nc), None
            except Exception as e:
                value, error = None, e
            self.results.append((result, value, error))
            self.watcher.send()

        self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(call()))
        return result.get(timeout=timeout)

    def drain(self) -> None:
        """In the hub, when the thread sent: PubAcks to `on_results` at once, answers of `run` to their waiters."""
        results = self.results
        acks: list[PubAck] = []
        while results:
            item = results.popleft()
            if type(item) is PubAck:
                acks.append(item)
            elif isinstance(item, tuple):
                waiter, value, error = item
                if error is not None:
                    waiter.set_exception(error)
                else:
                    waiter.set(value)
            elif item == "started":
                self.started.set()
        if acks:
            self.on_results(acks)

    def close(self, timeout: float = 10.0) -> None:
        """Stop taking frames, drain the connection (what is in flight is answered first), end the thread."""
        if self.loop is None or self.closing:
            self.stop_watcher()
            return
        self.closing = True
        loop = self.loop
        assert self.wake is not None
        loop.call_soon_threadsafe(self.wake.set)
        deadline = gevent.get_hub().loop.now() + timeout
        while self.thread is not None and self.thread.is_alive() and gevent.get_hub().loop.now() < deadline:
            gevent.sleep(0.01)  # Thread.join would block the whole hub: nothing is monkey-patched
        self.drain()
        self.stop_watcher()

    def stop_watcher(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher.close()
            self.watcher = None

    # -- the asyncio thread's side ------------------------------------------------------------

    def thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        loop.set_exception_handler(lambda _, context: log.error("NATS bridge: %s", context.get("message")))
        try:
            loop.run_until_complete(self.main())
        finally:
            loop.close()

    async def main(self) -> None:
        import nats  # the cluster extra: only a broker with a replicated log loads it

        self.wake = asyncio.Event()
        nc = nats.NATS()
        try:
            # with reconnects on (they must be, later), nats-py retries a first connect forever: bound it
            await asyncio.wait_for(nc.connect(servers=self.servers, connect_timeout=int(max(1, self.connect_timeout)),
                                              allow_reconnect=True, max_reconnect_attempts=-1,
                                              reconnect_time_wait=1, ping_interval=PING_SECONDS,
                                              max_outstanding_pings=2, error_cb=self.on_error),
                                   timeout=self.connect_timeout)
            self.nc = nc
        except Exception as e:  # no servers, refused, timeout: one clear line for the operator
            reason = "no answer" if isinstance(e, asyncio.TimeoutError) else f"{type(e).__name__}: {e}"
            self.start_error = f"cannot reach NATS at {','.join(self.servers)}: {reason}"
            try:
                await nc.close()
            except Exception:
                pass
            self.results.append("started")
            self.watcher.send()
            return
        self.inbox = self.nc.new_inbox()
        await self.nc.subscribe(self.inbox + ".*", cb=self.on_puback)
        self.loop = asyncio.get_running_loop()
        self.results.append("started")
        self.watcher.send()
        await self.pump()
        try:
            await self.nc.drain()
        except Exception as e:
            log.warning("NATS bridge: drain at close failed: %s", e)

    async def pump(self) -> None:
        """Publish what the hub queued, in order, until the bridge closes."""
        assert self.wake is not None
        outgoing, publish, inbox = self.outgoing, self.nc.publish, self.inbox
        while True:
            await self.wake.wait()
            self.wake.clear()
            while outgoing:
                number, subject, payload, headers = outgoing.popleft()
                await publish(subject, payload, reply=f"{inbox}.{number}", headers=headers)
            if self.closing:
                await self.nc.flush()
                return

    async def on_puback(self, msg: Any) -> None:
        frame = int(msg.subject.rpartition(".")[2])
        status = (msg.headers or {}).get("Status") if not msg.data else None
        if status is not None:  # 503: no stream leader (an election), or no stream at all
            self.results.append(PubAck(frame, error_code=-int(status), error=f"NATS status {status}"))
        else:
            self.results.append(parse_puback(frame, msg.data))
        self.watcher.send()

    async def on_error(self, error: Exception) -> None:
        if self.nc is not None:  # before the first connect, `start` reports one error, not one per retry
            log.warning("NATS: %s", error)

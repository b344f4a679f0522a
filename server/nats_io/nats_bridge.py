"""The hop between the broker's gevent hub and nats-py, which is asyncio only: its event loop runs in an OS
thread of its own (the cluster extra). Nothing is monkey-patched.

It carries the JetStream API: streams, consumers, tail reads, purges, the takeover append, the cluster map's
bucket. The log's frames, their PubAcks, heartbeats, owner pings and a standby's pushed frames do not come here:
they go over `hub_nats()`, a core NATS connection the hub reads and writes itself (hub_nats.py), made beside
this one on first use (through the bridge, a frame cost its process three times what it costs there).

Hub -> asyncio: `spawn` (one `call_soon_threadsafe`). asyncio -> hub: `run` answers through a deque and a ref'd
libev async watcher (`ev_async_send`, safe from any thread; several sends coalesce): the calling greenlet waits,
the hub goes on. The PubAck parser is here because nats-py's `publish_async` never resolves when the server
answers an error (and leaks its slot): the log publishes with a reply subject of its own and parses the answers
itself. shared/notes/replication.md has the measurements and the traps this follows.

One broker's log has a bridge of its own. A cluster node's process shares one between its groups (`SharedNats`):
one thread, two sockets (the bridge's and the hub's) and one hub wake for all of them; each group holds a
`BridgeScope`, which ends what the group subscribed (on either connection) and spawned when the group's server
ends, and nothing else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import gevent
from gevent.event import AsyncResult, Event
from gevent.lock import Semaphore

from ...common.nats_urls import quiet_tls_noise, shown
from .hub_nats import BridgeError, Callback, HubNats, NatsUnreachable

log = logging.getLogger("mqks.journal")

# nats-py's default (120 s, 2 missed) notices a hung connection only after minutes. As the hub's own connection
# (hub_nats.py): a server cut off by a partition drops no socket, and at 5 s the tail reads, the takeover append and
# the map went to it for 10-15 s after the hub's connection had moved on (issue 56); a PING a second costs nothing
PING_SECONDS = 1
START_SECONDS = 10.0
# a shared stream's info, read for one group, answers the process's other groups for this long (each reads it every
# 10 s: stream_writer.py's FIGURES_SECONDS)
SHARED_FIGURES_SECONDS = 5.0


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
    """One connection to a NATS cluster, in an asyncio thread of its own, driven from the gevent hub."""

    def __init__(self, servers: list[str], connect_timeout: float = 5.0, options: dict[str, Any] | None = None) -> None:
        self.servers = servers
        self.connect_timeout = connect_timeout
        self.options = options or {}  # TLS and credentials (common/nats_urls.py's NatsAccess)
        self.results: deque[Any] = deque()  # (AsyncResult, value, error) of `run`, and "started"
        self.loop: asyncio.AbstractEventLoop | None = None
        self.nc: Any = None
        self.thread: threading.Thread | None = None
        self.watcher: Any = None
        self.started = Event()
        self.start_error: str | None = None
        self.first_error: Exception | None = None  # what NATS said to the first connect (a refused password)
        self.closing = False
        self.stopped: asyncio.Event | None = None
        self.hub: HubNats | None = None  # the hub's own connection for the hot traffic, made on first use
        self.hub_connecting = Semaphore()

    # -- the hub's side -----------------------------------------------------------------------

    def start(self) -> None:
        """Connect (in the thread) and wait for it in this greenlet; raises BridgeError if NATS is not there."""
        self.watcher = gevent.get_hub().loop.async_()  # ref'd: the hub waits for it, no LoopExit
        self.watcher.start(self.drain)
        self.thread = threading.Thread(target=self.thread_main, name="mqks-nats", daemon=True)
        self.thread.start()
        if not self.started.wait(self.connect_timeout + START_SECONDS):
            raise BridgeError(f"no answer from NATS at {shown(self.servers)} within {self.connect_timeout:g} s")
        if self.start_error is not None:
            self.stop_watcher()
            raise BridgeError(self.start_error)

    def hub_nats(self) -> HubNats:
        """The connection the hub reads and writes itself (hub_nats.py), for frames, PubAcks, heartbeats, owner pings
        and a standby's pushed frames; connected on first use. Raises BridgeError when NATS cannot be reached."""
        with self.hub_connecting:
            if self.hub is None:
                if self.closing:
                    raise BridgeError("the NATS bridge is closed")
                hub = HubNats(self.servers, self.options, self.connect_timeout)
                try:
                    hub.connect()
                except NatsUnreachable as e:
                    raise BridgeError(f"cannot reach NATS at {shown(self.servers)}: {e}") from None
                self.hub = hub
            return self.hub

    def call_soon(self, callback: Callable[[], Any]) -> None:
        """Run `callback` in the asyncio thread soon (one `call_soon_threadsafe`)."""
        if self.loop is None or self.closing:
            raise BridgeError("the NATS bridge is closed")
        self.loop.call_soon_threadsafe(callback)

    def spawn(self, make: Callable[[Any], Awaitable[Any]]) -> None:
        """Start `make(nc)` as a task in the asyncio thread, waiting for nothing."""
        self.call_soon(lambda: asyncio.ensure_future(make(self.nc)))

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
        """In the hub, when the thread sent: answers of `run` to their waiters."""
        results = self.results
        while results:
            item = results.popleft()
            if isinstance(item, tuple):
                waiter, value, error = item
                if error is not None:
                    waiter.set_exception(error)
                else:
                    waiter.set(value)
            elif item == "started":
                self.started.set()
            else:
                item()  # to_hub's callback

    def to_hub(self, callback: Callable[[], Any]) -> None:
        """From the asyncio thread: run `callback` in the hub soon (several coalesce into one wake)."""
        self.results.append(callback)
        watcher = self.watcher
        if watcher is not None:
            watcher.send()

    def close(self, timeout: float = 10.0) -> None:
        """Drain the connection (what is in flight is answered first) and end the thread."""
        if self.hub is not None:
            self.hub.close()
        if self.loop is None or self.closing:
            self.stop_watcher()
            return
        self.closing = True
        stopped = self.stopped
        assert stopped is not None
        self.loop.call_soon_threadsafe(stopped.set)
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
        loop.set_exception_handler(lambda _, context: log.error("NATS bridge: %s %s", context.get("message"),
                                                                context.get("exception") or ""))
        try:
            loop.run_until_complete(self.main())
        finally:
            loop.close()

    async def main(self) -> None:
        import nats  # the cluster extra: only a broker with a replicated log loads it

        quiet_tls_noise()
        self.stopped = asyncio.Event()
        nc = nats.NATS()
        try:
            # with reconnects on (they must be, later), nats-py retries a first connect forever: bound it
            await asyncio.wait_for(nc.connect(servers=self.servers, connect_timeout=int(max(1, self.connect_timeout)),
                                              allow_reconnect=True, max_reconnect_attempts=-1,
                                              reconnect_time_wait=1, ping_interval=PING_SECONDS,
                                              max_outstanding_pings=2, error_cb=self.on_error, **self.options),
                                   timeout=self.connect_timeout)
            self.nc = nc
        except Exception as e:  # no servers, refused, timeout: one clear line for the operator
            # nats-py retries a refused connect until the timeout: what NATS said is in the first error
            cause = self.first_error if isinstance(e, asyncio.TimeoutError) else e
            reason = "no answer" if cause is None else f"{type(cause).__name__}: {cause}"
            self.start_error = f"cannot reach NATS at {shown(self.servers)}: {reason}"
            try:
                await nc.close()
            except Exception:
                pass
            self.results.append("started")
            self.watcher.send()
            return
        self.loop = asyncio.get_running_loop()
        self.results.append("started")
        self.watcher.send()
        await self.stopped.wait()
        # what still runs (the writer's last moments, a map watch) ends before the loop closes under it
        others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        if others:
            _, pending = await asyncio.wait(others, timeout=1.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        try:
            await asyncio.wait_for(self.nc.drain(), timeout=5)
        except Exception as e:
            log.warning("NATS bridge: drain at close failed: %s", e)

    async def on_error(self, error: Exception) -> None:
        if self.nc is not None:
            log.warning("NATS: %s", error)
        elif self.first_error is None:  # before the first connect, `start` reports one error, not one per retry
            self.first_error = error


class SharedFigures:
    """A shared stream's info as the groups of a node process read it (in the asyncio thread): one read answers
    every group that asks within `max_age` seconds, and groups that ask while it is on the way wait for it. Each
    owned group read its own every 10 s: with a tail check, two JetStream API calls per group, most of an idle
    cluster's."""

    def __init__(self, max_age: float) -> None:
        self.max_age = max_age
        self.infos: dict[str, tuple[float, Any]] = {}  # stream: when read (monotonic), its info
        self.reading: dict[str, asyncio.Future[Any]] = {}

    async def info(self, nc: Any, stream: str) -> Any:
        """The stream's info with every subject's message count, at most `max_age` old."""
        known = self.infos.get(stream)
        if known is not None and time.monotonic() - known[0] < self.max_age:
            return known[1]
        reading = self.reading.get(stream)
        if reading is None:
            reading = self.reading[stream] = asyncio.ensure_future(self._read(nc, stream))
        return await asyncio.shield(reading)

    async def _read(self, nc: Any, stream: str) -> Any:
        try:
            info = await nc.jetstream(timeout=5).stream_info(stream, subjects_filter=">")
            self.infos[stream] = (time.monotonic(), info)
            return info
        finally:
            del self.reading[stream]


class SharedNats:
    """One NATS connection for the groups of a cluster node's process (cluster/node_process.py): each group's log and
    map use a `BridgeScope` of it. Connected by the first scope that starts; a failed connect is tried anew by the
    next one."""

    def __init__(self, servers: list[str], connect_timeout: float = 5.0, options: dict[str, Any] | None = None) -> None:
        self.servers = servers
        self.connect_timeout = connect_timeout
        self.options = options
        self.bridge: NatsBridge | None = None
        self.connecting = Semaphore()
        self.figures = SharedFigures(SHARED_FIGURES_SECONDS)

    def scope(self) -> BridgeScope:
        return BridgeScope(self)

    def started(self) -> NatsBridge:
        with self.connecting:  # the groups start together: one connects, the others wait for it
            if self.bridge is None:
                bridge = NatsBridge(self.servers, self.connect_timeout, self.options)
                bridge.start()
                self.bridge = bridge
            return self.bridge

    def close(self, timeout: float = 10.0) -> None:
        if self.bridge is not None:
            self.bridge.close(timeout)


class BridgeScope:
    """One group's share of a process's NATS connection, with a `NatsBridge`'s calls: what the group subscribes and
    spawns there is recorded, so its end (`close`) unsubscribes and cancels it, and leaves the connection to the
    other groups. A group that has ended must not answer its owner pings or take its old PubAcks."""

    def __init__(self, shared: SharedNats) -> None:
        self.shared = shared
        self.bridge: NatsBridge | None = None
        self.nc: Any = None  # a ScopedNats once started
        self.subscriptions: list[Any] = []
        self.tasks: set[asyncio.Future[Any]] = set()
        self.closed = False
        self.hub: ScopedHub | None = None

    def start(self) -> None:
        """Share the process's connection (connecting it if no group has); raises BridgeError as NatsBridge does."""
        self.bridge = self.shared.started()
        self.nc = ScopedNats(self.bridge.nc, self)

    def live(self) -> NatsBridge:
        if self.closed or self.bridge is None:
            raise BridgeError("the NATS bridge is closed")
        return self.bridge

    def hub_nats(self) -> ScopedHub:
        """The process's hub connection as this group uses it: what it subscribes ends with the group."""
        if self.hub is None:
            self.hub = ScopedHub(self.live().hub_nats(), self)
        return self.hub

    def spawn(self, make: Callable[[Any], Awaitable[Any]]) -> None:
        def start() -> None:
            if not self.closed:
                task = asyncio.ensure_future(make(self.nc))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

        self.live().call_soon(start)

    def run(self, make: Callable[[Any], Awaitable[Any]], timeout: float = 10.0) -> Any:
        return self.live().run(lambda nc: make(self.nc), timeout)

    def to_hub(self, callback: Callable[[], Any]) -> None:
        if self.bridge is not None:
            self.bridge.to_hub(callback)

    def close(self, timeout: float = 10.0) -> None:
        """Cancel what this group spawned and unsubscribe what it subscribed; the connection stays."""
        if self.closed or self.bridge is None:
            self.closed = True
            return
        self.closed = True
        if self.hub is not None:
            self.hub.end()

        async def end(nc: Any) -> None:
            tasks = [task for task in self.tasks if not task.done()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=1.0)
            for subscription in self.subscriptions:
                try:
                    await subscription.unsubscribe()
                except Exception:  # unsubscribed already, or the connection is reconnecting: it goes with it
                    pass
            self.subscriptions.clear()

        try:
            self.bridge.run(end, timeout)
        except Exception as e:
            log.warning("NATS bridge: ending a group's subscriptions failed: %s", e)


class ScopedHub:
    """The process's hub connection (HubNats) as one group uses it: its subscriptions end with the group."""

    def __init__(self, hub: HubNats, scope: BridgeScope) -> None:
        self.hub = hub
        self.scope = scope
        self.sids: set[int] = set()
        self.publish = hub.publish
        self.new_inbox = hub.new_inbox
        self.sync = hub.sync

    @property
    def connected(self) -> bool:
        return self.hub.connected

    @property
    def reconnects(self) -> int:
        return self.hub.reconnects

    def subscribe(self, subject: str, callback: Callback) -> int:
        if self.scope.closed:
            raise BridgeError("the NATS bridge is closed")
        sid = self.hub.subscribe(subject, callback)
        self.sids.add(sid)
        return sid

    def unsubscribe(self, sid: int) -> None:
        self.sids.discard(sid)
        self.hub.unsubscribe(sid)

    def end(self) -> None:
        for sid in self.sids:
            self.hub.unsubscribe(sid)
        self.sids.clear()


class ScopedNats:
    """The process's NATS client as one group's coroutines see it: its subscriptions (those made through
    JetStream too: a JetStream context made here subscribes through this) are recorded in the group's scope."""

    def __init__(self, nc: Any, scope: BridgeScope) -> None:
        self._nc = nc
        self._scope = scope

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nc, name)

    async def subscribe(self, *args: Any, **kwargs: Any) -> Any:
        scope = self._scope
        if scope.closed:
            raise BridgeError("the NATS bridge is closed")
        subscription = await self._nc.subscribe(*args, **kwargs)
        if scope.closed:  # the group ended while this subscribed
            await subscription.unsubscribe()
            raise BridgeError("the NATS bridge is closed")
        scope.subscriptions = [sub for sub in scope.subscriptions if not getattr(sub, "_closed", False)]
        scope.subscriptions.append(subscription)
        return subscription

    def jetstream(self, **options: Any) -> Any:
        from nats.js import JetStreamContext

        client: Any = self  # quacks as nats-py's Client: JetStream calls it for requests and subscriptions
        return JetStreamContext(client, **options)


Hub = HubNats | ScopedHub  # what a log publishes and subscribes through in the hub
Bridge = NatsBridge | BridgeScope  # what a log and a map call: a connection of its own, or a group's share of one

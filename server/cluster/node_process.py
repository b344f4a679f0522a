"""A cluster node's process: several slot groups, each a `Server` (app.py) in a greenlet of its own.

DESIGN.md: a group is a unit of ownership, not a process. A node runs about one process per core
(`--processes`); process p of P holds the groups p, p + P, p + 2P, ... Each group keeps everything it had
as a process of its own (its stream and its NATS connection, its listeners, links and timers) and shares
the interpreter, the hub and the memory of the modules: a default node is 3 processes, not 17.

A group whose owner steps down, is taken over or hands its group on ends its `Server` (FENCED_EXIT_CODE)
and is made again here, as a standby; a group that ends otherwise is made again after a back-off, as the
supervisor restarts a process. SIGTERM or SIGINT drains every owned group (each as one process would) and
ends the standbys; SIGHUP re-reads every group's token file.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import gevent
from gevent import Greenlet

from ..edges.config import FENCED_EXIT_CODE, Config
from ..edges.listeners import CannotListen
from ..edges.restarts import log_greenlets, restart_wait

log = logging.getLogger("mqks.node")

# a group not owned here now (fenced, handed on, or its standby's start met NATS out of reach) stands by again within
# this however often it ended: a standby's start is a few API calls, and after a heal JetStream answers 503 for 4-9 s
# while NATS elects its leaders; the back-off of a crash (up to 5 s) made the healed node stand by, and balance, up to
# 5 s after NATS answered again (issue 56)
STANDBY_AGAIN_MAX_SECONDS = 1.0


class GroupServer(Protocol):
    """What the node process needs of a group's `Server`."""

    exit_code: int

    def serve_forever(self, own_signals: bool = True) -> None: ...

    def takes_shutdown(self) -> bool: ...

    def shutdown(self) -> None: ...

    def reload_tokens(self) -> None: ...

    def release(self) -> None: ...


def groups_of(process_index: int, processes: int, groups: int) -> list[int]:
    """The groups process `process_index` of `processes` holds."""
    return list(range(process_index, groups, processes))


class GroupTag(logging.Filter):
    """` process-P group-G` on the lines a group's greenlets log (those spawned from its greenlet), ` process-P` on the
    others (the hub's: accepted connections, signal handlers)."""

    def __init__(self, process_index: int) -> None:
        super().__init__()
        self.host = f" process-{process_index}"

    def filter(self, record: logging.LogRecord) -> bool:
        locals_ = getattr(gevent.getcurrent(), "spawn_tree_locals", None)
        group = locals_.get("mqks_group") if locals_ is not None else None
        record.where = self.host if group is None else f"{self.host} group-{group}"
        return True


class NodeProcess:
    """The groups of one node process, each served, and made again when it ends, until the process stops."""

    def __init__(self, config: Config, make_server: Callable[[Config], GroupServer]) -> None:
        assert config.process_index is not None
        self.config = config
        self.make_server = make_server
        self.groups = groups_of(config.process_index, config.processes, config.workers)
        self.servers: dict[int, GroupServer] = {}
        self.greenlets: dict[int, Greenlet] = {}
        self.stopping = False
        self.failed = False

    def run(self) -> int:
        """Serve every group until SIGTERM; 0 once all have stopped."""
        gevent.signal_handler(signal.SIGTERM, self.stop)
        gevent.signal_handler(signal.SIGINT, self.stop)
        gevent.signal_handler(signal.SIGHUP, self.reload_tokens)
        gevent.signal_handler(signal.SIGUSR1, log_greenlets)
        log.info("holding slot groups %s of cluster %s", ", ".join(map(str, self.groups)), self.config.cluster)
        for group in self.groups:
            self.greenlets[group] = gevent.spawn(self.keep_serving, group)
        gevent.joinall(list(self.greenlets.values()))
        return 1 if self.failed else 0

    def stop(self) -> None:
        """Owners drain as a process of their own would; standbys (still reading their stream) just end."""
        if self.stopping:
            for server in list(self.servers.values()):  # a second signal cuts the drains short
                gevent.spawn(server.shutdown)
            return
        self.stopping = True
        log.info("stopping: %d groups", len(self.servers))
        for group, server in list(self.servers.items()):
            if server.takes_shutdown():
                gevent.spawn(server.shutdown)
            else:
                self.greenlets[group].kill(block=False)

    def reload_tokens(self) -> None:
        for server in self.servers.values():
            server.reload_tokens()

    def keep_serving(self, group: int) -> None:
        """Serve `group` again and again: as a standby first, then as its owner once it wins it."""
        gevent.getcurrent().spawn_tree_locals["mqks_group"] = group
        config = replace(self.config, worker_index=group)
        quick_ends = 0
        while not self.stopping:
            started = time.monotonic()
            code = self.serve_once(group, config)
            self.forget_ownership(group)
            if self.stopping:
                return
            quick_ends, wait = restart_wait(quick_ends, time.monotonic() - started)  # as the supervisor's
            if code == FENCED_EXIT_CODE:
                wait = min(wait, STANDBY_AGAIN_MAX_SECONDS)
                # an owner that stepped down, was taken over or handed its group on (or a standby that lost NATS)
                log.info("group %d is not owned here now; standing by for it again%s", group,
                         f" in {wait:g} s" if wait else "")
            else:
                log.error("group %d ended (exit %s); serving it again%s", group, code,
                          f" in {wait:g} s" if wait else "")
            if wait:
                gevent.sleep(wait)

    def serve_once(self, group: int, config: Config) -> int | str | None:
        """One life of the group's `Server`; its exit code."""
        try:
            server = self.make_server(config)
        except Exception as e:  # NATS out of reach or electing (a 503 is nats-py's APIError): the group tries again
            # (issue 56: a 503 right after a heal ended this greenlet, and the node stood by for the group no more)
            log.error("group %d cannot start: %s", group, str(e) or type(e).__name__)
            return FENCED_EXIT_CODE
        self.servers[group] = server
        try:
            server.serve_forever(own_signals=False)
            return server.exit_code
        except SystemExit as e:  # its recovery ends a process of its own this way
            return e.code
        except CannotListen as e:
            log.error("group %d: %s", group, e)
            return 1
        except gevent.GreenletExit:
            return 0
        except Exception:
            log.exception("group %d failed", group)
            return 1
        finally:
            del self.servers[group]
            server.release()

    def forget_ownership(self, group: int) -> None:
        """The node's other processes count the groups it owns by their files (cluster/map.py's NodeDir)."""
        try:
            os.unlink(os.path.join(self.config.run_dir or ".", f"owns-{group}"))
        except FileNotFoundError:
            pass

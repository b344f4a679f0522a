"""A process's life as the operator sees it: when to start again what died, a worker process (supervisor.py) or a
cluster group's server in its process (cluster/node_process.py), both backing off the same way without importing each
other for it; and, on SIGUSR1, what every greenlet of a live one is doing.
"""

from __future__ import annotations

import logging
import os

import gevent.util

log = logging.getLogger("mqks.server")

RESTART_BACKOFF_SECONDS = (0.0, 0.1, 0.5, 1.0, 2.0, 5.0)  # after 1, 2, ... quick deaths in a row
QUICK_DEATH_SECONDS = 10.0  # one that ran longer than this starts its back-off over


def restart_wait(quick_deaths: int, ran_seconds: float) -> tuple[int, float]:
    """After one more death (a worker's, or a cluster group's server's in its process): the quick deaths in a row
    now, and how long to wait before starting it again."""
    deaths = quick_deaths + 1 if ran_seconds < QUICK_DEATH_SECONDS else 1
    return deaths, RESTART_BACKOFF_SECONDS[min(deaths - 1, len(RESTART_BACKOFF_SECONDS) - 1)]


def log_greenlets() -> None:
    """SIGUSR1: every greenlet's stack and what it waits on, in the log (what a stuck connection is doing). A
    supervisor passes the signal to each of its processes."""
    log.warning("SIGUSR1: the greenlets of process %d:\n%s", os.getpid(), "\n".join(gevent.util.format_run_info()))

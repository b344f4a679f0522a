"""`mqksd --workers N` (N >= 2): the parent process that runs N worker processes and keeps them running.

The parent holds no queues and serves no client. It prepares the data dir for N workers
(re-sharding a log written with another N, server/edges/reshard.py), makes a private run
directory for the workers' Unix sockets, starts `mqksd ... --worker-index i` N times,
restarts a worker that dies (logged, with a back-off if it keeps dying) unless it cannot start
because of its data (then the whole broker stops, exit 1, as one process would), passes SIGHUP
on, and on SIGTERM or SIGINT passes it on and exits 0 once every worker has drained and
exited. Each worker dies with the parent (PR_SET_PDEATHSIG): a killed broker never leaves
workers behind on its port.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from .config import CANNOT_START_EXIT_CODE, Config
from .restarts import restart_wait

log = logging.getLogger("mqks.supervisor")

STOP_WAIT_SECONDS = 60.0  # past the drain: a worker that will not exit is killed
# the watch sleeps until a signal (a worker's exit is a SIGCHLD) or this long: polling every worker every 50 ms
# was 0.2% of a core per supervisor, idle
WATCH_SECONDS = 1.0
SUPERVISOR_PID_ENV = "MQKS_SUPERVISOR_PID"


class Supervisor:
    """N worker processes under one parent."""

    def __init__(self, config: Config, argv: list[str]) -> None:
        self.config = config
        self.argv = argv
        # a cluster node: processes holding several groups each (cluster/node_process.py); else one worker per process
        self.count = config.processes if config.cluster else config.workers
        self.run_dir = tempfile.mkdtemp(prefix="mqks-")
        self.children: dict[int, subprocess.Popen] = {}
        self.started_at: dict[int, float] = {}
        self.quick_deaths: dict[int, int] = {}
        self.stopping = False
        self.stop_deadline = 0.0

    def command(self, worker: int) -> list[str]:
        # `python -m mqks.server`: the server package, one above this one (server/node)
        package = ((__spec__.parent or "") if __spec__ is not None else "").rpartition(".")[0] or "mqks.server"
        index = "--process-index" if self.config.cluster else "--worker-index"
        return [sys.executable, "-m", package, *self.argv, index, str(worker), "--run-dir", self.run_dir]

    def start(self, worker: int) -> None:
        env = {**os.environ, SUPERVISOR_PID_ENV: str(os.getpid())}
        # a group of its own: Ctrl-C at a terminal reaches the supervisor alone, which passes one SIGTERM on
        # (a second signal would cut the workers' drain short)
        self.children[worker] = subprocess.Popen(self.command(worker), env=env, process_group=0)
        self.started_at[worker] = time.monotonic()
        log.info("worker %d started (pid %d)", worker, self.children[worker].pid)

    def prepare_data_dir(self) -> None:
        config = self.config
        if config.data_dir is None:
            return
        from .reshard import ReshardError, prepare

        try:
            summary = prepare(config.data_dir, self.count, fsync=config.fsync, segment_bytes=config.log_segment_bytes,
                              repair=config.repair)
        except ReshardError as e:
            log.error("cannot start: %s", e)
            raise SystemExit(1) from None
        if summary:
            log.info("%s", summary)

    def check_ports_free(self) -> None:
        """Refuse to start beside another broker on our ports: SO_REUSEPORT alone would let both accept there.

        A bind without SO_REUSEPORT fails while a socket listens on the port, shared or not.
        """
        config = self.config
        shared = [(config.host, config.port), (config.host, config.tls_port)]
        if config.cluster:  # every owner of a node accepts on its metrics port too
            shared.append((config.metrics_host, config.metrics_port))
        for host, port in shared:
            if not port:
                continue
            probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past connections in TIME_WAIT do not count
            try:
                probe.bind((host, port))
            except OSError as e:
                log.error("cannot listen on %s:%d: %s", host, port, e)
                raise SystemExit(1) from None
            finally:
                probe.close()

    def check_cluster_layout(self) -> None:
        """A cluster node takes its cluster's --groups and --streams from NATS when not given, refuses a name whose
        streams on NATS were made with other ones, and a --node id a running node answers as."""
        if not self.config.cluster or self.config.log is None:
            return
        from ..cluster.layout import node_settings

        self.config, self.argv = node_settings(self.config, self.argv, lambda: self.stopping)
        self.count = self.config.processes

    def on_stop(self, signum: int, frame: Any) -> None:
        if not self.stopping:
            log.info("stopping: passing %s to %d workers", signal.Signals(signum).name, len(self.children))
            self.stopping = True
            self.stop_deadline = time.monotonic() + self.config.drain_seconds + STOP_WAIT_SECONDS
        for child in self.children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    def on_pass(self, signum: int, frame: Any) -> None:
        """SIGHUP (reload the tokens) and SIGUSR1 (log the greenlets) are each worker's to act on."""
        for child in self.children.values():
            if child.poll() is None:
                child.send_signal(signum)

    def run(self) -> int:
        """Start every worker; restart any that dies until told to stop; 0 once all have stopped."""
        signal.signal(signal.SIGTERM, self.on_stop)
        signal.signal(signal.SIGINT, self.on_stop)
        signal.signal(signal.SIGHUP, self.on_pass)
        signal.signal(signal.SIGUSR1, self.on_pass)
        try:
            self.check_ports_free()
            self.check_cluster_layout()
            self.prepare_data_dir()
            for worker in range(self.count):
                if self.stopping:  # a SIGTERM during the starts: the rest are not started at all
                    break
                self.start(worker)
            if self.config.cluster:
                log.info("mqksd node %s of cluster %s: %d slot groups in %d processes, on %s:%d", self.config.node,
                         self.config.cluster, self.config.workers, self.count, self.config.host, self.config.port)
            else:
                log.info("mqksd supervising %d workers on %s:%d (run dir %s)", self.count, self.config.host,
                         self.config.port, self.run_dir)
            return self.watch()
        finally:
            for child in self.children.values():
                if child.poll() is None:
                    child.kill()
                    child.wait()
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def watch(self) -> int:
        failed = False
        woken = self.wake_on_signals()
        while True:
            for worker, child in list(self.children.items()):
                code = child.poll()
                if code is None:
                    continue
                self.forget_ownership(worker)
                if code == CANNOT_START_EXIT_CODE and not self.stopping:
                    log.error("worker %d cannot start because of its data (its error is above); stopping the "
                              "broker rather than restarting it for ever", worker)
                    failed = True
                    self.on_stop(signal.SIGTERM, None)
                if self.stopping:
                    # killed by our SIGTERM before it had set its handler: it had served nothing yet
                    if code not in (0, -signal.SIGTERM, CANNOT_START_EXIT_CODE):
                        log.warning("worker %d exited %d while stopping", worker, code)
                        failed = True
                    del self.children[worker]
                    continue
                self.restart(worker, code)
            if self.stopping:
                if not self.children:
                    log.info("mqksd stopped")
                    return 1 if failed else 0
                if time.monotonic() > self.stop_deadline:
                    log.error("workers %s did not stop in time: killing them", sorted(self.children))
                    return 1
            # a worker that exits after its poll above sends SIGCHLD, whose byte is waiting: no exit is missed
            if select.select([woken], [], [], WATCH_SECONDS)[0]:
                while True:
                    try:
                        if not os.read(woken, 4096):
                            break
                    except BlockingIOError:
                        break

    def forget_ownership(self, worker: int) -> None:
        """A cluster's group owner marks itself in the run dir: the groups of a process that ended are owned by no
        process of this node now."""
        if not self.config.cluster:
            return
        from ..cluster.node_process import groups_of

        for group in groups_of(worker, self.count, self.config.workers):
            try:
                os.unlink(os.path.join(self.run_dir, f"owns-{group}"))
            except FileNotFoundError:
                pass

    @staticmethod
    def wake_on_signals() -> int:
        """A pipe that gets a byte whenever a signal comes (SIGCHLD: a worker exited; SIGTERM, SIGINT, SIGHUP)."""
        readable, writable = os.pipe()
        os.set_blocking(readable, False)
        os.set_blocking(writable, False)
        signal.set_wakeup_fd(writable)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # delivered, so the wakeup fd hears it
        return readable

    def restart(self, worker: int, code: int) -> None:
        ran = time.monotonic() - self.started_at[worker]
        self.quick_deaths[worker], wait = restart_wait(self.quick_deaths.get(worker, 0), ran)
        log.error("%s %d (pid %d) died (%s) after %.1f s; restarting it%s",
                  "process" if self.config.cluster else "worker", worker, self.children[worker].pid,
                  f"signal {-code}" if code < 0 else f"exit {code}", ran, f" in {wait:g} s" if wait else "")
        if wait:
            time.sleep(wait)
        if not self.stopping:
            self.start(worker)


def supervisor_pid() -> int:
    """A worker's (or a cluster node process's) supervisor."""
    return int(os.environ.get(SUPERVISOR_PID_ENV, "0")) or os.getppid()


def die_with_parent() -> None:
    """A worker: be killed when the supervisor goes (Linux), so no worker outlives a killed broker."""
    parent_pid = supervisor_pid()
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        log.warning("cannot ask to die with the supervisor: a killed broker may leave this worker running")
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)

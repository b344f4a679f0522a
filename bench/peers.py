"""Find, install, start and stop the servers the benchmark measures.

Every server is started here on 127.0.0.1 with a free port and persistence off (w5 turns it
on, into a data directory the caller creates and deletes), and stopped here by the pid we
started (SIGTERM, then SIGKILL after a grace period).
A peer whose binary is missing is installed once with apt-get; if that fails it is
skipped and `skipped` says why. `taskset -c N` pins a server when a core is given.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
HERE_SINK = os.path.join(BENCH_DIR, "sink.py")
READY_TIMEOUT_SECONDS = 20.0

# binary -> Debian package
PEER_PACKAGES = {
    "redis-server": "redis-server",
    "nats-server": "nats-server",
    "beanstalkd": "beanstalkd",
}
SEARCH_DIRS = ("/usr/bin", "/usr/sbin", "/usr/local/bin", "/usr/local/sbin", "/bin", "/sbin")


def free_port(avoid: tuple[str, ...] = ()) -> int:
    """A port nobody listens on right now, and none of `avoid` (a port already chosen for the same server: the
    kernel may hand a closed port out again at once)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if str(port) not in avoid:
            return port


def find_binary(name: str) -> str | None:
    """Full path of `name` on PATH or in the usual sbin folders (root's PATH may lack sbin)."""
    found = shutil.which(name)
    if found:
        return found
    for folder in SEARCH_DIRS:
        path = os.path.join(folder, name)
        if os.access(path, os.X_OK):
            return path
    return None


class PeerFinder:
    """Finds peer binaries, installing the missing ones with one apt-get run."""

    def __init__(self, install: bool = True, log=print) -> None:
        self.install = install
        self.log = log
        self.paths: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        self._apt_tried = False

    def resolve(self, names: list[str]) -> None:
        """Fill `paths` for every name found; `skipped` for the rest, with a reason."""
        missing = [n for n in names if not find_binary(n)]
        if missing and self.install and not self._apt_tried:
            self._apt_tried = True
            self._apt_install([PEER_PACKAGES.get(n, n) for n in missing])
        for name in names:
            path = find_binary(name)
            if path:
                self.paths[name] = path
            else:
                self.skipped[name] = self.skipped.get(name) or (
                    "not installed (--no-install)" if not self.install else "apt-get could not install it"
                )

    def _apt_install(self, packages: list[str]) -> None:
        if not shutil.which("apt-get"):
            for p in packages:
                self.skipped[p] = "no apt-get on this machine"
            return
        prefix = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else [])
        self.log(f"# installing peers with apt-get: {' '.join(packages)}")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        try:
            subprocess.run([*prefix, "apt-get", "update", "-q"], env=env, check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
            done = subprocess.run([*prefix, "apt-get", "install", "-y", "-q", *packages], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
            if done.returncode != 0:
                self.log(f"# apt-get install failed: {done.stderr.decode(errors='replace')[-400:]}")
        except (OSError, subprocess.TimeoutExpired) as e:
            self.log(f"# apt-get failed: {e}")


@dataclass
class Server:
    """One server process we started; `pid` is what we stop."""

    kind: str
    port: int
    proc: subprocess.Popen
    workdir: str
    log_path: str
    host: str = "127.0.0.1"
    extra: dict = field(default_factory=dict)
    started: float = 0.0  # time.monotonic() just before the process was spawned

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n_bytes: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - n_bytes))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self, grace_seconds: float = 10.0) -> int | None:
        """SIGTERM our pid and wait; SIGKILL after the grace period. Returns the exit code."""
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace_seconds)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
        return self.proc.returncode


def _pin(core: int | None) -> list[str]:
    return ["taskset", "-c", str(core)] if core is not None else []


def _wait_ready(server: Server, probe: bytes, expect: bytes | None) -> None:
    """Connect until the server answers `probe` with something that contains `expect`."""
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    last: Exception | None = None
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.kind} exited {server.proc.returncode}: {server.log_tail()}")
        try:
            with socket.create_connection((server.host, server.port), timeout=2) as sock:
                if probe:
                    sock.sendall(probe)
                buf = b""
                while expect is not None and expect not in buf:
                    chunk = sock.recv(65536)
                    if not chunk:
                        raise ConnectionError("closed")
                    buf += chunk
                return
        except OSError as e:
            last = e
            time.sleep(0.03)
    server.stop(1)
    raise RuntimeError(f"{server.kind} not ready in {READY_TIMEOUT_SECONDS}s: {last}; {server.log_tail()}")


def seconds_until_answer(server: Server, probe: bytes, expect: bytes, timeout: float) -> float:
    """Seconds from the spawn of `server` until it answers `probe` with a line holding `expect`.

    Tries every 2 ms: a refused connection, or another first line (Redis's `-LOADING` while it
    reads its AOF) means not yet. For the recovery cells, so it is finer than `_wait_ready`.
    """
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.kind} exited {server.proc.returncode}: {server.log_tail()}")
        try:
            with socket.create_connection((server.host, server.port), timeout=timeout) as sock:
                sock.sendall(probe)
                buf = b""
                while b"\n" not in buf:
                    chunk = sock.recv(65536)
                    if not chunk:
                        raise ConnectionError("closed")
                    buf += chunk
                if expect in buf.split(b"\n", 1)[0]:
                    return time.monotonic() - server.started
                last = repr(buf[:100])
        except OSError as e:
            last = str(e)
        time.sleep(0.002)
    raise RuntimeError(f"{server.kind} did not answer in {timeout:.0f}s: {last}; {server.log_tail()}")


def _spawn(kind: str, cmd: list[str], port: int, core: int | None, log_dir: str,
           env: dict[str, str] | None = None) -> Server:
    os.makedirs(log_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix=f"bench-{kind}-")
    log_path = os.path.join(log_dir, f"{kind}-{port}.log")
    log = open(log_path, "wb")  # noqa: SIM115 (closed below, once the child holds it)
    # no pipe: a pipe nobody reads fills up and would freeze the server
    started = time.monotonic()
    proc = subprocess.Popen(_pin(core) + cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env={**os.environ, **env} if env else None)
    log.close()
    return Server(kind=kind, port=port, proc=proc, workdir=workdir, log_path=log_path, started=started)


def mqks_python() -> str | None:
    """A Python that can `import mqks.server`: this one, else the repo's .venv; None if neither."""
    repo_venv = os.path.join(os.path.dirname(BENCH_DIR), ".venv", "bin", "python")
    for python in (sys.executable, repo_venv):
        if not os.access(python, os.X_OK):
            continue
        done = subprocess.run([python, "-c", "import mqks.server.app"], cwd=tempfile.gettempdir(),
                              capture_output=True, timeout=60)
        if done.returncode == 0:
            return python
    return None


MQKS_PROBE = (b"ready ping\n", b"ready ok")
REDIS_PROBE = (b"PING\r\n", b"+PONG")
BEANSTALKD_PROBE = (b"stats\r\n", b"OK ")


def start_mqks(core: int | None, log_dir: str, python: str = sys.executable,
               extra_args: tuple[str, ...] = (), profile_path: str | None = None,
               data_dir: str | None = None, fsync: str = "everysec", wait: bool = True, pure: bool = False) -> Server:
    """mqksd on a free port, with --eval so the benchmark can check its stats; with `data_dir`,
    durable (`--data-dir data_dir --fsync fsync`, logging at info for its recovery line); with `pure`, the
    hot path's plain sources even where the install compiled them (MQKS_PURE=1)."""
    port = free_port(avoid=extra_args)  # extra_args may hold a --tls-port chosen before
    prof = ["-m", "cProfile", "-o", profile_path] if profile_path else []
    durable = ["--data-dir", data_dir, "--fsync", fsync, "--log-level", "info"] if data_dir else []
    cmd = [python, *prof, "-m", "mqks.server", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", "--eval", *durable, *extra_args]
    server = _spawn("mqks", cmd, port, core, log_dir, env={"MQKS_PURE": "1" if pure else ""})
    if wait:
        _wait_ready(server, *MQKS_PROBE)
    return server


def start_redis(path: str, core: int | None, log_dir: str, data_dir: str | None = None,
                appendfsync: str = "everysec", wait: bool = True) -> Server:
    """redis-server with no RDB, no AOF, and no output-buffer limit for subscribers; with `data_dir`,
    the AOF on in it (`--appendonly yes --appendfsync appendfsync`, rewrites at their defaults), still no RDB."""
    port = free_port()
    aof = ["--appendonly", "yes", "--appendfsync", appendfsync, "--dir", data_dir] if data_dir else \
        ["--appendonly", "no"]
    cmd = [path, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *aof,
           "--daemonize", "no", "--logfile", "", "--protected-mode", "no",
           "--client-output-buffer-limit", "pubsub 0 0 0"]
    server = _spawn("redis", cmd, port, core, log_dir)
    if wait:
        _wait_ready(server, *REDIS_PROBE)
    return server


def start_nats(path: str, core: int | None, log_dir: str) -> Server:
    """nats-server (core, no JetStream) with room for a slow benchmark consumer."""
    port = free_port()
    with tempfile.NamedTemporaryFile("w", prefix="bench-nats-", suffix=".conf", delete=False) as f:
        f.write(f"listen: 127.0.0.1:{port}\nmax_pending: 1073741824\n"
                f"write_deadline: \"60s\"\nping_interval: \"10m\"\n")
        conf_path = f.name
    cmd = [path, "-c", conf_path]
    server = _spawn("nats", cmd, port, core, log_dir)
    server.extra["conf"] = conf_path
    _wait_ready(server, b"", b"INFO")
    os.unlink(conf_path)
    return server


def start_beanstalkd(path: str, core: int | None, log_dir: str, data_dir: str | None = None,
                     fsync_ms: int = 50, wait: bool = True) -> Server:
    """beanstalkd without a binlog (memory only); with `data_dir`, its binlog there
    (`-b data_dir -f fsync_ms`: fsync at most every fsync_ms ms, 0 = after every write)."""
    port = free_port()
    binlog = ["-b", data_dir, "-f", str(fsync_ms)] if data_dir else []
    cmd = [path, "-l", "127.0.0.1", "-p", str(port), *binlog]
    server = _spawn("beanstalkd", cmd, port, core, log_dir)
    if wait:
        _wait_ready(server, *BEANSTALKD_PROBE)
    return server


def start_sink(core: int | None, log_dir: str, deliver: int, python: str = sys.executable) -> Server:
    """The trivial sink: speaks just enough MQKS to measure the generator's own ceiling."""
    port = free_port()
    cmd = [python, HERE_SINK, "--port", str(port), "--deliver", str(deliver)]
    server = _spawn("sink", cmd, port, core, log_dir)
    _wait_ready(server, b"ready ping\n", b"ready ok")
    return server

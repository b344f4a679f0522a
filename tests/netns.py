"""Hosts on one private switch, each a network namespace, which a test can cut off the switch and put back.

A run's namespaces are named `mqkspart-PID-N-HOST`; the switch (a bridge) lives in a namespace of its own,
`...-sw`, and every address (10.213.0.0/24) exists only inside these namespaces: nothing is added to this host's own
network, and nothing is ever sent to an address the run did not make. A cut sets the host's port on the bridge to
`disabled`: the bridge drops its frames both ways while the host's link stays up, as a firewall dropping packets
would (no reset, no unreachable: peers notice by timeouts alone). Removal kills every process in the namespaces and
deletes them, on every exit path; each new network first removes what a run that died left behind (its pid is gone).
Needs root and iproute2 (`ip`, `bridge`).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

PREFIX = "mqkspart"
SUBNET = "10.213.0"  # a /24 that lives only on the veths of these namespaces
FIRST_HOST = 11  # host i is SUBNET.(FIRST_HOST + i)
NETNS_DIR = "/run/netns"  # where `ip netns add` mounts a namespace under its name
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
GONE_SECONDS = 10.0  # a SIGKILLed process leaves its namespace within this (it is a bound, not a pause)
IP_SECONDS = 10.0

_networks = itertools.count()
_LEFTOVER = re.compile(rf"^{PREFIX}-(\d+)-")


def ip(*args: str) -> str:
    """Run `ip ARGS` (or `bridge` when args[0] is "bridge"); its output; CalledProcessError with its stderr."""
    cmd = list(args) if args[0] == "bridge" else ["ip", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_SECONDS)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, done.stderr)
    return done.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a reason to skip), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run the cluster tier as root, as CI does"
    missing = [tool for tool in ("ip", "bridge") if shutil.which(tool) is None]
    if missing:
        return f"no {' or '.join(missing)} on the PATH (apt-get install iproute2)"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as e:
        said = getattr(e, "stderr", "") or str(e)
        return f"`ip netns add` is refused here: {said.strip()}"
    try:
        ip("-n", probe, "link", "add", "probe", "type", "bridge")
    except subprocess.CalledProcessError as e:
        return f"cannot make a bridge inside a network namespace: {e.stderr.strip()}"
    finally:
        remove_namespace(probe)
    return None


def namespaces() -> list[str]:
    """The names `ip netns list` shows."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Delete the namespaces (and kill the processes in them) of runs whose process is gone; their names."""
    removed = []
    for name in namespaces():
        found = _LEFTOVER.match(name)
        if found and int(found.group(1)) != os.getpid() and not pid_alive(int(found.group(1))):
            remove_namespace(name)
            removed.append(name)
    return removed


def remove_namespace(name: str) -> None:
    """SIGKILL every process in namespace `name` (never this one), wait until they are gone, delete it."""
    try:
        pids = [int(pid) for pid in ip("netns", "pids", name).split()]
    except subprocess.CalledProcessError:
        pids = []  # gone already
    exits = []  # a pidfd turns readable when its process is gone: waited on, not polled
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            exits.append(os.pidfd_open(pid))
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + GONE_SECONDS
    try:
        while exits and (left := deadline - time.monotonic()) > 0:
            gone, _, _ = select.select(exits, [], [], left)
            for fd in gone:
                exits.remove(fd)
                os.close(fd)
    finally:
        for fd in exits:
            os.close(fd)
    try:
        ip("netns", "del", name)
    except subprocess.CalledProcessError as e:
        if "No such file" not in e.stderr:
            raise


def _die_with_parent() -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


class Network:
    """Hosts, each a namespace with one address, on one bridge; `cut(host)` takes a host off it, `heal` puts it back.

    Built in full or not at all: a failure while building removes what was made. `close()` removes everything
    (every process inside first) and may be called more than once.
    """

    def __init__(self, hosts: Sequence[str]) -> None:
        remove_leftovers()
        self.prefix = f"{PREFIX}-{os.getpid()}-{next(_networks)}"
        self.switch = f"{self.prefix}-sw"
        self.hosts = list(hosts)
        self.made: list[str] = []
        self.cut_off: set[str] = set()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        ip("netns", "add", self.switch)
        self.made.append(self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            name = self.namespace(host)
            ip("netns", "add", name)
            self.made.append(name)
            # made inside the two namespaces at once: the root namespace never holds either end
            ip("-n", self.switch, "link", "add", self.port(host), "type", "veth", "peer", "name", "eth0", "netns", name)
            ip("-n", self.switch, "link", "set", self.port(host), "master", "br0", "up")
            ip("-n", name, "link", "set", "lo", "up")  # a node's processes talk to each other on loopback
            ip("-n", name, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")

    def namespace(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def port(self, host: str) -> str:
        """The host's veth on the bridge (not "a", "b": `ip` reads those as its own keywords)."""
        return f"port-{host}"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{FIRST_HOST + self.hosts.index(host)}"

    def command(self, host: str, *args: str) -> list[str]:
        """`args` run inside the host's namespace (ip netns exec: the process itself, no shell between)."""
        return ["ip", "netns", "exec", self.namespace(host), *args]

    def popen(self, host: str, args: Sequence[str], **options: Any) -> subprocess.Popen:
        """`args` started inside the host's namespace, SIGKILLed by the kernel if this process dies first
        (PR_SET_PDEATHSIG): a run killed outright leaves no server behind, only namespaces the next run removes.
        Call it from the thread that lives longest (the main one): the signal follows the thread that started it."""
        return subprocess.Popen(self.command(host, *args), preexec_fn=_die_with_parent, **options)

    def cut(self, host: str) -> None:
        """Frames to and from the host are dropped from now on, both ways; its link stays up."""
        ip("bridge", "-n", self.switch, "link", "set", "dev", self.port(host), "state", "0")  # disabled
        self.cut_off.add(host)

    def heal(self, host: str) -> None:
        ip("bridge", "-n", self.switch, "link", "set", "dev", self.port(host), "state", "3")  # forwarding
        self.cut_off.discard(host)

    @contextmanager
    def entered(self, host: str) -> Iterator[None]:
        """This thread inside the host's namespace: sockets made meanwhile are the host's (they stay so after), and so
        are threads and processes started meanwhile. Other threads are not moved; the thread's own comes back."""
        with open("/proc/thread-self/ns/net", "rb") as home, open(os.path.join(NETNS_DIR, self.namespace(host)),
                                                                  "rb") as there:
            _setns(there.fileno())
            try:
                yield
            finally:
                _setns(home.fileno())

    def close(self) -> None:
        """Every process inside killed, every namespace deleted (the veths go with them), hosts before the switch."""
        errors = []
        for name in reversed(self.made):
            try:
                remove_namespace(name)
            except Exception as e:  # the others are removed all the same; raised below
                errors.append(e)
        self.made.clear()
        if errors:
            raise errors[0]

"""The listening sockets that accept clients (TCP, Unix), and
the one place that survives running out of descriptors while accepting.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from typing import Any

import gevent.socket
from gevent.server import StreamServer

log = logging.getLogger("mqks.server")

OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class CannotListen(Exception):
    """A port the server must listen on cannot be bound (exit 1)."""


class AcceptFailed(Exception):
    """accept() ran out of descriptors or memory; gevent backs off and retries (up to 1 s apart)."""


class Listener(StreamServer):
    """The StreamServer, reporting a burst of failed accepts in one log line, not a traceback each."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.failed_accepts = 0

    def do_read(self):
        try:
            accepted = super().do_read()
        except OSError as e:
            if e.errno not in OUT_OF_RESOURCES:
                raise
            if not self.failed_accepts:
                log.error("cannot accept new connections: %s; retrying, existing clients are still served", e)
            self.failed_accepts += 1
            raise AcceptFailed(str(e)) from None
        if accepted and self.failed_accepts:
            log.warning("accepting again after %d failed accepts", self.failed_accepts)
            self.failed_accepts = 0
        return accepted


def tcp_listener(host: str, port: int, handle: Any, what: str, shared: bool = False) -> Listener:
    """A listening TCP port; `shared`: with SO_REUSEPORT, so each worker process accepts on it too."""
    try:
        if not shared:
            listener = Listener((host, port), handle, backlog=1024)
            listener.init_socket()
            return listener
        return Listener(reuse_port_socket(host, port), handle)
    except OSError as e:
        raise CannotListen(f"cannot listen{what} on {host}:{port}: {e}") from None


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket with SO_REUSEPORT: every process of a broker (or owner of a node) accepts on the port."""
    sock = gevent.socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock

def unix_listener(path: str, handle: Any) -> Listener:
    if os.path.exists(path):
        os.unlink(path)  # left by this worker's previous life
    sock = gevent.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(1024)
    return Listener(sock, handle)

"""The first bytes on an accepted socket, before app.py's `Server` hands it on: a TLS handshake, a link's hello.

Each is bounded in time and fails that one peer alone: the socket is closed, the reason logged.
A client speaking plain text to the TLS port is told so in a protocol error line first; a link
from another worker (or another node's group) names its worker in `- _link N`, with the
cluster's token after it when a cluster has tokens.
"""

from __future__ import annotations

import logging
import socket
import ssl
import time
from collections.abc import Callable

import gevent
import gevent.socket

log = logging.getLogger("mqks.server")

TLS_HANDSHAKE_SECONDS = 10.0  # a peer that connects and never finishes the handshake holds nothing longer
PLAIN_TEXT_REASONS = ("WRONG_VERSION_NUMBER",)  # an HTTP request is closed at once, as on the plain port
LINK_HELLO_MAX_BYTES = 256


def handshake(tls_sock: ssl.SSLSocket) -> None:
    """The server side of a TLS handshake, bounded in time; raises OSError or ValueError (the socket left open)."""
    tls_sock.settimeout(TLS_HANDSHAKE_SECONDS)
    tls_sock.do_handshake()
    tls_sock.settimeout(None)


def client_tls(context: ssl.SSLContext, sock: socket.socket, address: object,
               plain_text_error: Callable[[], bytes]) -> ssl.SSLSocket | None:
    """A client's TLS socket once its handshake is done; None once a failed one closed it (a client speaking plain
    text hears `plain_text_error()` first)."""
    peer = f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)
    try:
        tls_sock = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
    except (OSError, ValueError) as e:
        log.info("TLS from %s failed: %s", peer, e)
        sock.close()
        return None
    try:
        handshake(tls_sock)
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError: a plain client, a bad certificate
        if getattr(e, "reason", None) in PLAIN_TEXT_REASONS:
            log.info("plain text on a TLS port from %s: told it to connect with TLS, closed", peer)
            tell_plain_client(tls_sock, plain_text_error())
        else:
            log.info("TLS handshake with %s failed: %s", peer, e)
        tls_sock.close()
        return None
    return tls_sock


def tell_plain_client(tls_sock: socket.socket, line: bytes) -> None:
    """A person at `nc` on the TLS port reads why nothing works, then sees the connection end cleanly."""
    raw = socket.socket(tls_sock.family, tls_sock.type, fileno=tls_sock.fileno())  # the kernel socket beneath
    try:
        raw.setblocking(False)
        raw.send(line)
        raw.shutdown(socket.SHUT_WR)
        # read what the client sent before closing: unread input would turn the close into a reset
        # that can discard our line before the client reads it
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            gevent.socket.wait_read(raw.fileno(), timeout=max(0.0, deadline - time.monotonic()))
            if not raw.recv(65536):
                break
    except (OSError, gevent.Timeout):
        pass
    finally:
        raw.detach()


def link_hello(sock: socket.socket, address: object, tls: ssl.SSLContext | None,
               check_token: Callable[[bytes], bool] | None) -> tuple[socket.socket, int, bytes] | None:
    """(the socket, the worker it says it is, what it sent after its hello) for a link that passed its TLS handshake
    (`tls`: links between the nodes of a cluster whose nodes have --tls-cert; one that does not speak TLS is refused)
    and its token check (`check_token`: links cross hosts, and prove themselves as a client would); else None, the
    socket closed."""
    if tls is not None:
        tls_sock = tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        try:
            handshake(tls_sock)
        except (OSError, ValueError) as e:
            log.warning("refused a link from %s: no TLS handshake (%s)", address, e)
            tls_sock.close()
            return None
        sock = tls_sock
    data = b""
    while b"\n" not in data and len(data) < LINK_HELLO_MAX_BYTES:
        chunk = sock.recv(LINK_HELLO_MAX_BYTES)
        if not chunk:
            sock.close()
            return None
        data += chunk
    line, _, rest = data.partition(b"\n")
    parts = line.split()
    if check_token is not None:
        if len(parts) != 4 or not check_token(parts[3]):
            log.warning("closing a link from %s: no valid token", address)
            sock.close()
            return None
        parts = parts[:3]
    if parts[:2] != [b"-", b"_link"] or len(parts) != 3 or not parts[2].isdigit():
        log.warning("closing the link socket's peer: it sent %r", line[:80])
        sock.close()
        return None
    return sock, int(parts[2]), rest

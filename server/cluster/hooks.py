"""What `Server` (app.py) asks of the cluster layer, as a handful of named hooks it calls unconditionally.

A node's group answers them in group.py (`ClusterGroup`); a broker without --cluster has `NoCluster`,
whose hooks do nothing, so the Server never asks whether it is in a cluster. This module loads nothing
of the cluster extra.

    link / link_accepted     the links between groups: over TCP, as the map names their owners, with a token
    hello_fields             `hello`'s fields about the cluster and every group's owner
    replay                   the records to recover from: a standby's up to this node's takeover
    serve                    this process owns its group and listens: its entry in the map
    hands_off / stopping     a hand-off asked by another node, or a planned stop: the log marks it for the standbys
    owned_groups / node_figures   what /healthz and /metrics answer for: the node's groups, labels and processes
    close                    the Server ended (the process may go on and serve the group again)
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..journal.journal import Log
    from ..workers.peers import Peers

Scope = Callable[[], list[int] | None]  # the groups /metrics and /healthz answer for; None: the whole broker


class Cluster(Protocol):
    """The hooks, as `ClusterGroup` and `NoCluster` both answer them."""

    links_over_tcp: bool  # the groups' owners link over TCP to the addresses in the map, not over the run dir
    shares_metrics_port: bool  # every owner of a node answers /metrics and /healthz for the node
    link_tls: ssl.SSLContext | None  # what the link port accepts with: links cross hosts, as encrypted as clients
    check_link_token: Callable[[bytes], bool] | None  # a link's hello carries the cluster's secret, when tokens are on

    def link(self, peers: Peers) -> None: ...

    def link_accepted(self, sock: socket.socket) -> None: ...

    def hello_fields(self, workers: int) -> dict[str, Any]: ...

    def replay(self, journal_log: Log, repair: bool) -> Iterable[Iterable[bytes]]: ...  # the records, in batches

    def serve(self, direct_port: int, link_port: int, tls_port: int | None) -> None: ...

    def hands_off(self) -> bool: ...

    def stopping(self) -> None: ...

    def owned_groups(self) -> list[int] | None: ...

    def node_figures(self) -> tuple[Scope, dict[str, str] | None, int | None]: ...

    def close(self) -> None: ...


class NoCluster:
    """A broker without --cluster: its workers link over the run dir, and no hook does anything."""

    links_over_tcp = False
    shares_metrics_port = False
    link_tls: ssl.SSLContext | None = None
    check_link_token: Callable[[bytes], bool] | None = None

    def link(self, peers: Peers) -> None:
        pass

    def link_accepted(self, sock: socket.socket) -> None:
        pass

    def hello_fields(self, workers: int) -> dict[str, Any]:
        return {}

    def replay(self, journal_log: Log, repair: bool) -> Iterable[Iterable[bytes]]:
        return (journal_log.replay(repair=repair),)

    def serve(self, direct_port: int, link_port: int, tls_port: int | None) -> None:
        pass

    def hands_off(self) -> bool:
        return False

    def stopping(self) -> None:
        pass

    def owned_groups(self) -> list[int] | None:
        return None

    def node_figures(self) -> tuple[Scope, dict[str, str] | None, int | None]:
        return self.owned_groups, None, None

    def close(self) -> None:
        pass

"""This process's slot group in a cluster: the hooks `Server` (app.py) calls, as hooks.py lists them.

    start          (at start-up, startup.py) the map's watch begins: links and `hello` need every owner's address
    replay         the group's records up to this node's takeover: standing by may take hours
    serve          this process owns the group now: its entry in the map, the hand-off requests
    hands_off      a node asked for the group: the log marks it for that node; drain and stop (the node starts
                   this process again, as a standby)
    stopping       a planned stop: any standby may take over at once, not after the lease
    close          the group's Server ended: its map hears no more, its standby is reported no more
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..workers.links import notice_dead_peer
from .candidacy import Candidacy
from .election import HandOffRequests, Standby, read_as_candidate
from .hooks import Scope
from .map import ClusterMap, NodeDir, SharedMap

if TYPE_CHECKING:
    from ..edges.config import Config
    from ..edges.sessions import Tokens
    from ..journal.jetstream_log import JetStreamLog
    from ..journal.journal import Log
    from ..workers.peers import Peers

log = logging.getLogger("mqks.cluster")

DIAL_RETRY_SECONDS = 0.2  # a group's owner unknown or unreachable: dial again after this
# how long a router trusts the bindings of a group it lost its link to, in leases: long enough for the group to fail
# over and the new owner's entry to be read (a lease, a claim's delay, the recovery), whose refusals would otherwise
# stop every confirmed publish of the router; an owner refuses new bindings that long after losing a router's link
BINDINGS_TRUST_LEASES = 3


def owner_description(config: Config) -> str:
    """How this process describes itself as a group's owner (in its stream and its owner ping)."""
    return f"node {config.node} ({config.advertise or config.host}:{config.port} pid {os.getpid()})"


class ClusterGroup:
    """One slot group of the cluster, as this process takes part in it: standby first, then maybe owner.

    `link_tls` is (what the link port accepts with, what it dials with) when the nodes have --tls-cert;
    `node_root_pid` the process whose children /metrics sums for the node.
    """

    links_over_tcp = True
    shares_metrics_port = True

    def __init__(self, config: Config, stream_log: JetStreamLog, on_map_change: Callable[[int], None],
                 shared_map: SharedMap | None = None, tokens: Tokens | None = None,
                 link_tls: tuple[ssl.SSLContext, ssl.SSLContext] | None = None, node_root_pid: int = 0) -> None:
        assert config.cluster is not None and config.node is not None
        self.config = config
        self.tokens = tokens
        # links cross hosts: with tokens, a link's hello carries one
        self.check_link_token: Callable[[bytes], bool] | None = tokens.check_link if tokens is not None else None
        self.node_root_pid = node_root_pid
        self.stream_log = stream_log
        self.group = config.worker_index or 0
        self.node_dir = NodeDir(config.run_dir or ".")
        self.candidacy = Candidacy(config.cluster, config.node, self.group, config.lease_seconds,
                                   owned_here=self.node_dir.owned, may_pull=self.node_dir.take_pull_turn,
                                   end_pull=self.node_dir.end_pull_turn)
        self.map = ClusterMap(stream_log.bridge, self.candidacy, config.log_replicas, on_map_change, shared_map)
        self.peers: Peers | None = None  # the serving Server's, once it links
        self.hand_offs = HandOffRequests(config.node, stream_log.owner, stream_log.wake)
        accepts_with, dials_with = link_tls or (None, None)
        self.link_tls: ssl.SSLContext | None = accepts_with
        self.map.link_tls = dials_with

    def start(self) -> None:
        self.map.watch()

    def close(self) -> None:
        """The group's `Server` ended (the process goes on, and may serve the group again)."""
        self.map.close()

    def link(self, peers: Peers) -> None:
        """The groups' owners are on any node: links go over TCP to the address the map names, and prove
        themselves with the cluster's secret (the token file's `[cluster] secret`; a plain token file has none:
        its first token then), never a user's token."""
        peers.dial = self.map.dial
        peers.unit = "group"
        peers.address_of = self.map.address
        peers.owner_epoch = lambda group: self.map.entries.get(group, {}).get("epoch")
        peers.connect_retry_seconds = DIAL_RETRY_SECONDS
        # a lost link's bindings route for a few leases (a failover and the new owner's entry read), never longer
        # (workers/bindings_trust.py)
        lease = self.config.lease_seconds
        peers.trusts.seconds = peers.promises.seconds = BINDINGS_TRUST_LEASES * lease
        peers.promises.lease_seconds = lease
        self.peers = peers
        tokens = self.tokens
        token = None if tokens is None else tokens.cluster_secret or (tokens.tokens[0] if tokens.tokens else None)
        if token is not None:
            peers.link_hello = b"- _link %d %b\n" % (peers.worker, token)

    def link_accepted(self, sock: socket.socket) -> None:
        notice_dead_peer(sock)  # from another host, which a partition may cut off

    def replay(self, journal_log: Log, repair: bool) -> Iterator[list[bytes]]:
        """The group's records up to this node's takeover record (the journal's recovery reads them)."""
        return read_as_candidate(self.stream_log, Standby(self.candidacy, self.stream_log, self.map))

    def hands_off(self) -> bool:
        """True once another node asked for this group: the log is marked for that node, and this owner stops."""
        move_to = self.hand_offs.move_to
        if move_to is None:
            return False
        log.warning("handing this group over to node %s: draining, then stopping", move_to)
        self.stream_log.handoff_to = move_to
        return True

    def stopping(self) -> None:
        """A planned stop: any standby may take over at once, not after the lease."""
        stream_log = self.stream_log
        if stream_log.fenced_by is None and stream_log.handoff_to is None:
            stream_log.handoff_to = "*"

    def owned_groups(self) -> list[int]:
        """The groups this node owns now: its /healthz answers for them, another node's trouble is that node's."""
        return self.node_dir.owned_groups()

    def node_figures(self) -> tuple[Scope, dict[str, str] | None, int | None]:
        """/metrics of a node: the groups it owns now, its labels, and the process whose children it sums."""
        config = self.config
        assert config.cluster is not None and config.node is not None
        return self.owned_groups, {"cluster": config.cluster, "node": config.node}, self.node_root_pid

    def serve(self, direct_port: int, link_port: int, tls_port: int | None) -> None:
        """This process owns its group and listens: put its entry in the map (the other groups' owners link here
        once they read it), and answer requests to hand it over."""
        config = self.config
        about: dict[str, Any] = {"group": self.group, "node": config.node, "epoch": self.stream_log.epoch,
                                 "host": config.advertise or config.host, "port": direct_port, "link_port": link_port,
                                 "public_port": config.port or None, "pid": os.getpid()}
        if tls_port is not None:
            about["tls_port"] = tls_port
        self.map.entries[self.group] = about
        # before any listener: a binding made here could miss a router of the old owner's; the first owner (epoch 1)
        # had none, and a router without a group's bindings confirms no publish
        if self.peers is not None and self.stream_log.epoch > 1:
            self.peers.promises.took_over([group for group in range(self.peers.count) if group != self.group])
        self.map.start(about, still_owner=lambda: self.stream_log.fenced_by is None)
        self.map.serve_hand_offs(self.stream_log.name, self.hand_offs)
        if config.run_dir is not None:
            self.node_dir.owner_of(self.group)

    def hello_fields(self, groups: int) -> dict[str, Any]:
        """`hello`'s cluster and node, and `direct`: every group's owner as the map names it (None where none is
        known yet)."""
        direct = []
        for group in range(groups):
            entry = self.map.entries.get(group, {})
            direct.append({"worker": group, "host": entry.get("host"), "port": entry.get("port"), "unix": None,
                           "tls_port": entry.get("tls_port"), "node": entry.get("node"), "epoch": entry.get("epoch")})
        return {"cluster": self.config.cluster, "node": self.config.node, "direct": direct}

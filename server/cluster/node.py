"""This process's slot group in a cluster: what `Server` (app.py) asks the cluster layer, in a few places.

    start          the map's watch begins (links and `hello` need every owner's address)
    close          the group's Server ended: its map hears no more, its standby is reported no more
    replay         the group's records up to this node's takeover: standing by may take hours
    serve          this process owns the group now: its entry in the map, the hand-off requests
    move_to        a node asked for the group: drain and stop (the node starts this process again, as a standby)
    topology       `hello`'s addresses of every group's owner
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .candidacy import Candidacy
from .election import HandOffRequests, Standby, replay_as_candidate
from .map import ClusterMap, NodeDir, SharedMap

if TYPE_CHECKING:
    from ..journal.jetstream_log import JetStreamLog
    from ..node.config import Config


def owner_description(config: Config) -> str:
    """How this process describes itself as a group's owner (in its stream and its owner ping)."""
    return f"node {config.node} ({config.advertise or config.host}:{config.port} pid {os.getpid()})"


class ClusterGroup:
    """One slot group of the cluster, as this process takes part in it: standby first, then maybe owner."""

    def __init__(self, config: Config, stream_log: JetStreamLog, on_map_change: Callable[[int], None],
                 shared_map: SharedMap | None = None) -> None:
        assert config.cluster is not None and config.node is not None
        self.config = config
        self.stream_log = stream_log
        self.group = config.worker_index or 0
        self.node_dir = NodeDir(config.run_dir or ".")
        self.candidacy = Candidacy(config.cluster, config.node, self.group, config.lease_seconds,
                                   owned_here=self.node_dir.owned, may_pull=self.node_dir.take_pull_turn,
                                   end_pull=self.node_dir.end_pull_turn)
        self.map = ClusterMap(stream_log.bridge, self.candidacy, config.log_replicas, on_map_change, shared_map)
        self.hand_offs = HandOffRequests(config.node, stream_log.owner, stream_log.wake)

    def start(self) -> None:
        self.map.watch()

    def close(self) -> None:
        """The group's `Server` ended (the process goes on, and may serve the group again)."""
        self.map.close()

    def replay(self) -> Iterator[bytes]:
        """The group's records up to this node's takeover record (the journal's recovery reads them)."""
        return replay_as_candidate(self.stream_log, Standby(self.candidacy, self.stream_log, self.map))

    @property
    def move_to(self) -> str | None:
        """The node this owner was asked to hand its group to, once asked."""
        return self.hand_offs.move_to

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
        self.map.start(about, still_owner=lambda: self.stream_log.fenced_by is None)
        self.map.serve_hand_offs(self.stream_log.name, self.hand_offs)
        if config.run_dir is not None:
            self.node_dir.owner_of(self.group)

    def topology(self, groups: int) -> list[dict[str, Any]]:
        """`hello`'s `direct`: every group's owner as the map names it (None where none is known yet)."""
        direct = []
        for group in range(groups):
            entry = self.map.entries.get(group, {})
            direct.append({"worker": group, "host": entry.get("host"), "port": entry.get("port"), "unix": None,
                           "tls_port": entry.get("tls_port"), "node": entry.get("node"), "epoch": entry.get("epoch")})
        return direct

    def address(self, group: int) -> tuple[str, int] | None:
        return self.map.address(group)

    def dial(self, group: int) -> socket.socket:
        return self.map.dial(group)

"""A cluster node's claim on one slot group: the lease, the delays before a claim, and what the node's other
processes tell it (how many groups it owns, whether one of them is pulling a group now)."""

from __future__ import annotations

import zlib
from collections.abc import Callable

from ...common.cluster_names import bucket_of

CLAIM_DELAY_PER_GROUP_SECONDS = 0.7  # a claim waits this long per group its node owns already
# at most this (plus the spread below): a lost node's groups are claimed by the lease plus this (and a standby's 1 s
# look), so at the default lease of 12 s every group of a killed node is served again within 16 s; 3 s measured
# 15.0-15.6 s
CLAIM_DELAY_CAP_SECONDS = 2.0
CLAIM_SPREAD_SECONDS = 1.0  # ... plus up to this, by a stable hash, once the node owns a group


class Candidacy:
    """A node's standby for one group's stream: it takes the group over when its owner has appended nothing for
    `lease_seconds` (an idle owner sends a heartbeat every quarter lease), or when the owner hands it over."""

    __slots__ = ("cluster", "node", "group", "lease_seconds", "spread_seconds", "owned_here", "may_pull", "end_pull")

    def __init__(self, cluster: str, node: str, group: int, lease_seconds: float, spread_seconds: float = 3.0,
                 owned_here: Callable[[], int] = lambda: 0, may_pull: Callable[[], bool] = lambda: False,
                 end_pull: Callable[[], None] = lambda: None) -> None:
        self.owned_here = owned_here  # groups this node owns now (its processes tell each other in its run dir)
        self.may_pull = may_pull  # True once per node at a time: this standby may ask for its group (balance)
        self.end_pull = end_pull  # the group this standby asked for will not come: another standby may ask
        self.cluster = cluster
        self.node = node
        self.group = group
        self.lease_seconds = lease_seconds
        self.spread_seconds = spread_seconds

    @property
    def bucket(self) -> str:
        """The cluster's key-value bucket: who owns each group (for clients and links), how far standbys are."""
        return bucket_of(self.cluster)

    @property
    def heartbeat_seconds(self) -> float:
        return self.lease_seconds / 4

    @property
    def first_claim_delay(self) -> float:
        """A group nobody owns goes to the node whose delay is shortest: spread by a stable hash, so nodes started
        together share the groups instead of the first one taking all."""
        return zlib.crc32(f"{self.group}:{self.node}".encode()) % 1000 / 1000 * self.spread_seconds

    def claim_delay(self, fewest_elsewhere: int = 0) -> float:
        """After the lease: the node that owns fewer groups claims first, so nodes started together share the
        groups, and the groups of a lost node spread over the others. Nodes that own as many (or both past the cap)
        are ordered by a stable hash of group and node: their standbys all claimed at once, and one node took every
        group of the lost one, which balancing then moved again (the partition test: 6 groups in one millisecond).
        Only the groups beyond `fewest_elsewhere` (the fewest another node that may claim owns) wait: nodes that own
        as many waited the cap all the same, 2 s of every failover (issue 56)."""
        owned = self.owned_here()
        if not owned:
            return 0.0
        spread = zlib.crc32(f"claim:{self.group}:{self.node}".encode()) % 1000 / 1000 * CLAIM_SPREAD_SECONDS
        beyond = max(0, owned - fewest_elsewhere)
        return min(CLAIM_DELAY_CAP_SECONDS, beyond * CLAIM_DELAY_PER_GROUP_SECONDS) + spread

"""A host cut off the network and put back (issue 56): three hosts, each a network namespace holding one NATS server
and one MQKS node; a client on a fourth host publishing confirmed messages to 30 queues through the majority; the
node owning the most groups cut off for 20 s, then healed (tests/partition_lab.py, tests/netns.py).

The checks are the issue's: nothing confirmed is lost, the cut node confirms nothing, the majority's queues keep
confirming and their groups keep their owners, and after the heal every queue confirms again, status shows every
group owned, the cut node owns a group again, and no node claims a group (nobody died: a claim then is churn). The
bounds are the issue's targets, all liveness bounds (how long before something happens again), none a speed. Every
miss is reported at once, with the round's timeline, the client's errors and the nodes' log lines. Skipped where
namespaces cannot be made (not root, `ip netns add` refused).
"""

from __future__ import annotations

import netns
import pytest
from partition_lab import Lab, Round, Settings

from mqks.server.cluster.election import BALANCE_SECONDS

pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")

pytestmark = pytest.mark.timeout(240)

MAJORITY_GAP_SECONDS = 12.0  # the longest a majority's queue may go without a confirm while a host is cut
SERVED_AGAIN_SECONDS = 20.0  # the cut node's queues served by the majority, from the cut
HEAL_CONFIRMS_SECONDS = 20.0  # every queue confirming again, from the heal (NATS's own election included)
HEAL_OWNED_SECONDS = 30.0  # status shows every group owned and answering, from the heal
# the cut node owns a group again within one balancing period of NATS taking writes (its server healthy, its leaders
# elected): NATS's own return after a heal (its leaders re-elected 4-9 s after the routes, docs/cluster.md) is before
# that and not MQKS's to shorten
OWNS_AGAIN_AFTER_NATS_SECONDS = BALANCE_SECONDS


@pytest.fixture
def lab(tmp_path):
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(reason)
    with Lab(tmp_path, Settings()) as made:
        yield made


def test_a_cut_host_loses_nothing_confirms_nothing_and_the_cluster_serves_every_queue_after_the_heal(lab):
    """Every target is checked and every miss named together, with the round's timeline and the nodes' log lines
    that explain it."""
    scenario = Round(lab)
    try:
        scenario.run()
        figures = scenario.figures()
    finally:
        scenario.close()
        print(scenario.report())
    print(figures.row())
    missed = []
    if figures.lost:
        missed.append(f"{figures.lost} of {figures.confirmed} confirmed messages never delivered")
    if figures.minority_confirms:
        missed.append(f"the cut node confirmed {figures.minority_confirms} publishes while cut off")
    if figures.majority_gap > MAJORITY_GAP_SECONDS:
        missed.append(f"a queue of a group owned in the majority went {figures.majority_gap:.1f} s without a "
                      f"confirm while {figures.cut_node} was cut (at most {MAJORITY_GAP_SECONDS:g})")
    if figures.majority_owner_changes:
        moved = [group for group, owners in figures.majority_owner_history.items() if len(owners) > 1]
        missed.append(f"groups owned in the majority changed owner while {figures.cut_node} was cut: "
                      f"{ {group: figures.majority_owner_history[group] for group in moved} }; what the nodes said "
                      f"of them:\n{scenario.group_lines(moved)}")
    if figures.cut_served_again is None or figures.cut_served_again > SERVED_AGAIN_SECONDS:
        missed.append(f"the cut node's queues were served again {figures.cut_served_again} s after the cut "
                      f"(at most {SERVED_AGAIN_SECONDS:g}; None: not before the heal)")
    if (figures.heal_first_confirm is None or figures.heal_first_confirm > HEAL_CONFIRMS_SECONDS
            or figures.heal_gap > HEAL_CONFIRMS_SECONDS):
        missed.append(f"after the heal, a queue went {figures.heal_gap:.1f} s without a confirm, and every queue had "
                      f"confirmed once {figures.heal_first_confirm} s after it (at most {HEAL_CONFIRMS_SECONDS:g})")
    if figures.status_owned_after_heal is None or figures.status_owned_after_heal > HEAL_OWNED_SECONDS:
        missed.append(f"status showed every group owned and answering {figures.status_owned_after_heal} s after "
                      f"the heal (at most {HEAL_OWNED_SECONDS:g}); its failures: {figures.status_failures[:5]}")
    if figures.cut_node_owns_after_heal is None or (figures.cut_node_owns_after_nats or 0.0) > \
            OWNS_AGAIN_AFTER_NATS_SECONDS:
        missed.append(f"the cut node owned a group again {figures.cut_node_owns_after_heal} s after the heal, its "
                      f"NATS server healthy at {figures.nats_current_after_heal} s and its last leader elected at "
                      f"{figures.nats_leaders_after_heal} s (at most {OWNS_AGAIN_AFTER_NATS_SECONDS:g} s after both)")
    if figures.claims_after_heal or figures.lost_claims_after_heal:
        missed.append(f"after the heal, nodes claimed {figures.claims_after_heal} groups from a silent owner and "
                      f"{figures.lost_claims_after_heal} takeovers were refused: nobody died, each is churn")
    assert not missed, "\n".join([*missed, figures.row(), f"client errors: {figures.errors}", scenario.report()])

"""Placement: which worker process owns a queue, as the broker's modules import it.

The functions live in common/slots.py, which the clients read too (they never import server/): one slot
function for the broker, the clients and the log's re-sharding. The same function objects, so a call costs
what it did.
"""

from __future__ import annotations

from ...common.slots import SLOTS, owner_of, owner_of_slot, slot_of, slot_ranges

__all__ = ["SLOTS", "owner_of", "owner_of_slot", "slot_of", "slot_ranges"]

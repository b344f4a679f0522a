"""The NATS transport (the cluster extra), below the journal: what the replicated log and the cluster layer talk
to NATS through, and nothing of theirs.

    nats_bridge.py  nats-py's asyncio loop in its own thread, for the JetStream API; a process's SharedNats
    hub_nats.py     a core NATS connection the hub reads and writes itself (frames, PubAcks, heartbeats)

It imports nothing of the broker's but common/ (tests/unit/test_layers.py).
"""

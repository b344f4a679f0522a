"""The cluster layer (`mqksd --cluster NAME --node ID`): who owns each slot group, above a storage-only log.

    node_process.py  a node's process: several groups, each a Server in a greenlet of its own
    hooks.py      what app.Server asks of the layer, as named hooks; NoCluster for a broker without one
    group.py      ClusterGroup: those hooks for this process's group (links, replay, serve, hand-off)
    candidacy.py  a node's claim on one group: its lease, claim delays, the node's other processes
    lease.py      the owner's side of that lease, in its log's writer: heartbeats, step-down, hand-off frame
    election.py   standing by (follow the stream, claim after a lease of silence, balance) and the takeover
    map.py        the cluster's bucket: where each owner listens, pins, standby reports, hand-off requests
    layout.py     start-up checks against what NATS already holds (group count, node ids in use)

The operator's `mqks cluster status|move|unpin|remove` reads the same bucket from the client side
(client/cluster.py), never from a broker.

The log below (server/journal/jetstream_log.py) only stores: append, commit, replay to the tail, follow the
tail, and the conditional append (expecting the last sequence) a takeover is. Nothing below imports this layer:
lease.py plugs into the writer through its `OwnerLease` hooks (server/journal/stream_writer.py).
"""

"""Worker processes: where a line runs (relay.py), this worker's view of the others (peers.py), the links between
them (links.py) and their frames (frames.py), a publish forwarded to the others (forwarding.py), their bindings
(replica.py)."""

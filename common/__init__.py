"""What the broker and its clients both read, so neither imports the other: which worker owns a queue
(`slots.py`), the figures table (`stats`), how NATS URLs are written and shown, and the names a cluster gives
its streams and bucket."""

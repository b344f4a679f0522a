"""An mqksd process's edges: client connections, listeners, auth and TLS, settings, the memory guard,
/metrics, the supervisor, re-sharding."""

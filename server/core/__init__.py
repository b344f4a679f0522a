"""One broker's state: queues and their messages, consumers, routing, timers, leases, schedules, requests."""

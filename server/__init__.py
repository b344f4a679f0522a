"""The MQKS broker: `mqksd`, or `python -m mqks.server`.

Read it in the order a line travels, each module importing only the ones after it:
connection.py (socket) -> protocol.py (lines) -> actions.py (declared actions, handlers)
-> workers.py (placement, flush) -> state.py and routing.py (the broker of one worker)
-> outbox.py (bytes owed to a client), flushed back out by the connection. timers.py is
the process's timer heap, config.py its settings; app.py wires them: CLI, listener, signals.
"""

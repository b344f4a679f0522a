"""The MQKS broker: `mqksd`, or `python -m mqks.server`.

Read it in the order a line travels: connection.py (socket), protocol.py (lines),
actions.py (dispatch and handlers), state.py and routing.py (the broker), then back out
through the connection's output buffer. app.py holds the process: CLI, shards, signals.
"""

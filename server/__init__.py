"""The MQKS broker: `mqksd`, or `python -m mqks.server`.

The folders are the layers, each importing only the ones below it: cli.py and app.py (the
process) -> node/ (connections, listeners, auth, settings, supervisor) -> workers/ (the relay
and the links between worker processes) -> dispatch/ (the declared actions, the process
context) -> core/ (one broker's state) -> journal/ (the write-ahead log) -> wire/ (lines and
bytes). docs/internals.md follows one line through them.
"""

from . import build

build.choose()  # before any module of the hot path is imported: compiled, or its plain sources (build.py)

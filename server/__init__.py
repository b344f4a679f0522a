"""The MQKS broker: `mqksd`, or `python -m mqks.server`.

The folders are the layers, each importing only the ones below it: cli.py and app.py (the
process) -> edges/ (connections, listeners, auth, settings, supervisor) -> cluster/ (with
--cluster: who owns each slot group) -> workers/ (the relay and the links between worker
processes) -> dispatch/ (the declared actions, the process context) -> core/ (one broker's
state) -> journal/ (the write-ahead log) -> nats_io/ (NATS, under the replicated log) -> wire/
(lines and bytes). docs/internals.md follows one line through them; its "Words" say what a
process, worker, node, group, owner and peer are.
"""

from . import build

build.choose()  # before any module of the hot path is imported: compiled, or its plain sources (build.py)

"""Can slot groups share a JetStream stream? NATS's per-subject fencing under 16 single writers, measured.

Issue 40's next step would put several groups in one stream, each on a subject of its own, an owner's
frame fenced with `Nats-Expected-Last-Subject-Sequence` (its previous frame's sequence) instead of the
stream-level `Nats-Expected-Last-Sequence` of today's stream per group. This probe runs what such owners
would: on a fresh three-node NATS cluster (R3, the cluster extra's nats-server), 16 writers on one stream,
one subject and one 5 KB frame in flight each, every frame with a `Nats-Msg-Id`, for `--seconds`:

- `10164` ("wrong last sequence", no number) answers a frame whose expected sequence was right: a rejection
  of the moment, not a fence. The writer sends the same frame again (same Msg-Id) after 5 ms; the probe
  counts those, and checks that each was then stored once (no duplicate PubAck, the stream holds exactly
  the frames acknowledged).
- A real rival (another writer appended to the subject since) gets `10071` with the subject's last sequence
  in the text: the probe checks that too, once, at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from typing import Any

from mqks.client import nats_local

BODY = b"x" * 5000
RETRY_SECONDS = 0.005


async def probe(urls: list[str], seconds: float, writers: int) -> dict[str, Any]:
    import nats
    from nats.js.errors import APIError

    nc = await nats.connect(servers=urls)
    js = nc.jetstream()
    stream = f"FENCE{os.getpid()}"
    await js.add_stream(name=stream, subjects=[f"{stream}.*"], num_replicas=3, duplicate_window=120)
    found: dict[str, Any] = {"frames": 0, "transient_10164": 0, "duplicates": 0, "other_errors": []}
    stop = time.monotonic() + seconds

    async def owner(group: int) -> None:
        last, k = 0, 0
        while time.monotonic() < stop:
            headers = {"Nats-Msg-Id": f"{group}-{k}"}
            if last:
                headers["Nats-Expected-Last-Subject-Sequence"] = str(last)
            while True:
                try:
                    ack = await js.publish(f"{stream}.{group}", BODY, headers=headers)
                    break
                except APIError as e:
                    if e.err_code != 10164:
                        found["other_errors"].append([group, k, last, e.err_code, e.description])
                        return
                    found["transient_10164"] += 1
                    await asyncio.sleep(RETRY_SECONDS)
            found["duplicates"] += bool(ack.duplicate)
            last, k = ack.seq, k + 1
            found["frames"] += 1

    started = time.monotonic()
    await asyncio.gather(*(owner(group) for group in range(writers)))
    found["frames_per_second"] = found["frames"] / (time.monotonic() - started)
    found["stored"] = (await js.stream_info(stream)).state.messages
    # a stale owner: its subject was appended to since its last frame
    first = await js.publish(f"{stream}.rival", b"owner")
    await js.publish(f"{stream}.rival", b"the rival", headers={"Nats-Expected-Last-Subject-Sequence": str(first.seq)})
    try:
        await js.publish(f"{stream}.rival", b"stale", headers={"Nats-Expected-Last-Subject-Sequence": str(first.seq)})
        found["rival"] = "stored: NOT fenced"
    except APIError as e:
        found["rival"] = f"{e.err_code} {e.description}"
    await js.delete_stream(stream)
    await nc.close()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.subject_fencing", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--writers", type=int, default=16)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    directory = tempfile.mkdtemp(prefix="mqks-bench-nats-")
    try:
        nodes = nats_local.up(directory, 3, "fence")
        urls = [node.url for node in nodes]
        results = [asyncio.run(probe(urls, args.seconds, args.writers)) for _ in range(args.runs)]
    finally:
        try:
            nats_local.down(directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    for result in results:
        print(json.dumps(result))
    safe = all(r["stored"] == r["frames"] and not r["duplicates"] and not r["other_errors"]
               and r["rival"].startswith("10071") for r in results)
    print(f"{sum(r['transient_10164'] for r in results)} transient 10164s in {sum(r['frames'] for r in results)} "
          f"frames; each sent again was stored once: {safe}")
    return 0 if safe else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""A host cut off a three-host cluster and healed, again and again (issue 56): what a partition and a heal cost.

    sudo .venv/bin/python -m bench.partition [--runs 10] [--cut-seconds 30] [--rate 800] [--groups 16] [--json FILE]

Each run builds tests/cluster/test_partition.py's lab afresh (tests/partition_lab.py): three hosts, each a network
namespace on a private bridge holding one NATS server (one three-node JetStream cluster, `sync_interval: always`)
and one MQKS node; a client host publishing `--confirm` to `--queues` queues through a node of the majority (an ok
counts, an error sends the same body again); a small client on the cut host publishing to its own node. Once every
group is owned and steady, the host whose node owns the most groups is cut off the bridge (frames dropped both ways)
for `--cut-seconds`, then healed; the run ends when status shows every group owned, the cut node owns one again and
every queue confirmed after that; then every queue is drained. Per run it prints the longest gap between confirms on
the majority's queues and on the cut node's while cut, when the majority served the cut node's queues again, what
the heal cost (longest gap after it, every queue's first confirm after it, when status showed every group owned),
the majority's groups' owner changes while cut, the cut node's confirms while cut, and the confirmed messages lost;
then min, median and max over the runs, and the same as JSON in bench/results/. Needs root (`ip netns`) and the
cluster extra; every namespace and process is removed after each run. The node and NATS logs of each run stay in
bench/results/partition-logs/STAMP/ (not under bench/results/logs/, which bench.run empties as it starts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

from .run import RESULTS_DIR, git_revision

# the lab is the partition test's own: one setup measured and tested
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import netns
from partition_lab import Figures, Lab, Round, Settings

SUMMARY = (  # (Figures field, what it is)
    ("majority_gap", "longest confirm gap, majority's queues, while cut (s)"),
    ("cut_gap", "longest confirm gap, cut node's queues, while cut (s)"),
    ("cut_served_again", "cut node's queues served again, from the cut (s)"),
    ("heal_gap", "longest confirm gap of any queue after the heal (s)"),
    ("heal_first_confirm", "every queue confirmed once, from the heal (s)"),
    ("heal_stalled_queues", "queues stalled 2 s or more after the heal"),
    ("status_owned_after_heal", "status shows every group owned, from the heal (s)"),
    ("nats_routes_after_heal", "cut host's NATS server routed again, from the heal (s)"),
    ("nats_leaders_after_heal", "NATS's last leader elected after it, from the heal (s)"),
    ("nats_current_after_heal", "cut host's NATS server current again, from the heal (s)"),
    ("cut_node_owns_after_heal", "cut node owns a group again, from the heal (s)"),
    ("cut_node_owns_after_nats", "... from NATS taking writes again (s)"),
    ("majority_owner_changes", "owner changes of the majority's groups while cut"),
    ("owner_changes_after_heal", "owner changes of any group after the heal"),
    ("claims_after_heal", "groups claimed from a silent owner after the heal"),
    ("lost_claims_after_heal", "takeovers refused after the heal (failed claims)"),
    ("minority_confirms", "confirms by the cut node while cut"),
    ("lost", "confirmed messages lost"),
    ("rate", "confirmed msg/s before the cut"),
)


def summary(figures: list[Figures]) -> list[str]:
    """min / median / max of each figure over the runs; `-` counts runs that never got there."""
    lines = []
    for name, what in SUMMARY:
        values = [getattr(f, name) for f in figures]
        known = [float(v) for v in values if v is not None]
        missing = len(values) - len(known)
        if not known:
            lines.append(f"{what:<55} never ({missing} runs)")
            continue
        shown = f"{min(known):8.1f} {statistics.median(known):8.1f} {max(known):8.1f}"
        lines.append(f"{what:<55} {shown}" + (f"   ({missing} runs never)" if missing else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.partition", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cut-seconds", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=800.0, help="confirmed msg/s over all queues, at most")
    parser.add_argument("--queues", type=int, default=30)
    parser.add_argument("--publishers", type=int, default=4, help="per queue, each one publish at a time")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--processes", type=int, default=2, help="per node")
    parser.add_argument("--lease", type=float, default=12.0)
    parser.add_argument("--nats-ping", type=float, default=2.0,
                        help="NATS servers' ping_interval in seconds (ping_max 2), as `mqks nats up` writes it; "
                             "0: NATS's own default (2 min) (default: %(default)s)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    # a SIGTERM unwinds like Ctrl-C: each run's namespaces and processes are removed on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    reason = netns.unavailable()
    if reason is not None:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    settings = Settings(groups=args.groups, processes=args.processes, lease_seconds=args.lease, queues=args.queues,
                        rate=args.rate, publishers=args.publishers, cut_seconds=args.cut_seconds,
                        nats_ping_seconds=args.nats_ping or None)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logs = Path(RESULTS_DIR) / "partition-logs" / stamp
    print(f"{args.runs} runs of {settings}; logs in {logs}", flush=True)
    figures: list[Figures] = []
    failed: list[str] = []
    for run in range(args.runs):
        directory = logs / f"run-{run + 1}"
        directory.mkdir(parents=True)
        try:
            with Lab(directory, settings) as lab:
                scenario = Round(lab)
                try:
                    scenario.run()
                    figures.append(scenario.figures())
                finally:
                    scenario.close()
                    (directory / "round.txt").write_text(scenario.report())
        except Exception as e:  # one run's failure is reported; the others still run
            failed.append(f"run {run + 1}: {e!r}")
            print(f"run {run + 1} failed: {traceback.format_exc(limit=3)}", flush=True)
            continue
        finally:
            for store in directory.glob("js-*"):  # the streams' files: megabytes a run, of no use to a reader
                shutil.rmtree(store, ignore_errors=True)
        print(f"run {run + 1}: {figures[-1].row()}", flush=True)
        if figures[-1].errors:
            print(f"        client errors: {figures[-1].errors}", flush=True)
        if figures[-1].owner_history_after_heal:
            print(f"        owners after the heal: {figures[-1].owner_history_after_heal}", flush=True)
    print(f"\n{len(figures)} runs of {args.runs} ({args.cut_seconds:g} s cuts, {args.groups} groups, "
          f"lease {args.lease:g} s, {args.queues} queues):{'':>5} min   median      max")
    for line in summary(figures):
        print(line)
    result = {"revision": git_revision(), "settings": dataclasses.asdict(settings), "failed": failed,
              "runs": [dataclasses.asdict(f) for f in figures]}
    path = args.json or os.path.join(RESULTS_DIR, f"partition-{stamp}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(f"JSON: {path}")
    return 0 if figures and not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""What token scopes cost (issue 42): w1 (one publisher, one consumer, 100 B) auto-ack and with one ack line per
message, on a broker without auth, with a full-access token and with a scoped token, in one run.

    .venv/bin/python -m bench.scopes [--messages N] [--reps N]

(from the repository root; pinned: broker on core 0, generator on core 1; repetitions interleaved, medians). A
full-access session runs the plain handler table; a scoped one checks each event and queue name once and then
looks it up (server/dispatch/scopes.py): the table shows both beside no auth at all.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from . import loadgen, peers
from .loadgen import Flow, Mqks
from .run import LOG_DIR

SERVER_CORE, GENERATOR_CORE = 0, 1
FULL, SCOPED = b"full-access-bench-token-0123", b"scoped-bench-token-0123456789"
TOKENS = f"""
[[token]]
name = "full"
secret = "{FULL.decode()}"
publish = ["*"]
consume = ["*"]
manage = true

[[token]]
name = "scoped"
secret = "{SCOPED.decode()}"
publish = ["bench.*"]
consume = ["bench.*"]
"""
VARIANTS = {"auto-ack": {}, "one ack line per message": {"manual_ack": True, "ack_each": True}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scopes", description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    os.makedirs(LOG_DIR, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(TOKENS)
        token_file = f.name
    counter = loadgen.build_counter()
    servers = {"no auth": peers.start_mqks(SERVER_CORE, LOG_DIR, pure=True),
               "token file": peers.start_mqks(SERVER_CORE, LOG_DIR, pure=True,
                                              extra_args=("--auth-token-file", token_file))}
    cells = [(variant, label, server, token) for variant in VARIANTS
             for label, server, token in (("no auth", "no auth", None), ("full-access token", "token file", FULL),
                                          ("scoped token", "token file", SCOPED))]
    rates: dict[tuple[str, str], list[float]] = {(variant, label): [] for variant, label, _, _ in cells}
    try:
        for _ in range(args.reps):
            for variant, label, server_name, token in cells:
                server = servers[server_name]
                flow = Flow(proto=Mqks(token=token, **VARIANTS[variant]), host=server.host, port=server.port,
                            n=args.messages, core=GENERATOR_CORE, counter_binary=counter)
                result = loadgen.run_flow(flow)
                if not result.ok or result.errors:
                    raise SystemExit(f"{variant}, {label}: {result.note or f'{result.errors} errors'}")
                rates[variant, label].append(result.rate)
    finally:
        for server in servers.values():
            server.stop()
        os.unlink(token_file)
    print(f"w1, {args.messages:,} messages of 100 B, medians of {args.reps} (plain sources, pinned)")
    print(f"{'variant':<26} {'no auth':>12} {'full token':>12} {'scoped token':>13} {'scoped/full':>12}")
    for variant in VARIANTS:
        none, full, scoped = (statistics.median(rates[variant, label])
                              for label in ("no auth", "full-access token", "scoped token"))
        print(f"{variant:<26} {none:>12,.0f} {full:>12,.0f} {scoped:>13,.0f} {scoped / full:>11.2f}x")


if __name__ == "__main__":
    main()

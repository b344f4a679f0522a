#!/usr/bin/env bash
# The whole suite, as the README's test command runs it:
#   1. the unit tier (in process, seconds): a broken build fails first and fast;
#   2. the cluster tier (NATS servers and MQKS nodes) beside every other tier (e2e, spark, browser), then the core
#      tests again on the hot path's plain sources (MQKS_PURE=1): the cluster tests spend most of their time waiting
#      out leases and failovers, not on the CPU, so the runs share the machine's cores instead of taking turns (the
#      cluster tier is the longest; the plain-source run fits in what is left of it); each run's output is printed
#      whole, the cluster's once it ends.
# Extra arguments go to every pytest run (e.g. -x). Exit 0 only if every run passed.
set -u
cd "$(dirname "$0")/.."
pytest=.venv/bin/pytest

"$pytest" -m unit "$@" || exit 1

cluster_log=$(mktemp)
MQKS_TEST_PORTS_DIR=$(mktemp -d)  # the two runs below never hand out one port twice (tests/helpers.py)
export MQKS_TEST_PORTS_DIR
trap 'rm -rf "$cluster_log" "$MQKS_TEST_PORTS_DIR"' EXIT
"$pytest" -m cluster -p no:cacheprovider "$@" > "$cluster_log" 2>&1 &
cluster_pid=$!
"$pytest" -m "not unit and not cluster" "$@"
others=$?
MQKS_PURE=1 "$pytest" -m core "$@"
plain=$?
wait "$cluster_pid"
cluster=$?
echo "================================ the cluster tier ================================"
cat "$cluster_log"
if [ "$others" != 0 ] || [ "$plain" != 0 ] || [ "$cluster" != 0 ]; then
  echo "tests failed: the e2e, spark and browser tiers exited $others, the core tests on plain sources $plain," \
       "the cluster tier $cluster" >&2
  exit 1
fi

#!/usr/bin/env bash
# The test suite: set up, then pytest (starts its own Prefect API, MLflow stores, torchrun jobs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --ray
# Ray advertises the machine's external address even when told 127.0.0.1: as root, the suite runs
# in a network namespace of its own that has only loopback, so no test can reach another address
# (127.0.0.2 besides 127.0.0.1: Slurm's daemons look up their listening address with
# AI_ADDRCONFIG, which finds nothing where 127.0.0.1 is the only address).
if [ "$(id -u)" = 0 ] && [ -z "${AREAL_EVAL_LOOPBACK_ONLY:-}" ] && command -v unshare >/dev/null; then
  export AREAL_EVAL_LOOPBACK_ONLY=1
  exec unshare --net bash -c 'ip link set lo up && ip addr add 127.0.0.2/8 dev lo && exec "$0" "$@"' "$0" "$@"
fi
# Test files side by side, in the order tests/conftest.py gives them (longest first): most of an
# integration test's time is spent waiting on the processes it starts (torchrun jobs, flow-run
# processes, servers), so one file at a time leaves a core idle. tests/conftest.py picks how many
# (pytest_xdist_auto_num_workers). Add -n 0 to run everything in this one process.
exec .venv/bin/python -m pytest -n auto --dist loadfile --no-loadscope-reorder "$@"

#!/usr/bin/env bash
# The test suite: set up, then pytest (starts its own Prefect API, MLflow stores, torchrun jobs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two test files at a time, in the order tests/conftest.py gives them (longest first): most of a
# test's time is spent waiting on the processes it starts (torchrun jobs, flow-run processes,
# servers), so one file at a time leaves a core idle.
# Add -n 0 to run everything in this one process.
exec .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@"

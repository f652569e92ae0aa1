#!/usr/bin/env bash
# The test suite: set up, then pytest (starts its own Prefect API, MLflow stores, torchrun jobs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two test files at a time, in the order tests/conftest.py gives them (longest first): most of a
# test's time is spent waiting on the processes it starts (torchrun jobs, flow-run processes,
# servers), so one file at a time leaves a core idle.
# AREAL_EVAL_TEST_LANES=0 runs everything in this process (as does -n 0).
exec .venv/bin/python -m pytest -n "${AREAL_EVAL_TEST_LANES:-2}" --dist loadfile --no-loadscope-reorder "$@"

#!/usr/bin/env bash
# The test suite: set up, then pytest (starts its own Prefect API, MLflow stores, torchrun jobs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"

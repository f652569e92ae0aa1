#!/usr/bin/env bash
# The test suite: set up, then pytest (starts its own Prefect API, MLflow stores, torchrun jobs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1
exec .venv/bin/python -m pytest "$@"

#!/usr/bin/env bash
# The demo: set up, then run train-and-evaluate on its embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1
exec .venv/bin/python -m flows.train_and_evaluate "$@"

#!/usr/bin/env bash
# The demo: set up, then run train-and-evaluate on its embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m flows.train_and_evaluate "$@"

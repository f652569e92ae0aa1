#!/usr/bin/env bash
# The demo: set up, then run train-and-evaluate on its embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# A stop prints the command that resumes the run: this one.
AREAL_EVAL_COMMAND="bash scripts/demo.sh" exec .venv/bin/python -m flows.train_and_evaluate "$@"

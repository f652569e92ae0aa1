#!/usr/bin/env bash
# The demo: set up, then run train-and-evaluate on its embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Without a server the flow starts a temporary one; the first run also migrates a fresh Prefect
# database, which on 2 busy cores can take longer than Prefect's 20 s start-up limit.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-120}"
exec .venv/bin/python -m flows.train_and_evaluate "$@"

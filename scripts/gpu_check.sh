#!/usr/bin/env bash
# The library on one NVIDIA GPU, with only torch and transformers installed (no Prefect, no
# MLflow, no install of this package): an nccl process group, training and evaluation on the
# GPU with eval.share_devices, bf16 against float32, generation tokens/s and reward-model pairs/s,
# GPU memory back to its baseline between evaluations, warm torchrun evaluation workers on the
# planned GPU, and the demo's trainer there. Prints one JSON line; under a minute on an H200 (on 2
# CPU cores: `--allow-cpu`, about 50 s; `--small` for a quick look). Never part of CI.
# Figures: docs/devices.md.
#   PYTHON=/path/to/python bash scripts/gpu_check.sh [--allow-cpu] [--small]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
exec "${PYTHON:-python3}" -m areal_eval.diagnostics.gpu_check "$@" 2> >(grep -v -e "it/s]" >&2)

#!/usr/bin/env bash
# The demo: set up, then run train-and-evaluate on its embedded defaults or a preset.
# A preset or override that needs more than the base environment gets it from the set-up:
# --preset smollm2 its converted model, eval.python=.venv-vllm/... the vLLM environment,
# eval.launcher=ray the ray extra.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=()
for arg in "$@"; do
  case "$arg" in
    smollm2) extras+=(--smollm2) ;;
    *.venv-vllm/*) extras+=(--vllm) ;;
    *launcher=ray*) extras+=(--ray) ;;
  esac
done
bash scripts/setup.sh "${extras[@]}"
# Its models are sized for CPU cores: GPUs stay hidden unless CUDA_VISIBLE_DEVICES names some
# (a one-GPU machine has too few for its 2 training ranks; README, "GPUs").
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES-}"
# A stop prints the command that resumes the run: this one.
AREAL_EVAL_COMMAND="bash scripts/demo.sh" exec .venv/bin/python -m flows.train_and_evaluate "$@"

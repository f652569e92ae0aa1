#!/usr/bin/env bash
# Create .venv and install the project with its test extras (skipped when up to date).
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.installed-$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
  # torch first, pinned by constraints.txt (the package itself takes a range), so nothing resolves a CUDA build.
  .venv/bin/pip install -q -c constraints.txt torch
  .venv/bin/pip install -q -c constraints.txt -e '.[test,bench,hf,lm-eval,docs]'
  rm -f .venv/.installed-*
  touch "$stamp"
fi

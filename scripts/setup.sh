#!/usr/bin/env bash
# Create .venv and install the project with its test extras (skipped when up to date).
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
  # torch first, pinned, so nothing resolves a CUDA build.
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e '.[test,bench,hf,lm-eval]'
  rm -f .venv/.installed-*
  touch "$stamp"
fi

"""Shared set-up for benchmarks: a prepared run directory with a reward model checkpoint."""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def prepared_run(name: str, work_dir: Path, **sections):
    """A run directory (data, tokenizer, train spec) with the demo's model size."""
    from areal_eval.config import merge
    from areal_eval.pipeline_config import load_pipeline_config
    from areal_eval.run_setup import prepare_run

    params = merge({"run_name": name, "work_dir": str(work_dir)}, sections)
    cfg = load_pipeline_config(params=params)
    return cfg, prepare_run(cfg)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def emit(result: dict) -> None:
    """The benchmark's result: one JSON line, last on stdout."""
    print(json.dumps(result, sort_keys=True))


median = statistics.median

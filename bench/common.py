"""Shared set-up for benchmarks: a prepared run directory with a reward model checkpoint."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from areal_eval.launchers.local import stay_offline  # noqa: E402 (after the path is set)

stay_offline()


def prepared_run(name: str, work_dir: Path, config: Path | None = None, **sections):
    """A run directory (data, tokenizer, train spec) with the demo's model size, or the
    ``config`` file's (a preset), with ``sections`` over it."""
    from areal_eval.config.parsing import merge
    from areal_eval.pipeline.config import load_pipeline_config
    from areal_eval.pipeline.setup import prepare_run

    params = merge({"run_name": name, "work_dir": str(work_dir)}, sections)
    cfg = load_pipeline_config(config, params=params)
    return cfg, prepare_run(cfg)


def trained_tiny_run(work_dir: Path, name: str = "trained"):
    """A run directory with the demo's reward model trained 12 steps at a tiny size (2 DDP
    ranks, about a minute): checkpoints at steps 0, 4, 8 and 12."""
    from areal_eval.launchers.local import TorchrunJob

    cfg, run = prepared_run(
        name,
        work_dir,
        model={"hidden_size": 32, "num_layers": 1, "num_heads": 2},
        train={"max_steps": 12, "batch_size": 8, "log_every": 4, "save": {"freq_steps": 4}},
        data={"synthetic": {"train_pairs": 256, "valid_pairs": 101}},
        eval={"batch_size": 16},
    )
    job = TorchrunJob("areal_eval.train", ["--config", str(run.train_config)], cfg.train.nproc, run.logs / "train.log")
    job.wait(600)
    job.raise_for_status("training")
    return cfg, run


class ProcessJob:
    """A multiprocessing.Process (a synthetic trainer) as the loop's ``TrainingJob``."""

    def __init__(self, process):
        self.process = process

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout_s: float) -> int:
        self.process.join(timeout_s)
        return self.process.exitcode

    def raise_for_status(self, what: str) -> None:
        if self.process.exitcode:
            raise RuntimeError(f"{what} failed: exit {self.process.exitcode}")


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


def item_curves_from_args(description: str) -> list:
    """The item-level curves named on the command line."""
    import argparse

    from areal_eval.scheduling.curves import read_curves

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("curves", nargs="+", help="item-level curves JSONL")
    return [c for path in parser.parse_args().curves for c in read_curves(path)]

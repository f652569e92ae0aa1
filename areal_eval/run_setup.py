"""Preparing a run directory: data, tokenizer and the training job's spec."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

from areal_eval.pipeline_config import PipelineConfig
from areal_eval.preference_data import SyntheticPreferences, read_pairs, write_pairs
from areal_eval.reward_model import train_tokenizer
from areal_eval.run_dir import RunDir
from areal_eval.train import TrainJobSpec, total_steps


def prepare_run(cfg: PipelineConfig, fresh: bool = True) -> RunDir:
    """Lay out ``cfg.run_root``: validated data files, a tokenizer, ``train_config.json``.

    ``fresh`` removes what an earlier run of the same name left (checkpoints, ledger, logs).
    """
    run = RunDir(cfg.run_root)
    if fresh and run.root.exists():
        shutil.rmtree(run.root)
    run.root.mkdir(parents=True, exist_ok=True)
    if cfg.data.train_path is None or cfg.data.valid_path is None:
        SyntheticPreferences(cfg.data.synthetic).generate(run.data)
    for given, target in ((cfg.data.train_path, run.train_data), (cfg.data.valid_path, run.valid_data)):
        if given is not None:
            write_pairs(target, read_pairs(given))  # validates every row, naming file and line
    if cfg.model.tokenizer_path is None and cfg.model.pretrained_path is None:
        train_tokenizer(SyntheticPreferences.corpus(read_pairs(run.train_data)), run.tokenizer, cfg.model.vocab_size)
    model = cfg.model
    if model.tokenizer_path is None and model.pretrained_path is not None:
        model = dataclasses.replace(model, tokenizer_path=model.pretrained_path)
    # One id per training run: MLflow run, manifest entries and events all carry it.
    run_id = f"{cfg.run_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run.run_id_file.write_text(run_id)
    spec = TrainJobSpec(run_id=run_id, run_dir=str(run.root), model=model, train=cfg.train, storage=cfg.storage)
    run.train_config.write_text(json.dumps(dataclasses.asdict(spec), indent=1))
    (run.root / "pipeline_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    return run


def total_train_steps(run: RunDir, cfg: PipelineConfig) -> int:
    """The training job's step count (for progress), computed as the job computes it."""
    pairs = sum(1 for line in Path(run.train_data).open() if line.strip())
    return total_steps(pairs, cfg.train.nproc, cfg.train)

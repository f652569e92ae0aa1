"""Preparing a run directory: data, tokenizer and the training job's spec."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from areal_eval import jsonl
from areal_eval.checkpoints.manifest import Manifest
from areal_eval.config.parsing import merge, read_file
from areal_eval.evaluation.evaluators import check_evaluation_data
from areal_eval.evaluation.job_spec import write_spec
from areal_eval.models.objectives import objective
from areal_eval.pipeline.config import PipelineConfig, load_pipeline_config
from areal_eval.redaction import recorded_config
from areal_eval.runs.directory import RunDir
from areal_eval.train_config import TrainJobSpec, total_steps


def prepare_run(cfg: PipelineConfig) -> RunDir:
    """Lay out ``cfg.run_root``: validated data files, a tokenizer, ``train_config.json``.

    A run that exists is resumed, never wiped: it keeps its id, data, tokenizer, checkpoints,
    manifest and ledger, and training goes on from its newest checkpoint; only the training
    settings come from ``cfg``. Given data files are validated before anything is created.
    """
    given = check_inputs(cfg)  # every row checked, naming file and line, before the run is touched
    run = RunDir(cfg.run_root)
    if cfg.train.external:
        return _external_run(cfg, run, given)
    if run.exists():
        run_id = run.run_id
    else:
        run_id = _new_run(cfg, run, given)
    model = cfg.model
    if model.tokenizer_path is None and model.pretrained_path is not None:
        model = dataclasses.replace(model, tokenizer_path=model.pretrained_path)
    spec = TrainJobSpec(run_id=run_id, run_dir=str(run.root), model=model, train=cfg.train, storage=cfg.storage)
    write_spec(run.train_config, spec)
    _record_config(cfg, run)
    return run


def check_inputs(cfg: PipelineConfig) -> dict[str, Path]:
    """The given data files, validated (DataError names file and line): training data as the
    objective reads it, validation data as each evaluator reads it. Returns them by role."""
    given = {}
    if cfg.data.train_path is not None:
        objective(cfg.model.objective).read(cfg.data.train_path)
        given["train"] = Path(cfg.data.train_path)
    if cfg.data.valid_path is not None:
        check_evaluation_data(cfg.eval.evaluator, Path(cfg.data.valid_path), cfg.evaluator_settings)
        given["valid"] = Path(cfg.data.valid_path)
    return given


def _new_run(cfg: PipelineConfig, run: RunDir, given: dict[str, Path]) -> str:
    run.root.mkdir(parents=True, exist_ok=True)
    task = objective(cfg.model.objective)
    if cfg.data.train_path is None or cfg.data.valid_path is None:
        task.synthetic(cfg.data).generate(run.data)
    for name, path in given.items():
        _copy_data(path, run.train_data if name == "train" else run.valid_data)
    if cfg.model.tokenizer_path is None and cfg.model.pretrained_path is None:
        task.train_tokenizer(task.read(run.train_data), run.tokenizer, cfg.model.vocab_size)
    # One id per training run: MLflow run, manifest entries and events all carry it. Written last:
    # a directory without it was never started, and is laid out again.
    run_id = f"{cfg.run_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    jsonl.write_atomic(run.run_id_file, run_id)
    return run_id


def _external_run(cfg: PipelineConfig, run: RunDir, given: dict[str, Path]) -> RunDir:
    """A run trained elsewhere: its id is the one its publisher used, else the directory's name
    (what the trainer callbacks default to); validation data given in the config goes to
    ``data/valid.jsonl`` beside the manifest, where evaluation looks when events name none."""
    run.root.mkdir(parents=True, exist_ok=True)
    if not run.exists():  # the trainer's callback may name it at this very moment: first one wins
        published = Manifest(run.manifest).events() if run.manifest.exists() else []
        jsonl.create_atomic(run.run_id_file, published[0].run_id if published else run.root.name)
    if "valid" in given:
        _copy_data(given["valid"], run.valid_data)
    _record_config(cfg, run)
    return run


def _copy_data(source: Path, target: Path) -> None:
    """A validated data file, as given (every field kept: evaluators read fields of their own)."""
    jsonl.write_atomic(target, source.read_bytes())


def _record_config(cfg: PipelineConfig, run: RunDir) -> None:
    jsonl.write_atomic(run.config_file, json.dumps(recorded_config(dataclasses.asdict(cfg)), indent=1))


JUDGING = {
    "eval": ("evaluator", "generation", "lm_loss", "lm_eval"),
    "model": ("max_length",),
    "alerts": ("rules",),
    "tracking": ("experiment", "registered_model", "sinks", "wandb", "tensorboard"),
}
"""What a run is judged by and where its results go, beside its whole ``scheduler`` and
``feedback`` sections: its evaluators and their settings, the token limit, the alert rules (they
name the evaluators' metrics), its experiment and sinks. Not how or where it is evaluated (ranks,
launcher, devices), nor the tracking server's address: those belong to the path that evaluates it."""


def recorded_evaluation_settings(run: RunDir) -> dict:
    """The settings ``run`` was started with that decide how it is judged and where its results
    go, as config sections ({} when the run recorded none, e.g. one published by a trainer
    alone). Every path that evaluates the run (the trigger, ``prefect deployment run``, the
    service, the sweep) starts from them, so a run is judged and recorded the same whichever
    path evaluates it; parameters given there override."""
    recorded = jsonl.read_json(run.config_file, None)
    if not isinstance(recorded, dict):
        return {}
    judging = {"scheduler": recorded.get("scheduler", {}), "feedback": recorded.get("feedback", {})}
    for section, fields in JUDGING.items():
        judging[section] = {f: recorded[section][f] for f in fields if f in recorded.get(section, {})}
    return {section: values for section, values in judging.items() if values}


def run_evaluation_config(run: RunDir, params: dict | None, *, config_path: str | None = None) -> PipelineConfig:
    """The config ``run`` is evaluated with, each source over the one before: the defaults, the
    path's config file (``config_path``: a deployment's, the service's ``--config``), what the run
    was started with (:func:`recorded_evaluation_settings`), then ``params`` (the fields a flow's
    caller set)."""
    base = read_file(config_path) if config_path else {}
    return load_pipeline_config(params=merge(merge(base, recorded_evaluation_settings(run)), params or {}))


def total_train_steps(run: RunDir, cfg: PipelineConfig) -> int | None:
    """The training job's step count (for progress), computed as the job computes it; for an
    external trainer, ``train.max_steps`` if set, else unknown (None)."""
    if cfg.train.external:
        return cfg.train.max_steps
    pairs = sum(1 for line in Path(run.train_data).open() if line.strip())
    return total_steps(pairs, cfg.train.nproc, cfg.train)

"""MLflow tracking: one MLflow run per training run, metrics at ``step=global_step``.

Logging is idempotent without rereading histories, so its cost stays flat over a long run:

* training rows go in with a watermark, the run tag ``areal.train_logged_through``, in the same
  ``log_batch`` (atomic in MLflow's SQL store and one request to a server), and rows at or below
  it are dropped, after a retry or a resume alike;
* a checkpoint's metrics go in one ``log_batch`` and are skipped when the step is already there;
  the logged steps are read from MLflow once per run and tracker, then kept in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from areal_eval.config.parsing import FieldError, flatten
from areal_eval.runs.directory import file_lock
from areal_eval.runs.ledger import LedgerEntry
from areal_eval.sinks.config import TensorBoardConfig, WandbConfig, check_sinks

RUN_ID_TAG = "areal.run_id"
TRAIN_WATERMARK_TAG = "areal.train_logged_through"
MAX_POINTS_WITH_WATERMARK = 999
"""Metric points sent with one watermark tag. This is not a re-chunking of MLflow's: its client
splits a ``log_batch`` past 1,000 entities and sends the tags with the *first* request, so a crash
between requests would leave a watermark over points never logged. One request each keeps both
together."""
EVAL_PREFIX = "eval/"
PROBE_PREFIX = "eval_probe/"
"""Probe results (and the subset part of full evaluations, with probes): never posing as ``eval/``."""
BEST_ALIAS = "best"
"""The registered model's alias that follows the best evaluated checkpoint."""
TRAIN_PREFIX = "train/"


@dataclasses.dataclass
class TrackingConfig:
    tracking_uri: str | None = None
    """MLflow tracking URI; None: ``$MLFLOW_TRACKING_URI``, else SQLite in the work dir."""
    experiment: str = "areal-eval"
    """MLflow experiment name."""
    artifact_location: str | None = None
    """Artifact root of a new experiment, e.g. ``s3://bucket/mlflow`` (the client then needs
    ``$MLFLOW_S3_ENDPOINT_URL`` for a non-AWS endpoint); None: ``mlartifacts/`` beside a SQLite
    store, else the tracking server's default."""
    ui_url: str | None = None
    """Where the MLflow UI is served, for links in the Prefect UI; None: the tracking URI when it
    is an ``http(s)`` server, else ``http://127.0.0.1:5000`` (``mlflow ui``'s default)."""
    registered_model: str | None = "areal-eval-{run_id}"
    """Register the run's best evaluated checkpoint (by ``scheduler.metric``, in its direction) as
    a version of this MLflow registered model and point its ``best`` alias at it; ``{run_id}`` is
    the training run's id. A name shared by several runs keeps the best of all of them. None:
    register nothing."""
    sinks: list[str] = dataclasses.field(default_factory=lambda: ["mlflow"])
    """Where results go: ``mlflow``, ``wandb``, ``tensorboard``, in any combination, e.g.
    ``[mlflow, wandb, tensorboard]`` or ``[wandb]``. Every sink gets every result, training row,
    alert and the run's end once; one that fails is retried and never holds up the others.
    Without ``mlflow`` no MLflow is needed or written to: the run's own record (decisions,
    resume) is then an SQLite file in the work dir that nothing shows (docs/tracking.md)."""
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    """The W&B sink: the project, and the trainer's run to sit beside."""
    tensorboard: TensorBoardConfig = dataclasses.field(default_factory=TensorBoardConfig)
    """The TensorBoard sink: the trainer's log directory to write beside."""

    def __post_init__(self):
        check_sinks(self.sinks)
        if self.tracking_uri and not self.to_mlflow:
            raise FieldError("tracking_uri", "set, but mlflow is not in tracking.sinks: add it there, or unset this")

    @property
    def to_mlflow(self) -> bool:
        """Results go to an MLflow its users open (``mlflow`` is one of :attr:`sinks`)."""
        return "mlflow" in self.sinks


def mlflow_run_url(cfg: TrackingConfig, tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI."""
    base = cfg.ui_url or (tracking_uri if tracking_uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000")
    # MLflow 3's UI opens in its GenAI view (traces, all empty here) unless told otherwise.
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def artifact_location(cfg: TrackingConfig, tracking_uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: ``tracking.artifact_location``, else beside a
    SQLite store (``mlartifacts/`` next to the database file, not ``./mlruns`` wherever the
    process happens to run), else the tracking server's default."""
    if cfg.artifact_location:
        return cfg.artifact_location
    if tracking_uri.startswith("sqlite:///"):
        return (Path(tracking_uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()
    return None


def resolve_tracking_uri(cfg: TrackingConfig, work_root: str | Path) -> str:
    """The MLflow store of a run's record: ``tracking.tracking_uri``, else
    ``$MLFLOW_TRACKING_URI``, else SQLite in ``work_root``; always the last where ``mlflow`` is
    not a sink (nothing reaches the MLflow the environment names)."""
    if cfg.tracking_uri:
        return cfg.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI") and cfg.to_mlflow:
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(work_root).resolve() / 'mlflow.db'}"


EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
"""The experiment's kind in MLflow 3: model training (runs and metric charts), not GenAI (traces,
token usage: all empty here). MLflow 3.17's UI decides its view by a workflow switch instead (our
links set it: :func:`mlflow_run_url`); the tag says the same to tools that read it."""


class Tracker:
    """A training run's MLflow run and what is logged to it, in the store and experiment of a
    :class:`TrackingConfig`; ``work_dir`` holds the SQLite store where the config names none."""

    def __init__(self, config: TrackingConfig, *, work_dir: str | Path | None = None):
        if not (config.tracking_uri or (config.to_mlflow and os.environ.get("MLFLOW_TRACKING_URI")) or work_dir):
            raise ValueError("tracking.tracking_uri: not set, and no work_dir to keep mlflow.db in")
        tracking_uri = resolve_tracking_uri(config, work_dir or ".")
        experiment = config.experiment
        # MLflow logs each database error with its traceback before raising it; callers report
        # what they retry (a full disk, a locked store) in one line each.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
        from mlflow.tracking import MlflowClient

        self.config, self.tracking_uri = config, tracking_uri
        # Flow runs that start together on a fresh SQLite store would each create its tables (the
        # losers fail: "table latest_metrics already exists") and the experiment: one at a time.
        database = tracking_uri.removeprefix("sqlite:///") if tracking_uri.startswith("sqlite:///") else None
        with file_lock(Path(f"{database}.init.lock")) if database else contextlib.nullcontext():
            self.client = MlflowClient(tracking_uri=tracking_uri)
            exp = self.client.get_experiment_by_name(experiment)
            if exp is None:
                location = artifact_location(config, tracking_uri)
                self.experiment_id = self.client.create_experiment(experiment, location, tags=EXPERIMENT_TAGS)
            else:
                self.experiment_id = exp.experiment_id
                for key, value in EXPERIMENT_TAGS.items():  # an experiment made before: kept if set otherwise
                    if key not in exp.tags:
                        self.client.set_experiment_tag(self.experiment_id, key, value)
        self._train_through: dict[str, int] = {}
        self._eval_logged: dict[tuple[str, str], set[int]] = {}

    def find_run(self, training_run_id: str) -> str | None:
        runs = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{training_run_id}'", max_results=1
        )
        return runs[0].info.run_id if runs else None

    def start_run(
        self,
        training_run_id: str,
        params: dict,
        *,
        tags: dict | None = None,
        reopen: bool = False,
        lock: Path | None = None,
    ) -> str:
        """The MLflow run of a training run: created once, reused when a flow resumes it
        (``reopen``: marked RUNNING again, as the resumed training goes on).

        ``lock``: a file held while finding or creating it. Flow runs of one training run that
        start together (checkpoints published close together) would otherwise each find none
        and each create one, splitting the run's metrics between them."""
        from mlflow.entities import Param

        with file_lock(lock) if lock is not None else contextlib.nullcontext():
            run_id = self.find_run(training_run_id)
            if reopen and run_id is not None and self.client.get_run(run_id).info.status != "RUNNING":
                self.client.update_run(run_id, status="RUNNING")  # resumed: the same run goes on
            if run_id is None:
                run = self.client.create_run(
                    self.experiment_id, run_name=training_run_id, tags={RUN_ID_TAG: training_run_id, **(tags or {})}
                )
                run_id = run.info.run_id
                items = [Param(k, str(v)[:6000]) for k, v in sorted(flatten(params).items())]
                self.client.log_batch(run_id, params=items)  # the client splits it into requests
        return run_id

    def train_logged_through(self, run_id: str) -> int:
        """The last training step logged to ``run_id`` (-1: none); read from MLflow once."""
        if run_id not in self._train_through:
            tag = self.client.get_run(run_id).data.tags.get(TRAIN_WATERMARK_TAG)
            if tag is None:  # a run logged before the watermark existed
                steps = [m.step for m in self.client.get_metric_history(run_id, TRAIN_PREFIX + "loss")]
                self._train_through[run_id] = max(steps, default=-1)
            else:
                self._train_through[run_id] = int(tag)
        return self._train_through[run_id]

    def log_train_metrics(self, run_id: str, rows: list[dict], reread_watermark: bool = False) -> int:
        """Log training rows (``{"step": .., "loss": ..}``) past the run's watermark; returns the
        number of metric points logged. ``reread_watermark``: other processes log to this run
        too (the caller holds a lock they take as well), so the watermark is read from MLflow."""
        from mlflow.entities import Metric

        if reread_watermark:
            self._train_through.pop(run_id, None)
        through = self.train_logged_through(run_id)
        now = int(time.time() * 1000)
        batch: list = []
        logged = 0
        for row in sorted(rows, key=lambda r: int(r["step"])):
            step = int(row["step"])
            if step <= through:  # logged before a retry or a resume (or twice in ``rows``)
                continue
            points = [
                Metric(TRAIN_PREFIX + k, float(v), now, step)
                for k, v in row.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
            ]
            if batch and len(batch) + len(points) > MAX_POINTS_WITH_WATERMARK:
                self._log_train_batch(run_id, batch, through)
                logged += len(batch)
                batch = []
            batch += points
            through = step
        if through > self.train_logged_through(run_id):
            self._log_train_batch(run_id, batch, through)
            logged += len(batch)
        return logged

    def _log_train_batch(self, run_id: str, metrics: list, through: int) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(run_id, metrics=metrics, tags=[RunTag(TRAIN_WATERMARK_TAG, str(through))])
        self._train_through[run_id] = through

    def eval_steps(self, run_id: str, key: str = "n_pairs", prefix: str = EVAL_PREFIX) -> set[int]:
        return {m.step for m in self.client.get_metric_history(run_id, prefix + key)}

    def log_evaluation(
        self,
        run_id: str,
        step: int,
        metrics: dict,
        *,
        tags: dict | None = None,
        marker: str = "n_pairs",
        prefix: str = EVAL_PREFIX,
        model_id: str | None = None,
    ) -> bool:
        """Log one checkpoint's metrics at ``step`` as ``prefix + name``, linked to the LoggedModel
        ``model_id`` when given; False (and nothing logged) if already there."""
        from mlflow.entities import Metric, RunTag

        key = marker if marker in metrics else sorted(metrics)[0]
        if (run_id, prefix + key) not in self._eval_logged:
            self._eval_logged[run_id, prefix + key] = self.eval_steps(run_id, key, prefix)
        logged = self._eval_logged[run_id, prefix + key]
        if step in logged:
            return False
        now = int(time.time() * 1000)
        self.client.log_batch(
            run_id,
            metrics=[Metric(prefix + k, float(v), now, step, model_id=model_id) for k, v in sorted(metrics.items())],
            tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()],
        )
        logged.add(step)
        return True

    def register_if_best(
        self,
        name: str,
        run_id: str,
        step: int,
        *,
        source: str,
        metrics: dict,
        metric: str,
        higher_is_better: bool,
        versus: Callable[[int], dict[str, str]] | None = None,
    ) -> str | None:
        """Register ``source`` (the checkpoint at ``step``) as a new version of model ``name`` and
        move the ``best`` alias to it, when ``metrics[metric]`` beats the version the alias points
        at; returns the new version, or None. Calling it again for the same checkpoint does nothing.
        ``versus(previous_step)``: tags comparing it with the best it replaces, on the new version.
        Callers serialize calls for one model (a read, then a write)."""
        from mlflow.exceptions import MlflowException

        value = metrics.get(metric)
        if value is None or not math.isfinite(value):
            return None
        try:
            current = self.client.get_model_version_by_alias(name, BEST_ALIAS)
        except MlflowException:  # no such model, or no alias yet
            current = None
        if current is not None:
            if current.run_id == run_id and current.tags.get("global_step") == str(step):
                return None  # this checkpoint is the best already
            best = float(current.tags.get(EVAL_PREFIX + metric, "nan"))
            better = value > best if higher_is_better else value < best
            if math.isfinite(best) and not better:
                return None
        try:
            self.client.create_registered_model(name, description="Best evaluated checkpoints (areal-eval).")
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        tags = {
            "global_step": str(step),
            "metric": metric,
            **{EVAL_PREFIX + k: repr(float(v)) for k, v in metrics.items()},
        }
        if current is not None and versus is not None and current.run_id == run_id:
            tags |= versus(int(current.tags["global_step"]))
        description = f"checkpoint at step {step}: {metric} = {value:.6g}"
        if "vs_previous_best" in tags:  # what the comparison says, where the model page shows it first
            description += f"; {tags['vs_previous_best']}"
        version = self.client.create_model_version(name, source, run_id=run_id, tags=tags, description=description)
        self.client.set_registered_model_alias(name, BEST_ALIAS, version.version)
        return str(version.version)

    def deleted_steps(self, run_id: str) -> set[int]:
        """Steps whose checkpoints retention deleted (tags ``deleted.<step>``)."""
        return self.tagged_steps(run_id, "deleted")

    def tagged_steps(self, run_id: str, prefix: str) -> set[int]:
        """Steps with a tag ``<prefix>.<step>`` (``deleted``, ``skipped``)."""
        tags = self.client.get_run(run_id).data.tags
        return {int(k.split(".", 1)[1]) for k in tags if k.startswith(prefix + ".") and k.split(".", 1)[1].isdigit()}

    def eval_history(self, run_id: str, metric: str, prefix: str = EVAL_PREFIX) -> dict[int, float]:
        return {m.step: m.value for m in self.client.get_metric_history(run_id, prefix + metric)}

    def step_metrics(self, run_id: str, step: int, logged: dict, prefix: str = EVAL_PREFIX) -> dict[str, float]:
        """The metrics named ``prefix + name`` at ``step``, by name; ``logged``: the run's latest
        metrics (``get_run(...).data.metrics``), which name every key logged."""
        names = [k.removeprefix(prefix) for k in logged if k.startswith(prefix)]
        at_step = {name: self.eval_history(run_id, name, prefix).get(step) for name in names}
        return {name: value for name, value in at_step.items() if value is not None}

    def log_items(self, run_id: str, step: int, files: dict[str, str]) -> None:
        """A result's per-item files as artifacts (``items/step_<step>/``); generation's answers
        also as a table a user reads in the UI (``items/generation_step_<step>.json``: prompt,
        reference, answer and reward per answer). Files no longer there are passed over."""
        from areal_eval.evaluation.items import read_items

        for name, path in sorted(files.items()):
            if not Path(path).exists():
                continue
            self.client.log_artifact(run_id, path, f"items/step_{step:08d}")
            table_file = f"items/generation_step_{step:08d}.json"
            logged = {a.path for a in self.client.list_artifacts(run_id, "items")}
            if name == "generation" and table_file not in logged:  # log_table appends to a table already there
                rows = read_items(path)
                columns = ("item", "prompt", "answer", "reward", "reference", "greedy", "sample", "length", "truncated")
                table = {c: [r.get(c) for r in rows] for c in columns}
                self.client.log_table(run_id, table, table_file)

    def set_tags(self, run_id: str, tags: dict) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_dict(self, run_id: str, data, artifact_file: str) -> None:
        self.client.log_dict(run_id, data, artifact_file)

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def supersede_failure(self, run_id: str) -> None:
        """A run that failed and then finished: its ``areal.failure`` becomes history
        (``areal.earlier_failures``, newest last), so the finished run shows no current failure."""
        tags = self.client.get_run(run_id).data.tags
        if FAILURE_TAG not in tags:
            return
        earlier = [t for t in (tags.get(EARLIER_FAILURES_TAG, ""), tags[FAILURE_TAG]) if t]
        self.set_tags(run_id, {EARLIER_FAILURES_TAG: "\n".join(earlier)[-5000:]})
        self.client.delete_tag(run_id, FAILURE_TAG)


FAILURE_TAG = "areal.failure"
"""Why a run that ended FAILED or KILLED ended."""
EARLIER_FAILURES_TAG = "areal.earlier_failures"
"""The failures of a run that was resumed and then finished, oldest first, a line each."""


def attempt_tags(entry: LedgerEntry) -> dict[str, str]:
    """A checkpoint's failed evaluation attempts as MLflow tags: how many, and the last cause
    (kept once a later attempt succeeds)."""
    if not entry.attempts:
        return {}
    return {
        f"attempts.{entry.step}.failed": str(len(entry.attempts)),
        f"attempts.{entry.step}.last_cause": entry.attempts[-1][:5000],
    }

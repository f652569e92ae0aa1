"""Evaluating one checkpoint on separate torchrun workers, from the orchestrator's side."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import re
import time
from pathlib import Path
from typing import ClassVar

from areal_eval.checkpoints.loading import DTYPES
from areal_eval.checkpoints.manifest import CheckpointError, CheckpointEvent, checkpoint_name, verify_checkpoint
from areal_eval.checkpoints.store import S3Config
from areal_eval.config.parsing import (
    AT_LEAST_1,
    BATCH,
    NON_NEGATIVE,
    POSITIVE,
    RANKS,
    Bounds,
    FieldError,
    Ranges,
    check_ranges,
)
from areal_eval.disk import named_if_disk_full
from areal_eval.evaluation.generation import GenerationConfig
from areal_eval.evaluation.interpreter import check_interpreter
from areal_eval.evaluation.job_spec import COLLECTIVE_TIMEOUT_S, EvalJobSpec, to_json, write_spec
from areal_eval.evaluation.lm_eval_tasks import LMEvalConfig
from areal_eval.evaluation.lm_loss import LMLossConfig
from areal_eval.evaluation.preflight import preflight_cache, preflight_key, run_preflight
from areal_eval.evaluation.worker_pool import WarmEvalWorkers
from areal_eval.launchers.devices import Devices, Placement, check_setting
from areal_eval.launchers.local import NodeLayout, TorchrunJob, WorkerError, failure_summary, stay_offline
from areal_eval.launchers.ray_slots import RayConfig, RaySlots
from areal_eval.launchers.slot_pool import PASS_ENV, SlotPool
from areal_eval.launchers.slurm_slots import SlurmConfig, SlurmSlots


class EvaluationFailed(RuntimeError):
    """The evaluation of a checkpoint failed; the message says why (and where the log is)."""

    retried: list[str] = []
    """The causes of the tries that failed before this last one (``eval.retries``)."""


class CorruptCheckpoint(EvaluationFailed):
    """The checkpoint is missing, fails verification or cannot be read: retrying cannot help."""


class EvaluationDataError(EvaluationFailed):
    """The validation data cannot be evaluated (missing, malformed, a row with nothing to score):
    retrying cannot help."""


class EvaluationConfigError(EvaluationFailed):
    """The evaluation settings cannot run on this checkpoint (a token budget over the model's
    positions, a chat template it lacks): retrying cannot help."""


FAILURE_CLASSES = {
    "CheckpointError": CorruptCheckpoint,
    "DataError": EvaluationDataError,
    "ConfigError": EvaluationConfigError,
}
"""The worker's exception classes that no retry can fix, by the name its result file gives."""


def check_validation_data(path: str | Path, given_by: str) -> Path:
    """``path`` if it is a readable file; else a :class:`EvaluationDataError` (not retried) that
    says where the path came from and how to give one, before any worker starts."""
    path = Path(path)
    if not path.is_file():
        raise EvaluationDataError(
            f"{path}: no such validation data file (from {given_by}); pass data_path, or register "
            "the run's data when publishing: publish_checkpoint(..., valid_data=PATH)"
        )
    return path


def evaluator_spec_pattern() -> str:
    """``eval.evaluator`` as a regular expression: registered names or ``module:Class``, comma-separated."""
    from areal_eval.evaluation.evaluators import EVALUATORS

    one = "(?:" + "|".join(map(re.escape, EVALUATORS)) + r"|[A-Za-z_][\w.]*:[A-Za-z_]\w*)"
    return rf"^\s*{one}(?:\s*,\s*{one})*\s*$"


@dataclasses.dataclass
class EvalConfig:
    nproc: int = 2
    """Evaluation ranks per node (torchrun --nproc-per-node); the node count comes from the
    work pool (``AREAL_EVAL_NNODES``, see ``infra/k8s``)."""
    mp_size: int = 1
    """Ranks per model-parallel group; the data-parallel head broadcasts batches to it. With
    ``generation.backend: vllm`` the group runs one engine, tensor-parallel over its ranks'
    devices (a group must lie within a node)."""
    batch_size: int = 32
    """Examples per batch (pairs, texts, or generated answers)."""
    dtype: str = "auto"
    """The dtype every evaluator loads and runs the model in: ``auto`` (the checkpoint's own, its
    ``config.json`` ``dtype``), ``float32``, ``bfloat16`` or ``float16``. Sums and metrics are
    taken in float64 whatever it is. One the device cannot run is refused before the model loads."""
    evaluator: str = "reward_model"
    """``reward_model``, ``generation``, ``lm_loss``, or ``module:Class``; several, comma-separated,
    run in one job on one loaded model, and their metrics are named ``evaluator/metric``."""
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    """Settings of the ``generation`` evaluator (sampling, reward function, pass@k)."""
    lm_loss: LMLossConfig = dataclasses.field(default_factory=LMLossConfig)
    """Settings of the ``lm_loss`` evaluator."""
    lm_eval: LMEvalConfig = dataclasses.field(default_factory=LMEvalConfig)
    """Settings of the ``lm_eval`` evaluator: lm-evaluation-harness tasks (registry or local YAML)."""
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    """Timeout of every collective: a dead or hung rank fails the evaluation."""
    job_timeout_s: float = 600.0
    """Wall-clock limit for one evaluation, start-up included."""
    allow_pickle: bool = False
    """Load checkpoints that need pickle (unsafe); safetensors only otherwise."""
    deployment: str | None = None
    """Dispatch each evaluation to this ``evaluate-checkpoint`` deployment (its work pool's
    workers) when a Prefect server is in use; None runs torchrun workers from the flow's host."""
    retries: int = 1
    """Retries of a failed evaluation within one attempt, with backoff (1 s, 2 s, ...): for transient
    failures only (a killed or hung worker); a corrupt checkpoint or bad data is not retried."""
    max_attempts: int = 3
    """Attempts at one checkpoint before a transient failure is recorded ``failed`` for good. After
    a failed attempt the checkpoint stays scheduled: the flow that owns the run queues it again;
    on the event path the sweep retries it, at the earliest 1, 2, 4, ... minutes (up to an hour)
    after the last attempt. Every attempt's cause stays in the ledger."""
    nice: int = 0
    """Lower the workers' CPU priority by this much (0-19) when they share CPUs with training,
    so training keeps its throughput and evaluation takes what is left."""
    warm_workers: bool = True
    """Keep the evaluation ranks alive between evaluations of a flow run (one torchrun job
    serves them all), saving interpreter and library start-up each time. Single node only."""
    devices: Devices = "auto"
    """Devices evaluation runs on, split among the slots: visible GPU indices (one per rank,
    ``slots`` x ``nproc`` of them), or CPU core ids on a machine without GPUs. ``auto``: the GPUs
    training does not take; on CPU, not pinned. Each slot's worker group sees only its own
    (``CUDA_VISIBLE_DEVICES``; CPU affinity on cores)."""
    share_devices: bool = False
    """Let evaluation run on training's devices (a one-GPU machine). It costs training speed
    and memory: evaluation's forward passes take turns with training's on the same device, and
    its model and activations sit beside training's."""
    python: str | None = None
    """The evaluation workers' Python interpreter, for an environment of their own (with vLLM:
    ``.venv-vllm/bin/python``, made by ``bash scripts/setup.sh --vllm``); None: the flow's own."""
    items: bool = True
    """Keep every item's scores (and generated answers) of each evaluation, as parquet files
    beside its result (``<run>/evals/<checkpoint>.items/<evaluator>.parquet``): what
    ``areal-eval compare`` and the paired statistics read, and the answers a user reads."""
    item_text_chars: int | None = 2000
    """The size policy of per-item files: prompts, references and answers are cut to this many
    characters (scores are kept whole); None keeps texts whole, 0 keeps none."""
    slots: int = 1
    """Evaluations in flight at once: the flow keeps a group of ``nproc`` ranks for each, and
    waiting checkpoints are coalesced only when every slot is busy. On a server, dispatched
    evaluations are bounded by the ``gpu_slot`` concurrency limit as well."""
    launcher: str = "local"
    """Where the slots run: ``local`` (torchrun on the flow's machine), ``ray`` (a placement group
    per slot, a node agent per bundle: ``eval.ray``) or ``slurm`` (a job per slot: ``eval.slurm``)."""
    nodes: int = 1
    """Nodes per slot (``ray`` and ``slurm``), each running ``nproc`` ranks; node 0 writes the result."""
    ray: RayConfig = dataclasses.field(default_factory=RayConfig)
    """Settings of ``launcher: ray``."""
    slurm: SlurmConfig = dataclasses.field(default_factory=SlurmConfig)
    """Settings of ``launcher: slurm``."""
    pass_env: list[str] = dataclasses.field(default_factory=lambda: list(PASS_ENV))
    """Patterns (``AWS_*``) of the flow's environment variables that reach the ranks on ``ray``
    and ``slurm`` nodes (Slurm's sbatch passes the rest of the flow's environment as well)."""
    env: dict = dataclasses.field(default_factory=dict)
    """Variables set for the ranks on ``ray`` and ``slurm`` nodes, over the flow's."""

    PATTERNS: ClassVar[dict] = {"evaluator": lambda: evaluator_spec_pattern()}
    CLUSTERS: ClassVar[dict[str, type[SlotPool]]] = {"ray": RaySlots, "slurm": SlurmSlots}
    """The cluster launchers, beside ``local``: each one's module declares its settings (a field
    of this class, of its pool's ``Config``), what it needs installed, and its slots."""
    CHOICES: ClassVar[dict] = {"dtype": lambda: list(DTYPES), "launcher": lambda: ["local", *EvalConfig.CLUSTERS]}
    RANGES: ClassVar[Ranges] = {
        "nproc": RANKS,
        "slots": Bounds(1, 64),
        "nodes": Bounds(1, 1024),
        "mp_size": RANKS,
        "batch_size": BATCH,
        "collective_timeout_s": POSITIVE,
        "job_timeout_s": POSITIVE,
        "retries": NON_NEGATIVE,
        "max_attempts": AT_LEAST_1,
        "nice": Bounds(0, 19),
        "item_text_chars": NON_NEGATIVE,
    }

    def __post_init__(self):
        check_ranges(self, self.RANGES)
        check_setting(self.devices, "devices")
        self._check_launcher()
        if self.dtype not in DTYPES:
            raise FieldError("dtype", f"{self.dtype!r} is not one of {', '.join(DTYPES)}")
        # On a cluster the interpreter is the nodes' (a path the flow's machine may lack): each node
        # checks it when its slot starts (launchers.node_agent.check_node).
        if self.python is not None and self.launcher == "local":
            if not os.access(self.python, os.X_OK):
                raise FieldError("python", f"{self.python!r} is not an executable Python interpreter")
            check_interpreter(self.python, self.evaluator, self.generation)
        if self.nproc % self.mp_size:
            raise FieldError("nproc", f"{self.nproc} must be divisible by mp_size ({self.mp_size})")

    def _check_launcher(self) -> None:
        """``launcher`` and what it needs, in one line naming the field."""
        launcher, nodes = self.launcher, self.nodes
        if launcher == "local":
            if nodes > 1:
                clusters = " or ".join(self.CLUSTERS)
                raise FieldError(
                    "nodes", f"{nodes} nodes per slot need launcher {clusters} (local runs on one machine)"
                )
            return
        if launcher not in self.CLUSTERS:
            raise FieldError("launcher", f"{launcher!r} is not one of {', '.join(['local', *self.CLUSTERS])}")
        if self.devices != "auto":
            raise FieldError(
                "devices",
                f"{self.devices!r}: with launcher {launcher} the cluster gives each node its devices"
                f" ({launcher}.gpus_per_node)",
            )
        package, how = self.CLUSTERS[launcher].EXTRA or (None, None)
        if package and importlib.util.find_spec(package) is None:
            raise FieldError("launcher", f"{launcher} needs the {package} package, not installed here: {how}")


def cluster_slots(cfg: EvalConfig, work_dir: str | Path, *, run_name: str, report=None) -> SlotPool:
    """The slots of ``cfg.launcher`` (a cluster launcher) for one run, as a context manager
    (entering it starts acquiring them)."""
    return cfg.CLUSTERS[cfg.launcher](cfg, work_dir, run_name=run_name, **({"report": report} if report else {}))


@dataclasses.dataclass(frozen=True)
class EvalResult:
    global_step: int
    uri: str
    metrics: dict
    seconds: float
    launched_at: float = 0.0
    """Wall time the torchrun job was started."""
    workers_started_at: float = 0.0
    """Wall time rank 0 entered its main (after interpreter and torch start-up)."""
    probe_metrics: dict = dataclasses.field(default_factory=dict)
    """Metrics on the probe subset, with probes: a probe's (``metrics`` is then empty), or the
    subset part of a full evaluation. Logged as ``eval_probe/*``."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """What went wrong without failing it: texts cut to fit, the first reward that raised."""
    retried: list[str] = dataclasses.field(default_factory=list)
    """The causes of the tries that failed before this one succeeded (``eval.retries``)."""
    items: dict[str, str] = dataclasses.field(default_factory=dict)
    """Per-item result files (parquet) by evaluator, where the evaluators keep items."""

    def nonfinite(self) -> list[str]:
        return [k for k, v in self.metrics.items() if not math.isfinite(v)]


def check_before_launch(event: CheckpointEvent, spec: EvalJobSpec, work_dir: Path, stem: str) -> None:
    """Check a local checkpoint before any worker starts: its directory and the files the manifest
    recorded, with their sizes (:class:`CorruptCheckpoint`, one line; the workers check hashes),
    then the data, tokenized with its tokenizer (:mod:`~areal_eval.evaluation.preflight`), once
    per data, settings and tokenizer: what cannot be scored raises :class:`EvaluationDataError`
    (or :class:`EvaluationConfigError`), naming file and line. An ``s3://`` checkpoint is checked
    by its workers, as they download it."""
    if "://" in event.uri:
        return
    try:
        verify_checkpoint(event.uri, event.files, hashes=False)
    except CheckpointError as exc:
        raise CorruptCheckpoint(f"checkpoint step {event.global_step}: {exc}") from None
    passed = preflight_cache() / f"{preflight_key(event, Path(spec.data), to_json(spec))}.ok"
    if passed.exists():
        return
    spec_file = write_spec(work_dir / f"{stem}.preflight.json", spec)
    refusal = run_preflight(spec_file, stay_offline(dict(os.environ)), timeout_s=300)
    if refusal is not None:
        failure = FAILURE_CLASSES.get(refusal.split(":", 1)[0], EvaluationDataError)
        raise failure(
            f"checkpoint step {event.global_step} ({event.uri}): refused before any worker started: {refusal}"
        )
    with contextlib.suppress(OSError):  # a cache that cannot be written costs the next check, nothing else
        passed.parent.mkdir(parents=True, exist_ok=True)
        passed.touch()


def run_evaluation_job(
    event: CheckpointEvent,
    data_path: str | Path,
    cfg: EvalConfig,
    work_dir: str | Path,
    *,
    max_length: int = 64,
    s3: S3Config | None = None,
    cache_dir: str | Path | None = None,
    workers: WarmEvalWorkers | None = None,
    probe_fraction: float | None = None,
    probe_only: bool = False,
    placement: Placement | None = None,
) -> EvalResult:
    """Evaluate ``event``'s checkpoint on ``cfg.nproc`` torchrun ranks: the ``workers`` kept warm
    between evaluations, or a fresh torchrun job. With ``probe_fraction`` (probes on) the probe
    subset is evaluated apart too, or alone (``probe_only``: a probe). A fresh job runs on
    ``placement``'s devices (the warm ``workers`` on their own).

    An ``s3://`` checkpoint is downloaded once per node into ``cache_dir`` (default
    ``work_dir/checkpoint-cache``) with the ``s3`` client settings.
    """
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    stem = checkpoint_name(event.global_step)
    out = work_dir / f"{stem}.json"
    out.unlink(missing_ok=True)
    start = time.monotonic()
    spec = EvalJobSpec(
        checkpoint=event.uri,
        data=str(data_path),
        out=str(out),
        files=list(event.files),
        cache_dir=str(Path(cache_dir or work_dir / "checkpoint-cache").resolve()),
        evaluator=cfg.evaluator,
        batch_size=cfg.batch_size,
        max_length=max_length,
        dtype=cfg.dtype,
        generation=cfg.generation,
        lm_loss=cfg.lm_loss,
        lm_eval=cfg.lm_eval,
        mp_size=cfg.mp_size,
        collective_timeout_s=cfg.collective_timeout_s,
        allow_pickle=cfg.allow_pickle,
        s3=s3,
        launched_at=time.time(),
        probe_fraction=probe_fraction,
        probe_only=probe_only,
        items=cfg.items,
        item_text_chars=cfg.item_text_chars,
    )
    check_before_launch(event, spec, work_dir, stem)
    # On a multi-node pool (infra/k8s) the other nodes run ``evaluation.worker --follow`` and get the job from rank 0.
    nodes = NodeLayout.from_env()
    job = None
    try:
        if workers is not None and nodes.nnodes == 1:
            code, log_path = workers.run(spec, cfg.job_timeout_s)
        else:
            spec_file = write_spec(work_dir / f"{stem}.job.json", spec)
            job = TorchrunJob(
                "areal_eval.evaluation.worker",
                ["--spec", str(spec_file)],
                nodes.nproc_per_node or cfg.nproc,
                work_dir / f"{stem}.log",
                nice=cfg.nice,
                nodes=nodes,
                placement=placement,
                python=cfg.python,
            )
            code, log_path = job.wait(cfg.job_timeout_s), job.log_path
        result = json.loads(out.read_text()) if out.exists() else {}
        if code or "error" in result or "metrics" not in result:
            summary = job.summary() if job is not None else failure_summary(log_path)
            reason = result.get("error") or (
                "workers exited abnormally" if "metrics" in result else "worker wrote no result"
            )
            cause = re.sub(r"^rank \d+: ", "", reason)
            failure = FAILURE_CLASSES.get(cause.split(":", 1)[0], EvaluationFailed)
            error = failure(
                f"checkpoint step {event.global_step} ({event.uri}): {reason} [torchrun exit {code}; log {log_path}]"
                + (f"\n{summary}" if summary else "")
            )
            # Workers on a full disk write no result and often no log: say so, or it reads as a crash.
            raise named_if_disk_full(error, work_dir, f"the evaluation of step {event.global_step}")
    except WorkerError as exc:
        raise EvaluationFailed(f"checkpoint step {event.global_step} ({event.uri}): {exc}") from exc
    finally:
        if job is not None and job.poll() is None:
            job.kill()
    return EvalResult(
        event.global_step,
        event.uri,
        result["metrics"],
        time.monotonic() - start,
        spec.launched_at,
        result.get("started_at", 0.0),
        result.get("probe_metrics", {}),
        result.get("notes", []),
        items=result.get("items", {}),
    )

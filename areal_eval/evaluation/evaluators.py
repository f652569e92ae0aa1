"""Evaluators: what to compute on a checkpoint, as sums and counts.

An evaluator returns additive statistics per batch; the worker sums them over ranks and only
then turns them into metrics. That is why a distributed evaluation equals a single-process one:
means are taken once, over the exact global counts.

Add your own by subclassing :class:`BaseEvaluator` and registering it in ``EVALUATORS``
(or passing its dotted path as ``eval.evaluator``). Several evaluators, comma-separated, run in
one job on one loaded model (:class:`CombinedEvaluator`); their metrics are ``name/metric``.

The flow process imports the evaluator modules too (settings, metric names, data checks), so
torch and the model code are imported in the methods that run on the workers: a flow run that
only starts evaluations never imports them.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class BaseEvaluator:
    """Subclass and implement ``load``, ``batches``, ``batch_sums`` and ``metrics``."""

    name = "base"
    metric_names: tuple[str, ...] | None = None
    """What :meth:`metrics` returns, declared beside it so alert rules and the scheduler can be
    checked against it before a run starts; None: not declared, not checked."""

    shared_models: dict | None = None
    """Models already loaded in this job, by checkpoint: evaluators run together share one."""

    dtype: str = "auto"
    """The dtype to load and run the model in (``eval.dtype``; set by :func:`make_evaluator`)."""

    mp_size: int = 1
    """Ranks per model-parallel group (``eval.mp_size``; set by :func:`make_evaluator`)."""

    supports_subsets = False
    """Its ``batches`` read :meth:`items`, so :meth:`select` works: probes need it."""
    _selected: list[int] | None = None

    @classmethod
    def from_settings(cls, settings) -> BaseEvaluator:
        """An instance configured from the job's settings (an ``EvalJobSpec``)."""
        return cls(max_length=settings.max_length)

    @classmethod
    def declared_metric_names(cls, settings) -> tuple[str, ...] | None:
        """The metric names an instance configured from ``settings`` will return."""
        return declared_metrics(cls)

    @classmethod
    def check_data(cls, path: Path, settings, tokenizer_dir: Path | None = None) -> None:
        """Read evaluation data ``path`` as :meth:`load` will, so that a bad row is named (file
        and line) before anything starts; with ``tokenizer_dir``, tokenize it with that tokenizer
        too, so a row with nothing to score is refused before any worker starts. Default: not
        checked."""

    def load(self, checkpoint_dir: Path, data_path: Path, allow_pickle: bool = False) -> None:
        """Load the model and the evaluation data (called on every rank)."""
        raise NotImplementedError

    def num_samples(self) -> int:
        raise NotImplementedError

    def select(self, choose: Callable[[int], Iterable[int]] | None) -> None:
        """Evaluate only the items ``choose(n)`` picks of the ``n`` loaded (indices in load
        order), or all of them again (None): a probe's subset, and in a full evaluation the
        subset and the rest apart."""
        if not self.supports_subsets:
            raise NotImplementedError(
                f"evaluator {self.name!r} cannot evaluate a subset (probes need batches that read items())"
            )
        self._selected = None if choose is None else sorted(set(choose(self.num_samples())))

    def items(self) -> list[int]:
        """Indices of the items to evaluate: all, unless :meth:`select` picked some."""
        return list(range(self.num_samples())) if self._selected is None else self._selected

    def batches(self, shard: int, shards: int, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """This data-parallel shard's batches (called on data-parallel heads only)."""
        raise NotImplementedError

    def batch_sums(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Additive statistics of one batch (called on every rank of the model-parallel group,
        under ``torch.inference_mode``)."""
        raise NotImplementedError

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Metrics from the global sums."""
        raise NotImplementedError

    def warnings(self, sums: dict[str, float]) -> list[str]:
        """What the global ``sums`` show went wrong without failing the evaluation (texts cut to
        fit): the job logs each once and reports them with its result."""
        return []

    item_rows: list[dict] | None = None
    """This rank's per-item results in this job, where the worker asked for them (a list; None:
    not kept): one dict per item (or per answer), ``item`` its index in load order first."""

    def keep_items(self) -> None:
        """Keep per-item results from now on (the worker calls it before the first batch)."""
        self.item_rows = []

    def keep_item(self, item: int, **values) -> None:
        """Record one item's results (from :meth:`batch_sums`), where they are kept."""
        if self.item_rows is not None:
            self.item_rows.append({"item": item, **values})

    def item_tables(self) -> dict[str, list[dict]]:
        """This rank's per-item rows by evaluator name ({} where none were kept)."""
        return {self.name: self.item_rows} if self.item_rows else {}

    first_error: str | None = None
    """The first error this rank scored past (a reward function that raised), with its item:
    its traceback is in the job's log, and the result and the ledger name it."""


_METRIC_NAME = re.compile(r"^[\w\-. :/]+$")


def check_metric_names(metrics: dict[str, float], evaluator: str) -> dict[str, float]:
    """``metrics``, if every name is one MLflow accepts (letters, digits, ``_-. :/``): a name it
    refuses would fail every delivery of the result, long after the evaluation."""
    bad = [name for name in metrics if not _METRIC_NAME.match(name)]
    if bad:
        raise ValueError(
            f"evaluator {evaluator!r} returned metric {bad[0]!r}: names may hold only letters, digits, "
            "underscores, dashes, periods, spaces, colons and slashes (MLflow's rule)"
        )
    return metrics


def truncation_warning(cut: float, total: float, what: str, *, limit: str, kept: str) -> list[str]:
    """The warning for ``cut`` of ``total`` ``what`` cut to fit ``limit`` (none when none was;
    a subclass that sums no such count gets none either)."""
    if not cut:
        return []
    return [f"{cut:g} of {total:g} {what} were longer than {limit} and kept {kept} (metric truncated_{what})"]


class CombinedEvaluator(BaseEvaluator):
    """Several evaluators in one job: the model is loaded once, each evaluator's batches run in
    turn, and each metric is named ``evaluator/metric``."""

    def __init__(self, parts: list[BaseEvaluator]):
        self.parts = parts
        self.name = ",".join(p.name for p in parts)
        self.supports_subsets = all(p.supports_subsets for p in parts)

    def select(self, choose):
        for part in self.parts:  # each its own subset, of its own items
            part.select(choose)

    def load(self, checkpoint_dir, data_path, allow_pickle=False):
        models: dict = {}
        for part in self.parts:
            part.shared_models = models
            part.load(checkpoint_dir, data_path, allow_pickle=allow_pickle)

    def num_samples(self):
        return sum(p.num_samples() for p in self.parts)

    def keep_items(self):
        for part in self.parts:
            part.keep_items()

    def item_tables(self):
        return {name: rows for part in self.parts for name, rows in part.item_tables().items()}

    def batches(self, shard, shards, batch_size):
        import torch

        for i, part in enumerate(self.parts):
            for batch in part.batches(shard, shards, batch_size):
                yield {**batch, "evaluator_index": torch.tensor([i])}

    def batch_sums(self, batch):
        part = self.parts[int(batch["evaluator_index"])]
        sums = part.batch_sums({k: v for k, v in batch.items() if k != "evaluator_index"})
        return {f"{part.name}/{k}": v for k, v in sums.items()}

    def metrics(self, sums):
        return {f"{part.name}/{k}": v for part, mine in self._split(sums) for k, v in part.metrics(mine).items()}

    def warnings(self, sums):
        return [f"{part.name}: {w}" for part, mine in self._split(sums) for w in part.warnings(mine)]

    @property
    def first_error(self):
        return next((f"{p.name}: {p.first_error}" for p in self.parts if p.first_error), None)

    def _split(self, sums):
        for part in self.parts:
            prefix = f"{part.name}/"
            yield part, {k.removeprefix(prefix): v for k, v in sums.items() if k.startswith(prefix)}


EVALUATORS: dict[str, str] = {
    "reward_model": "areal_eval.evaluation.reward_model_evaluator:RewardModelEvaluator",
    "generation": "areal_eval.evaluation.generation:GenerationEvaluator",
    "lm_loss": "areal_eval.evaluation.lm_loss:LMLossEvaluator",
    "lm_eval": "areal_eval.evaluation.lm_eval_tasks:LMEvalEvaluator",
}
"""Built-in evaluators, imported when used (generation needs math-verify, lm_eval the harness)."""


def evaluator_class(name: str) -> type[BaseEvaluator]:
    """A registered evaluator by name, or any ``package.module:Class`` subclass of BaseEvaluator."""
    path = EVALUATORS.get(name, name)
    if ":" in path:
        module, attr = path.split(":", 1)
        cls = getattr(importlib.import_module(module), attr)
        if isinstance(cls, type) and issubclass(cls, BaseEvaluator):
            return cls
    raise ValueError(f"eval.evaluator: unknown evaluator {name!r} (known: {sorted(EVALUATORS)} or module:Class)")


def evaluator_names(spec: str) -> list[str]:
    """The evaluators of ``eval.evaluator`` (comma-separated), each once, in order."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"eval.evaluator: {spec!r} must name evaluators, each once")
    return names


def make_evaluator(spec: str, settings) -> BaseEvaluator:
    """The evaluator(s) of ``spec`` configured from ``settings`` (an ``EvalJobSpec`` or
    ``EvaluatorSettings``)."""
    parts = [evaluator_class(n).from_settings(settings) for n in evaluator_names(spec)]
    for part in parts:
        part.dtype = getattr(settings, "dtype", "auto")
        part.mp_size = getattr(settings, "mp_size", 1)
    return parts[0] if len(parts) == 1 else CombinedEvaluator(parts)


def check_evaluation_data(spec: str, path: Path, settings, tokenizer_dir: Path | None = None) -> None:
    """Every evaluator of ``spec`` reads ``path`` as it will in the workers (and tokenizes it
    with the tokenizer at ``tokenizer_dir``, when given)."""
    for name in evaluator_names(spec):
        evaluator_class(name).check_data(Path(path), settings, tokenizer_dir)


def produced_metrics(spec: str, settings) -> tuple[str, ...] | None:
    """What the evaluator(s) of ``spec`` return (None: one of them does not declare it)."""
    classes = [evaluator_class(n) for n in evaluator_names(spec)]
    declared = [cls.declared_metric_names(settings) for cls in classes]
    if any(d is None for d in declared):
        return None
    if len(classes) == 1:
        return declared[0]
    return tuple(f"{cls.name}/{m}" for cls, d in zip(classes, declared, strict=True) for m in d)  # as CombinedEvaluator


def declared_metrics(cls: type[BaseEvaluator]) -> tuple[str, ...] | None:
    """The metric names declared by the class that defines ``cls.metrics`` (a subclass that
    overrides ``metrics`` without declaring its names is not checked)."""
    owner = next(c for c in cls.__mro__ if "metrics" in c.__dict__)
    return owner.__dict__.get("metric_names")

"""The ``lm_eval`` evaluator: lm-evaluation-harness tasks on the checkpoint, in the workers.

Every rank runs the harness's own ``simple_evaluate`` on the loaded model, so task set-up,
few-shot sampling, filters, metrics and standard errors are the harness's. Only the model calls
are distributed: :class:`ShardedHFLM` answers each rank's share of the requests (dealt in turn
over the data-parallel ranks) and gathers every share, so each rank's harness sees all the
answers and computes what a single process computes. Tasks come from the harness registry or
from local task YAML files (``include_path``) whose data files are local: nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import ClassVar

from areal_eval.config.parsing import AT_LEAST_1, BATCH, NON_NEGATIVE, FieldError, Ranges, check_ranges
from areal_eval.evaluation.evaluators import BaseEvaluator
from areal_eval.models import causal_lm


@dataclasses.dataclass
class LMEvalConfig:
    tasks: list[str] = dataclasses.field(default_factory=list)
    """Harness task (or group) names: from its registry or from the YAML files under ``include_path``."""
    include_path: str | None = None
    """A directory of local task YAML files (their ``dataset_kwargs.data_files`` local paths)."""
    num_fewshot: int | None = None
    """Few-shot examples per prompt (None: each task's default)."""
    limit: int | None = None
    """At most this many documents per task (None: all of them)."""
    batch_size: int = 16
    """Requests per forward pass."""
    seed: int = 1234
    """Seed of the harness's few-shot sampling (and its other seeds)."""
    chat_template: bool = False
    """Put each request in the tokenizer's chat template (the harness's ``apply_chat_template``)."""

    RANGES: ClassVar[Ranges] = {"num_fewshot": NON_NEGATIVE, "limit": AT_LEAST_1, "batch_size": BATCH}

    def __post_init__(self):
        check_ranges(self, self.RANGES)


@functools.cache
def sharded_lm_class():
    """:class:`ShardedHFLM`, defined once, when first asked for: importing the harness takes seconds."""
    import torch
    from lm_eval.models.huggingface import HFLM

    from areal_eval import distributed

    class ShardedHFLM(HFLM):
        """The harness's HF model, answering shard ``shard`` of ``shards`` of every request list
        and gathering the others' from the process group (one result per shard)."""

        def __init__(self, *args, shard: int = 0, shards: int = 1, **kwargs):
            super().__init__(*args, **kwargs)
            self.shard, self.shards = shard, shards

        def _all_shards(self, answer, requests, **kwargs):
            mine = answer(requests[self.shard :: self.shards], **kwargs)
            if distributed.world_size() == 1:
                return mine
            gathered: list = [None] * distributed.world_size()
            torch.distributed.all_gather_object(gathered, (self.shard, mine))
            results: list = [None] * len(requests)
            for shard, answers in dict(reversed(gathered)).items():  # model-parallel peers agree
                results[shard :: self.shards] = answers
            return results

        def loglikelihood(self, requests, disable_tqdm: bool = True):
            return self._all_shards(super().loglikelihood, requests, disable_tqdm=True)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = True):
            return self._all_shards(super().loglikelihood_rolling, requests, disable_tqdm=True)

        def generate_until(self, requests, disable_tqdm: bool = True):
            return self._all_shards(super().generate_until, requests, disable_tqdm=True)

    return ShardedHFLM


def flatten_results(results: dict) -> dict[str, float]:
    """``task/metric`` (and ``task/metric_stderr``) from the harness's ``results`` section; a
    filter other than ``none`` is kept in the name (``task/exact_match_strict-match``)."""
    flat = {}
    for task, values in results.items():
        for key, value in values.items():
            if "," not in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue  # "alias", "N/A" standard errors
            metric, filtering = key.split(",", 1)
            name = metric if filtering == "none" else f"{metric}_{filtering}"
            flat[f"{task}/{name}"] = float(value)
    return flat


@functools.cache
def task_manager(include_path: str | None, tasks: tuple[str, ...]):
    """The harness's task index: of ``include_path`` alone when it holds every task (indexing the
    harness's built-in tasks takes about 15 s here), else of both. Kept for the process's life,
    so warm workers index once."""
    from lm_eval.tasks import TaskManager

    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=include_path)


def run_tasks(
    model, tokenizer, cfg: LMEvalConfig, *, shard: int = 0, shards: int = 1, samples: bool = False
) -> tuple[dict[str, float], list[dict]]:
    """The harness's ``simple_evaluate`` of ``cfg.tasks`` on ``model``, its requests answered in
    ``shards`` shards (this rank's: ``shard``): flattened metrics, and with ``samples`` every
    document's scores (:func:`sample_rows`). Both empty on a rank whose ``LOCAL_RANK`` is not 0:
    the harness returns its results on one rank per node."""
    from lm_eval import simple_evaluate

    lm = sharded_lm_class()(
        pretrained=model, tokenizer=tokenizer, batch_size=cfg.batch_size, shard=shard, shards=shards
    )
    out = simple_evaluate(
        model=lm,
        tasks=list(cfg.tasks),
        num_fewshot=cfg.num_fewshot,
        limit=cfg.limit,
        task_manager=task_manager(cfg.include_path, tuple(cfg.tasks)),
        log_samples=samples,
        apply_chat_template=cfg.chat_template,
        random_seed=cfg.seed,
        numpy_random_seed=cfg.seed,
        torch_random_seed=cfg.seed,
        fewshot_random_seed=cfg.seed,
    )
    if not out:  # the harness returns results where LOCAL_RANK is 0
        return {}, []
    return flatten_results(out["results"]), sample_rows(out.get("samples") or {})


def sample_rows(samples: dict) -> list[dict]:
    """One row per task, document and filter: ``task``, ``doc_id``, ``filter``, the target, and
    each score under the name its metric has (``acc``; ``exact_match_strict-match`` for another
    filter than ``none``), so the mean of a column over a task's rows is that metric."""
    rows = []
    for task in sorted(samples):
        for sample in sorted(samples[task], key=lambda x: (x["doc_id"], x["filter"])):
            scores = {}
            for metric in sample.get("metrics", ()):
                value = sample.get(metric)
                if isinstance(value, (int, float)):  # a bool too: a 0/1 score
                    name = metric if sample["filter"] == "none" else f"{metric}_{sample['filter']}"
                    scores[name] = float(value)
            rows.append(
                {
                    "task": task,
                    "doc_id": int(sample["doc_id"]),
                    "filter": sample["filter"],
                    "target": str(sample.get("target", "")),
                    **scores,
                }
            )
    return rows


class LMEvalEvaluator(BaseEvaluator):
    """lm-evaluation-harness tasks; metrics ``task/metric`` with ``task/metric_stderr``."""

    name = "lm_eval"

    def __init__(self, cfg: LMEvalConfig | None = None):
        self.cfg = cfg or LMEvalConfig()
        if not self.cfg.tasks:
            raise FieldError("eval.lm_eval.tasks", "name at least one harness task")
        if self.cfg.include_path and not Path(self.cfg.include_path).is_dir():
            raise FieldError("eval.lm_eval.include_path", f"{self.cfg.include_path}: no such directory")

    @classmethod
    def from_settings(cls, settings) -> LMEvalEvaluator:
        return cls(settings.lm_eval)

    @classmethod
    def declared_metric_names(cls, settings):
        return None  # the tasks decide

    def load(self, checkpoint_dir: Path, data_path: Path, allow_pickle: bool = False) -> None:
        self.model, self.tokenizer = causal_lm.load_shared(checkpoint_dir, allow_pickle, self.shared_models, self.dtype)

    def num_samples(self) -> int:
        return 1

    def batches(self, shard, shards, batch_size):
        import torch

        yield {"shard": torch.tensor([shard, shards])}  # every data-parallel head takes part

    def batch_sums(self, batch):
        from areal_eval import distributed

        shard, shards = batch["shard"].tolist()
        first = distributed.rank() == 0
        metrics, rows = run_tasks(
            self.model,
            self.tokenizer,
            self.cfg,
            shard=shard,
            shards=shards,
            samples=first and self.item_rows is not None,
        )
        # Every rank's harness saw all the answers, but only rank 0's result counts (the worker
        # sums over ranks, and a rank that returns nothing adds 0).
        if not first:
            return {}
        for item, row in enumerate(rows):
            self.keep_item(item, **row)
        return metrics

    def metrics(self, sums):
        if not sums:
            raise ValueError(f"lm_eval: tasks {self.cfg.tasks} returned no metrics")
        return {name: value for name, value in sums.items() if math.isfinite(value) or "stderr" not in name}

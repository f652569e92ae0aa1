"""Per-item results of one evaluation: every item's scores (and, for generation, its answers),
gathered from the data-parallel heads, once each, in item order, and written as one parquet
file per evaluator beside the result file.

Size policy: texts (prompts, references, answers) are cut to ``item_text_chars`` characters;
scores are always kept whole. Columns are compressed with zstd, and repeated texts (a prompt
beside each of its samples) are dictionary-encoded, so they are stored once.
"""

from __future__ import annotations

import re
from pathlib import Path

TEXT_COLUMNS = ("prompt", "reference", "answer")


def items_dir(result_path: str | Path) -> Path:
    """Where the per-item files of the result ``result_path`` go: ``<stem>.items/``."""
    result_path = Path(result_path)
    return result_path.with_name(result_path.stem + ".items")


def stored_items(evals_dir: str | Path, step: int) -> dict[str, str]:
    """The per-item files an evaluation of ``step`` left in a run's ``evals`` directory, by
    evaluator (a result read back from the ledger after a restart carries no paths)."""
    from areal_eval.checkpoints.manifest import checkpoint_name

    directory = items_dir(Path(evals_dir) / f"{checkpoint_name(step)}.json")
    return {path.stem: str(path) for path in sorted(directory.glob("*.parquet"))}


def file_name(evaluator: str) -> str:
    return re.sub(r"[^\w.-]", "_", evaluator) + ".parquet"


def gather_items(evaluator, layout) -> dict[str, list[dict]]:
    """Every rank's per-item rows, merged on rank 0 by evaluator, sorted by (item, sample);
    model-parallel peers computed the same batches, so only data-parallel heads contribute.
    Every rank calls it (it gathers); ranks other than 0 get {}."""
    import torch

    from areal_eval import distributed

    mine = evaluator.item_tables() if layout.is_dp_head else {}
    everyone = [mine]
    if distributed.world_size() > 1:
        everyone = [None] * distributed.world_size()
        torch.distributed.all_gather_object(everyone, mine)
    if layout.rank != 0:
        return {}
    merged: dict[str, list[dict]] = {}
    for tables in everyone:
        for name, rows in tables.items():
            merged.setdefault(name, []).extend(rows)
    for name, rows in merged.items():
        rows.sort(key=lambda r: (r["item"], r.get("sample", 0)))
        keys = [(r["item"], r.get("sample", 0)) for r in rows]
        if len(set(keys)) != len(keys):
            raise RuntimeError(f"evaluator {name!r} kept an item twice: its batches overlap across ranks")
    return merged


def write_items(tables: dict[str, list[dict]], directory: Path, text_chars: int | None) -> dict[str, str]:
    """Write each evaluator's rows to ``directory/<evaluator>.parquet``; returns the paths by name."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in tables.items():
        if text_chars is not None:
            rows = [{k: cut(v, text_chars) if k in TEXT_COLUMNS else v for k, v in row.items()} for row in rows]
        path = directory / file_name(name)
        tmp = path.with_suffix(".partial")
        pq.write_table(pa.Table.from_pylist(rows), tmp, compression="zstd")
        tmp.replace(path)
        paths[name] = str(path)
    return paths


def cut(value, chars: int):
    return value[:chars] if isinstance(value, str) else value


SCORE_COLUMNS: dict[str, dict[str, tuple[str, bool | None]]] = {
    "reward_model": {"accuracy": ("correct", None), "margin": ("margin", None), "loss": ("loss", None)},
    "generation": {
        "accuracy": ("reward", True),
        "mean_reward": ("reward", False),
        "response_length": ("length", None),
    },
}
"""The metrics that are means of one per-item column: per evaluator, metric -> (column, which
rows: greedy answers only (True), sampled ones only (False), or all (None))."""


def scores_of(rows: list[dict], column: str, greedy: bool | None) -> tuple[dict, dict | None]:
    """({key: score}, each key's cluster or None): a key per row, ``(item, sample)``; where an
    item has several rows (a prompt's samples) they share a cluster, their item."""
    if greedy is not None and rows and "greedy" in rows[0]:
        rows = [r for r in rows if r["greedy"] == greedy]
    keys = [(r["item"], r.get("sample", 0)) for r in rows]
    scores = {k: float(r[column]) for k, r in zip(keys, rows, strict=True)}
    several = len({k[0] for k in keys}) < len(keys)
    return scores, ({k: k[0] for k in keys} if several else None)


def metric_scores(files: dict[str, str], metric: str) -> tuple[dict, dict | None] | None:
    """The per-item scores whose mean is ``metric`` (``evaluator/name`` in a combined job, else
    the one evaluator's ``name``), read from a result's per-item ``files``; None where the
    metric is not such a mean or its file is missing."""
    if "lm_eval" in files and (metric.startswith("lm_eval/") or len(files) == 1):
        return lm_eval_scores(read_items(files["lm_eval"]), metric.removeprefix("lm_eval/"))
    evaluator, _, name = metric.rpartition("/")
    if not evaluator:
        if len(files) != 1:
            return None
        evaluator = next(iter(files))
    column = SCORE_COLUMNS.get(evaluator, {}).get(name)
    path = files.get(evaluator)
    if column is None or path is None or not Path(path).exists():
        return None
    scores, clusters = scores_of(read_items(path), *column)
    return (scores, clusters) if scores else None


def run_item_scores(evals_dir: str | Path):
    """The alert engine's ``items`` for a run: (step, metric) -> that step's per-item scores of
    the metric, read from the files its evaluation left in ``evals_dir`` (None where none)."""
    return lambda step, metric: metric_scores(stored_items(evals_dir, step), metric)


LM_EVAL_FIELDS = {"item", "task", "doc_id", "filter", "target"}
"""The columns of lm_eval's per-item rows that are not scores (:func:`lm_eval_tasks.sample_rows`)."""


def lm_eval_scores(rows: list[dict], metric: str) -> tuple[dict, None] | None:
    """``task/metric``'s score of every document of the harness's task, by ``doc_id``."""
    task, _, name = metric.rpartition("/")
    scores = {r["doc_id"]: float(r[name]) for r in rows if r.get("task") == task and r.get(name) is not None}
    return (scores, None) if scores else None


def lm_eval_metrics(rows: list[dict]) -> list[str]:
    """The ``task/metric`` names lm_eval's per-item rows score."""
    return sorted({f"{r['task']}/{k}" for r in rows for k, v in r.items() if k not in LM_EVAL_FIELDS and v is not None})


def read_items(path: str | Path) -> list[dict]:
    """The rows of one per-item file, in item order."""
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()

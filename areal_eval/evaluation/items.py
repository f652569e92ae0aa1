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


def read_items(path: str | Path) -> list[dict]:
    """The rows of one per-item file, in item order."""
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()

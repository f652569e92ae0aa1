"""What keeping every item's result costs: evaluation time with and without it, and bytes.

    .venv/bin/python bench/item_cost.py [--rounds 6]

Two warm ranks evaluate the final checkpoint of a small trained run with ``eval.items`` on and
off, alternating (this machine is noisy): the reward model on 2,001 pairs, and a causal LM by
generation (a greedy answer and 4 samples per prompt) and lm_loss on 201 prompts. Reports the
median seconds per evaluation each way, their ratio, the bytes stored per item, and what a run
of 5,000 evaluated checkpoints would keep at that size. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

from common import emit, median
from warm_worker_memory import trained_run


def measure(objective: str, rounds: int, work: Path) -> dict:
    from areal_eval.checkpoints.manifest import Manifest
    from areal_eval.evaluation.jobs import run_evaluation_job
    from areal_eval.evaluation.worker_pool import WarmEvalWorkers

    cfg, run = trained_run(work, objective, valid=2001 if objective == "reward_model" else 201)
    if objective == "sft":
        generation = dataclasses.replace(cfg.eval.generation, n_samples=4, temperature=1.0, k=[1, 4])
        cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, generation=generation))
    event = Manifest(run.manifest).events()[-1]
    seconds: dict[bool, list[float]] = {True: [], False: []}
    stored = items = 0
    with WarmEvalWorkers(2, run.evals / "warm") as workers:
        run_evaluation_job(event, run.valid_data, cfg.eval, run.evals / "warm-up", workers=workers)
        for i in range(rounds):
            for keep in (True, False) if i % 2 == 0 else (False, True):
                eval_cfg = dataclasses.replace(cfg.eval, items=keep)
                start = time.perf_counter()
                result = run_evaluation_job(
                    event, run.valid_data, eval_cfg, run.evals / f"r{i}-{keep}", workers=workers
                )
                seconds[keep].append(time.perf_counter() - start)
                if keep and not stored:
                    from areal_eval.evaluation.items import read_items

                    stored = sum(Path(p).stat().st_size for p in result.items.values())
                    items = sum(len(read_items(p)) for p in result.items.values())
    with_items, without = median(seconds[True]), median(seconds[False])
    return {
        "seconds_with_items": round(with_items, 3),
        "seconds_without_items": round(without, 3),
        "time_ratio_with_to_without": round(with_items / without, 3),
        "rows": items,
        "bytes_per_row": round(stored / items, 1),
        "bytes_per_evaluation": stored,
        "mb_for_5000_evaluations": round(5000 * stored / 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-items-"))
    out = {"benchmark": "item_cost", "rounds": args.rounds, "ranks": 2}
    for objective in ("reward_model", "sft"):
        out[objective] = measure(objective, args.rounds, work / objective)
    emit(out)


if __name__ == "__main__":
    main()

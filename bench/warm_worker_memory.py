"""Memory of warm evaluation workers over many evaluations: it must stay flat.

    .venv/bin/python bench/warm_worker_memory.py [--evaluations 20]

Two warm ranks (``WarmEvalWorkers``, as the flow keeps them) evaluate the checkpoints of a
small trained run in turn, a new checkpoint each time: the reward model, then a causal LM by
generation and lm_loss. After each evaluation it reads every rank's resident memory and peak
(``VmRSS``, ``VmHWM`` in ``/proc/<pid>/status``). Reports, per objective, the ranks' summed
peak after the second evaluation (warmed up: caches and the allocator's arenas are in place)
and after the last, their ratio, and the resident memory's growth per evaluation from the
second on (a least-squares slope). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import emit, prepared_run


def trained_run(work: Path, objective: str, valid: int | None = None):
    """A small run trained 12 steps (checkpoints at 0, 4, 8, 12); ``valid``: validation items."""
    from areal_eval.launchers.local import TorchrunJob

    sections = {
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "objective": objective},
        "train": {"max_steps": 12, "batch_size": 8, "log_every": 4, "save": {"freq_steps": 4}},
        "eval": {"batch_size": 16},
    }
    if objective == "sft":
        sections["data"] = {"math": {"train_problems": 256, "valid_problems": valid or 41}}
        sections["eval"] |= {"evaluator": "generation,lm_loss", "generation": {"max_new_tokens": 16}}
        sections["eval"]["lm_loss"] = {"completion_field": "answer"}
        sections["scheduler"] = {"metric": "generation/accuracy"}
        sections["alerts"] = {"rules": []}
    else:
        sections["data"] = {"synthetic": {"train_pairs": 256, "valid_pairs": valid or 101}}
    cfg, run = prepared_run(f"memory-{objective}", work, **sections)
    job = TorchrunJob("areal_eval.train", ["--config", str(run.train_config)], cfg.train.nproc, run.logs / "train.log")
    job.wait(600)
    job.raise_for_status("training")
    return cfg, run


def status_kb(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def slope(values: list[float]) -> float:
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    return num / sum((i - mean_x) ** 2 for i in range(n))


def measure(objective: str, evaluations: int, work: Path) -> dict:
    import psutil

    from areal_eval.checkpoints.manifest import Manifest
    from areal_eval.evaluation.jobs import run_evaluation_job
    from areal_eval.evaluation.worker_pool import WarmEvalWorkers

    cfg, run = trained_run(work, objective)
    events = Manifest(run.manifest).events()
    rss, peak = [], []
    with WarmEvalWorkers(2, run.evals / "warm") as workers:
        for i in range(evaluations):
            result = run_evaluation_job(events[i % len(events)], run.valid_data, cfg.eval, run.evals, workers=workers)
            assert result.metrics, result
            ranks = psutil.Process(workers.job.proc.pid).children(recursive=True)
            kb = [status_kb(p.pid) for p in ranks]
            rss.append(sum(k["VmRSS"] for k in kb) / 1024)
            peak.append(sum(k["VmHWM"] for k in kb) / 1024)
        started = workers.started_jobs
    return {
        "torchrun_jobs": started,
        "peak_mb_after_2": round(peak[1], 1),
        "peak_mb_after_last": round(peak[-1], 1),
        "peak_ratio_last_to_2": round(peak[-1] / peak[1], 4),
        "rss_mb_by_evaluation": [round(v, 1) for v in rss],
        "rss_growth_mb_per_evaluation": round(slope(rss[1:]), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--evaluations", type=int, default=20)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    out = {"benchmark": "warm_worker_memory", "evaluations": args.evaluations, "ranks": 2}
    for objective in ("reward_model", "sft"):
        out[objective] = measure(objective, args.evaluations, work / objective)
    emit(out)


if __name__ == "__main__":
    main()

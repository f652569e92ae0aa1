"""What a torchrun job's start-up costs: ranks forked from a warmed-up agent against spawned ones.

    .venv/bin/python bench/rank_startup.py [--rounds 3] [--nproc 2]

One evaluation of the demo's reward model (a tiny checkpoint trained here) as a fresh torchrun
job, as the pipeline starts one when no warm workers are kept: ``areal_eval.launchers.forked_ranks`` (the
default) and plain ``torch.distributed.run`` (``AREAL_EVAL_FORK_RANKS=0``), alternating. CPU
seconds are the whole job's (agent and ranks, from ``RUSAGE_CHILDREN``), wall seconds from
launch to result; the metrics of both must be equal. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

from common import emit, median, trained_tiny_run


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_job(event, run, nproc: int, fork: bool, work: Path) -> tuple[float, float, dict]:
    from areal_eval.evaluation.jobs import EvalConfig, run_evaluation_job
    from areal_eval.launchers.local import FORK_RANKS_ENV

    os.environ[FORK_RANKS_ENV] = "1" if fork else "0"
    cpu, start = children_cpu_s(), time.perf_counter()
    result = run_evaluation_job(event, run.valid_data, EvalConfig(nproc=nproc, batch_size=16), work)
    return children_cpu_s() - cpu, time.perf_counter() - start, result.metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    from areal_eval.checkpoints.manifest import Manifest

    work = Path(tempfile.mkdtemp(prefix="bench-rank-startup-"))
    _, run = trained_tiny_run(work)
    event = Manifest(run.manifest).events()[-1]
    seen: dict[str, list] = {"forked": [], "spawned": []}
    for i in range(args.rounds):
        for name in ("spawned", "forked") if i % 2 else ("forked", "spawned"):
            seen[name].append(one_job(event, run, args.nproc, name == "forked", work / f"{name}-{i}"))
    metrics = {name: [m for _, _, m in runs] for name, runs in seen.items()}
    assert all(m == metrics["forked"][0] for runs in metrics.values() for m in runs), metrics
    cpu = {name: median([c for c, _, _ in runs]) for name, runs in seen.items()}
    wall = {name: median([w for _, w, _ in runs]) for name, runs in seen.items()}
    emit(
        {
            "benchmark": "rank_startup",
            "nproc": args.nproc,
            "rounds": args.rounds,
            "cpu_s": {k: round(v, 2) for k, v in cpu.items()},
            "wall_s": {k: round(v, 2) for k, v in wall.items()},
            "cpu_ratio_spawned_over_forked": round(cpu["spawned"] / cpu["forked"], 2),
            "wall_ratio_spawned_over_forked": round(wall["spawned"] / wall["forked"], 2),
            "same_metrics": True,
        }
    )


if __name__ == "__main__":
    main()

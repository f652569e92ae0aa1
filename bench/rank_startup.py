"""What a torchrun job's start-up costs: an agent forked by a fork server, a fresh agent that
forks its ranks, and plain torchrun that spawns them.

    .venv/bin/python bench/rank_startup.py [--rounds 3] [--nproc 2]

One evaluation of the demo's reward model (a tiny checkpoint trained here) as a fresh torchrun
job, as the pipeline starts one when no warm workers are kept, side by side in turns:

- ``fork server`` (the default): the agent forked by this process's fork server
  (:mod:`areal_eval.launchers.fork_server`), which imported torch and transformers once. Its
  first job, which waits for the server's imports, is reported apart (``fork server, first``).
- ``fresh agent`` (``AREAL_EVAL_FORK_SERVER=0``): a new interpreter as the agent, its ranks
  forked from it (:mod:`areal_eval.launchers.forked_ranks`).
- ``spawned`` (``AREAL_EVAL_FORK_RANKS=0``): plain ``torch.distributed.run``.

CPU seconds are the whole job's: agent and ranks, from ``RUSAGE_CHILDREN`` and, for the fork
server's jobs, the CPU the server's children used (the server's own imports are counted in its
first job). Wall seconds from launch to result; the metrics of all must be equal. Prints one
JSON line.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

from common import emit, median, trained_tiny_run

MODES = {
    "fork server": {"AREAL_EVAL_FORK_SERVER": "1", "AREAL_EVAL_FORK_RANKS": "1"},
    "fresh agent": {"AREAL_EVAL_FORK_SERVER": "0", "AREAL_EVAL_FORK_RANKS": "1"},
    "spawned": {"AREAL_EVAL_FORK_SERVER": "0", "AREAL_EVAL_FORK_RANKS": "0"},
}


def cpu_s() -> float:
    """CPU of every job this process started so far: ended children, and the fork servers with
    what they and their ended children used."""
    import psutil

    from areal_eval.launchers import fork_server

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = usage.ru_utime + usage.ru_stime
    for server in list(fork_server._servers.values()):
        try:
            times = psutil.Process(server.proc.pid).cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def one_job(event, run, nproc: int, mode: str, work: Path) -> tuple[float, float, dict]:
    from areal_eval.evaluation.jobs import EvalConfig, run_evaluation_job

    os.environ.update(MODES[mode])
    cpu, start = cpu_s(), time.perf_counter()
    result = run_evaluation_job(event, run.valid_data, EvalConfig(nproc=nproc, batch_size=16), work)
    wall = time.perf_counter() - start
    time.sleep(0.2)  # the server has reaped the agent and counts its CPU
    return cpu_s() - cpu, wall, result.metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    from areal_eval.checkpoints.manifest import Manifest

    work = Path(tempfile.mkdtemp(prefix="bench-rank-startup-"))
    _, run = trained_tiny_run(work)
    event = Manifest(run.manifest).events()[-1]
    seen: dict[str, list] = {"fork server, first": [], **{mode: [] for mode in MODES}}
    seen["fork server, first"].append(one_job(event, run, args.nproc, "fork server", work / "first"))
    order = list(MODES)
    for i in range(args.rounds):
        for mode in order[i % 3 :] + order[: i % 3]:
            seen[mode].append(one_job(event, run, args.nproc, mode, work / f"{mode}-{i}".replace(" ", "-")))
    metrics = [m for runs in seen.values() for _, _, m in runs]
    assert all(m == metrics[0] for m in metrics), metrics
    cpu = {name: median([c for c, _, _ in runs]) for name, runs in seen.items()}
    wall = {name: median([w for _, w, _ in runs]) for name, runs in seen.items()}
    emit(
        {
            "benchmark": "rank_startup",
            "nproc": args.nproc,
            "rounds": args.rounds,
            "cpu_s": {k: round(v, 2) for k, v in cpu.items()},
            "wall_s": {k: round(v, 2) for k, v in wall.items()},
            "cpu_ratio_fresh_agent_over_fork_server": round(cpu["fresh agent"] / cpu["fork server"], 2),
            "wall_ratio_fresh_agent_over_fork_server": round(wall["fresh agent"] / wall["fork server"], 2),
            "cpu_ratio_spawned_over_fresh_agent": round(cpu["spawned"] / cpu["fresh agent"], 2),
            "wall_ratio_spawned_over_fresh_agent": round(wall["spawned"] / wall["fresh agent"], 2),
            "same_metrics": True,
        }
    )


if __name__ == "__main__":
    main()

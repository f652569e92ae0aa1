"""Replay speed: ``areal-eval replay`` on many synthetic curves, wall time and peak memory.

    .venv/bin/python bench/replay_speed.py [--curves 10000] [--points 100]

Writes ``--curves`` learning curves of ``--points`` checkpoints each (saturating, noisy, some
with a late regression; even, geometric and bursty schedules), then runs the CLI exactly as a
user would (``areal-eval replay FILE --policy adaptive --policy fixed:2 --json``) in a child
process, and reports its wall time and peak resident memory. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, emit


def schedule(rng: random.Random, n: int) -> list[int]:
    kind = rng.choice(["even", "geometric", "bursty"])
    if kind == "even":
        return [i * 100 for i in range(n)]
    if kind == "geometric":
        return sorted({0} | {int(10 * 1.08**i) for i in range(n * 2)})[:n]
    steps, step = [], 0
    for _ in range(n):
        steps.append(step)
        step += rng.choice([5, 5, 5, 200])
    return steps


def write_curves(path: Path, curves: int, points: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as fh:
        for c in range(curves):
            steps = schedule(rng, points)
            ceiling, rate, se = rng.uniform(0.5, 0.9), rng.uniform(2, 8), rng.uniform(0.005, 0.02)
            drop_at = rng.randrange(points // 2, points) if rng.random() < 0.3 else points
            values = []
            for i in range(len(steps)):
                v = ceiling * (1 - math.exp(-rate * i / points)) + rng.gauss(0, se)
                values.append(v - (5 * se if i >= drop_at else 0.0))
            row = {
                "curve": f"synthetic-{c}",
                "higher_is_better": True,
                "points": [
                    {"step": s, "value": round(v, 5), "stderr": round(se, 5)}
                    for s, v in zip(steps, values, strict=False)
                ],
            }
            fh.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curves", type=int, default=10_000)
    parser.add_argument("--points", type=int, default=100)
    args = parser.parse_args()
    path = Path(tempfile.mkdtemp(prefix="bench-replay-")) / "curves.jsonl"
    write_curves(path, args.curves, args.points)
    cli = Path(sys.executable).parent / "areal-eval"
    start = time.monotonic()
    out = subprocess.run(
        [str(cli), "replay", str(path), "--policy", "adaptive", "--policy", "fixed:2", "--json"],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    seconds = time.monotonic() - start
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    emit(
        {
            "benchmark": "replay_speed",
            "curves": args.curves,
            "points": args.points,
            "seconds": round(seconds, 1),
            "peak_rss_mb": round(peak_kb / 1024, 1),
            "replay": json.loads(out.stdout.strip().splitlines()[-1]),
        }
    )


if __name__ == "__main__":
    main()

"""Token log-probabilities for ``lm_loss``: row by row (shipped) against the whole batch at once.

    .venv/bin/python bench/logprob_memory.py [--rows 32] [--length 256] [--vocab 32000] [--rounds 2]

The whole-batch way is what ``lm_loss`` did before: the batch's logits in float64, then
``log_softmax`` over all of them. Row by row (``lm_loss.token_logprobs``) holds one row's
float64 logits at a time. Each measurement is a fresh process, alternating; reported: the peak
resident memory each adds over the logits themselves, its seconds, and whether the results are
equal. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from common import ROOT, emit, median

MEASURE = """
import json, resource, sys, time, torch
sys.path.insert(0, {root!r})
from areal_eval.evaluation.lm_loss import token_logprobs
torch.manual_seed(0)
logits = torch.randn({rows}, {length}, {vocab})
targets = torch.randint(0, {vocab}, ({rows}, {length}))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
if {whole}:
    out = torch.log_softmax(logits.double(), dim=-1).gather(-1, targets[:, :, None]).squeeze(-1)
else:
    out = token_logprobs(logits, targets)
seconds = time.perf_counter() - start
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
print(json.dumps({{"mb": grown, "seconds": seconds, "sum": float(out.sum())}}))
"""


def measure(whole: bool, args) -> dict:
    code = MEASURE.format(root=str(ROOT), rows=args.rows, length=args.length, vocab=args.vocab, whole=whole)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"whole_batch": [], "row_by_row": []}
    for _ in range(args.rounds):
        runs["whole_batch"].append(measure(True, args))
        runs["row_by_row"].append(measure(False, args))
    peak = {k: median([r["mb"] for r in v]) for k, v in runs.items()}
    seconds = {k: median([r["seconds"] for r in v]) for k, v in runs.items()}
    emit(
        {
            "shape": [args.rows, args.length, args.vocab],
            "peak_added_mb": {k: round(v, 1) for k, v in peak.items()},
            "peak_ratio": round(peak["row_by_row"] / peak["whole_batch"], 4),
            "seconds": {k: round(v, 3) for k, v in seconds.items()},
            "time_ratio": round(seconds["row_by_row"] / seconds["whole_batch"], 3),
            "equal_results": len({r["sum"] for v in runs.values() for r in v}) == 1,
        }
    )


if __name__ == "__main__":
    main()

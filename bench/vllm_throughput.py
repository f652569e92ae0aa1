"""vLLM against the transformers backend on SmolLM2-135M-Instruct, side by side in one run.

    bash scripts/setup.sh --vllm --smollm2
    .venv-vllm/bin/python bench/vllm_throughput.py [--prompts 64] [--rounds 2]

Both backends decode the same chat-templated arithmetic prompts greedily (``max_new_tokens``
64, float32, one process) through the generation evaluator, alternating rounds. Reports
prompts/s and tokens/s of each (engine start and model load left out), the share of identical
greedy answers, each backend's accuracy, and the vLLM engine's start-up; prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from common import ROOT, emit, median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from areal_eval.data.math_problems import SyntheticMathProblems
    from areal_eval.evaluation.evaluators import make_evaluator
    from areal_eval.evaluation.generation import GenerationConfig
    from areal_eval.evaluation.job_spec import EvaluatorSettings

    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    _, prompts = SyntheticMathProblems(SyntheticMathProblems.Config(10, args.prompts)).generate(work)
    evaluators = {}
    for backend in ("transformers", "vllm"):
        cfg = GenerationConfig(backend=backend, max_new_tokens=64, chat_template=True)
        evaluator = make_evaluator("generation", EvaluatorSettings(generation=cfg, dtype="float32"))
        started = time.monotonic()
        evaluator.load(Path(args.model), prompts)
        evaluators[backend] = (evaluator, time.monotonic() - started)
    runs: dict = {"transformers": [], "vllm": []}
    answers = {}
    for _ in range(args.rounds):
        for backend, (evaluator, _) in evaluators.items():
            ids = evaluator.prompt_ids
            started = time.perf_counter()
            completions = []
            for i in range(0, len(ids), 32):  # the evaluator's batch size
                completions += evaluator.decoder.complete(ids[i : i + 32], [None] * len(ids[i : i + 32]))
            seconds = time.perf_counter() - started
            tokens = sum(len(c.token_ids) for c in completions)
            runs[backend].append({"prompts_per_s": len(ids) / seconds, "tokens_per_s": tokens / seconds})
            answers[backend] = [c.text for c in completions]
    same = sum(a == b for a, b in zip(answers["transformers"], answers["vllm"], strict=True))
    result = {"benchmark": "vllm_throughput", "prompts": args.prompts, "rounds": args.rounds}
    for backend in runs:
        for key in ("prompts_per_s", "tokens_per_s"):
            result[f"{backend}_{key}"] = round(median(r[key] for r in runs[backend]), 1)
    result["vllm_vs_transformers_tokens_per_s"] = round(
        result["vllm_tokens_per_s"] / result["transformers_tokens_per_s"], 2
    )
    result["identical_greedy_answers"] = f"{same}/{len(answers['vllm'])}"
    result["vllm_engine_start_s"] = round(evaluators["vllm"][1], 1)
    result["example"] = json.dumps([answers["transformers"][0], answers["vllm"][0]])[:200]
    emit(result)


if __name__ == "__main__":
    main()

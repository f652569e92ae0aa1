"""bfloat16 against float32 on one causal LM: the memory its evaluation takes, its speed, its results.

    .venv/bin/python bench/dtype_memory.py                        # here: a small model on CPU
    python3 bench/dtype_memory.py --hidden 2048 --layers 16       # a GPU: about 0.8B parameters

A Llama-style model is built from a config with random weights, saved once in float32
(safetensors), then evaluated by ``generation,lm_loss`` (one evaluator pair on one loaded
model, as a worker runs them) in each dtype, alternating, in this process. Needs only torch and
transformers. Reported per dtype: the bytes of the loaded weights, the allocator's peak on a
GPU (None on CPU), generation tokens/s and the loss; then bf16's ratios to float32. (Greedy
answers of random weights sit on near-ties, so they are not compared here; the tests compare
them on trained checkpoints.) Prints one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_checkpoint(work: Path, hidden: int, layers: int, heads: int, problems: int) -> tuple[Path, Path, int]:
    """A causal LM with random weights, in float32, and ``problems`` arithmetic prompts."""
    import torch

    from areal_eval.data.math_problems import SyntheticMathProblems
    from areal_eval.models import causal_lm
    from areal_eval.models.objectives import SFTObjective

    train_rows, valid_rows = SyntheticMathProblems(SyntheticMathProblems.Config(500, problems)).generate(work)
    SFTObjective.train_tokenizer(SFTObjective.read(train_rows), work / "tokenizer", 512)
    tokenizer = SFTObjective.load_tokenizer(work / "tokenizer")
    torch.manual_seed(0)
    model = causal_lm.build_model(tokenizer, hidden_size=hidden, num_layers=layers, num_heads=heads, max_length=128)
    checkpoint = work / "checkpoint"
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    return checkpoint, valid_rows, sum(p.numel() for p in model.parameters())


def evaluate(checkpoint: Path, data: Path, dtype: str, max_new_tokens: int, batch_size: int) -> dict:
    import torch

    from areal_eval import distributed
    from areal_eval.evaluation.evaluators import make_evaluator
    from areal_eval.evaluation.generation import GenerationConfig
    from areal_eval.evaluation.job_spec import EvaluatorSettings
    from areal_eval.evaluation.lm_loss import LMLossConfig
    from areal_eval.evaluation.worker import compute_sums

    on_gpu = torch.cuda.is_available()
    gc.collect()  # the last evaluation's model is gone before the peak is counted anew
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    settings = EvaluatorSettings(
        dtype=dtype,
        generation=GenerationConfig(max_new_tokens=max_new_tokens, reward="exact_match"),
        lm_loss=LMLossConfig(completion_field="answer", max_length=128),
    )
    evaluator = make_evaluator("generation,lm_loss", settings)
    evaluator.load(checkpoint, data)
    generator = evaluator.parts[0]

    weights = sum(p.numel() * p.element_size() for p in generator.model.parameters())
    start = time.perf_counter()
    with torch.inference_mode():
        sums = compute_sums(evaluator, distributed.ParallelLayout(1, 0, 1), batch_size)
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    metrics = evaluator.metrics(sums)
    result = {
        "weights_bytes": weights,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if on_gpu else None,
        "tokens_per_s": round(metrics["generation/response_length"] * metrics["generation/n_answers"] / seconds, 1),
        "loss": metrics["lm_loss/loss"],
    }
    del evaluator, generator
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="evaluations of each dtype, alternating")
    args = parser.parse_args()
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory(prefix="dtype-memory-") as work:
        checkpoint, data, parameters = build_checkpoint(Path(work), args.hidden, args.layers, args.heads, args.prompts)
        runs: dict[str, list[dict]] = {"float32": [], "bfloat16": []}
        for _ in range(args.rounds):
            for dtype in runs:
                runs[dtype].append(evaluate(checkpoint, data, dtype, args.max_new_tokens, args.batch_size))
    best = {dtype: max(r, key=lambda x: x["tokens_per_s"]) for dtype, r in runs.items()}
    f32, b16 = best["float32"], best["bfloat16"]
    result = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "parameters": parameters,
        **best,
        "bf16_weights_ratio": round(b16["weights_bytes"] / f32["weights_bytes"], 3),
        "bf16_peak_ratio": round(b16["peak_allocated_bytes"] / f32["peak_allocated_bytes"], 3)
        if f32["peak_allocated_bytes"]
        else None,
        "bf16_tokens_per_s_ratio": round(b16["tokens_per_s"] / f32["tokens_per_s"], 3),
        "loss_rel_diff": round(abs(b16["loss"] - f32["loss"]) / f32["loss"], 5),
    }
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()

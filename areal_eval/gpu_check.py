"""A check of the library on one NVIDIA GPU, with only torch and transformers installed.

    bash scripts/gpu_check.sh            # on the GPU machine: prints one JSON line
    python -m areal_eval.gpu_check --allow-cpu   # the same steps on the CPU (gloo), to try it here

It brings up an nccl process group; plans training and evaluation on the one GPU with
``eval.share_devices``; trains a small reward model and a causal LM there; evaluates them in
float32 and bfloat16; measures reward-model pairs/s and generation tokens/s; and checks that GPU
memory is back to its baseline after each of several evaluations, as warm workers need.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_group(device) -> dict:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend)
    total = torch.ones(4, device=device)
    dist.all_reduce(total)
    ok = total.sum().item() == 4.0
    dist.destroy_process_group()
    return {"backend": backend, "all_reduce_ok": ok}


def train(model, batches, device, steps: int, loss_fn) -> float:
    import torch

    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for step in range(steps):
        loss = loss_fn(model, {k: v.to(device) for k, v in batches[step % len(batches)].items()})
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return float(loss)


def evaluate(evaluator_name: str, checkpoint: Path, data: Path, dtype: str, **settings) -> tuple[dict, float]:
    from areal_eval import distributed
    from areal_eval.evaluation.evaluators import make_evaluator
    from areal_eval.evaluation.job_spec import EvaluatorSettings
    from areal_eval.evaluation.worker import compute_metrics

    evaluator = make_evaluator(evaluator_name, EvaluatorSettings(dtype=dtype, **settings))
    evaluator.load(checkpoint, data)
    start = time.perf_counter()
    import torch

    with torch.inference_mode():
        metrics = compute_metrics(evaluator, distributed.ParallelLayout(1, 0, 1), 32)
    return metrics, time.perf_counter() - start


def run(work: Path, device) -> dict:
    import torch

    from areal_eval.data.math_problems import SyntheticMathProblems
    from areal_eval.data.preference_data import SyntheticPreferences, read_pairs
    from areal_eval.devices import Visible, plan_devices
    from areal_eval.evaluation.generation import GenerationConfig
    from areal_eval.models import causal_lm, reward_model
    from areal_eval.models.objectives import ModelConfig, SFTObjective

    out: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}
    out["process_group"] = process_group(device)
    plan = plan_devices("auto", "auto", 1, 1, 1, True, Visible.here())
    out["plan"] = {"train": str(plan.train), "eval": str(plan.eval_slots[0])}

    pairs_train, pairs_valid = SyntheticPreferences(SyntheticPreferences.Config(2000, 256)).generate(work / "rm")
    pairs = read_pairs(pairs_train)
    tok_dir = work / "rm" / "tokenizer"
    causal_lm.train_tokenizer([t for p in pairs for t in (p["chosen"], p["rejected"])], tok_dir, 512)
    rm_tok = reward_model.load_tokenizer(tok_dir)
    torch.manual_seed(0)
    rm = reward_model.build_model(ModelConfig(hidden_size=256, num_layers=4, num_heads=4), rm_tok)
    encoded = reward_model.tokenize_pairs(rm_tok, pairs, 64)
    rng = random.Random(0)
    batches = [reward_model.collate_pairs(rng.sample(encoded, 32), rm_tok.pad_token_id) for _ in range(20)]
    rm_loss = lambda m, b: reward_model.bradley_terry_loss(*reward_model.pair_scores(m, b))  # noqa: E731
    baseline = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    out["reward_model_train_loss"] = round(train(rm, batches, device, 60, rm_loss), 4)
    rm_dir = work / "rm" / "checkpoint"
    rm.cpu().save_pretrained(rm_dir)
    rm_tok.save_pretrained(rm_dir)
    del rm
    gc.collect()

    m32, _ = evaluate("reward_model", rm_dir, pairs_valid, "float32")
    m16, seconds = evaluate("reward_model", rm_dir, pairs_valid, "bfloat16")
    out["bf16_vs_fp32"] = {
        "accuracy": [round(m32["accuracy"], 4), round(m16["accuracy"], 4)],
        "loss_rel_diff": round(abs(m16["loss"] - m32["loss"]) / m32["loss"], 5),
    }
    out["reward_model_pairs_per_s_bf16"] = round(m16["n_pairs"] / seconds, 1)

    train_rows, valid_rows = SyntheticMathProblems(SyntheticMathProblems.Config(2000, 64)).generate(work / "sft")
    rows = SFTObjective.read(train_rows)
    SFTObjective.train_tokenizer(rows, work / "sft" / "tokenizer", 512)
    sft_tok = SFTObjective.load_tokenizer(work / "sft" / "tokenizer")
    lm_cfg = ModelConfig(objective="sft", hidden_size=256, num_layers=4, num_heads=4, max_length=64)
    lm = SFTObjective.build_model(lm_cfg, sft_tok)
    examples = SFTObjective.encode(sft_tok, rows, lm_cfg)
    batches = [SFTObjective.collate(rng.sample(examples, 32), sft_tok) for _ in range(20)]
    out["sft_train_loss"] = round(train(lm, batches, device, 100, SFTObjective.loss), 4)
    lm_dir = work / "sft" / "checkpoint"
    lm.cpu().save_pretrained(lm_dir)
    sft_tok.save_pretrained(lm_dir)
    del lm
    gc.collect()

    memory_after = []
    generation = GenerationConfig(max_new_tokens=32)
    for _ in range(3):  # as warm workers do: evaluation after evaluation in one process
        metrics, seconds = evaluate("generation", lm_dir, valid_rows, "bfloat16", generation=generation)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize()
            memory_after.append(torch.cuda.memory_allocated() - baseline)
    out["generation_tokens_per_s_bf16"] = round(metrics["response_length"] * metrics["n_answers"] / seconds, 1)
    out["generation_accuracy"] = round(metrics["accuracy"], 4)
    out["memory_above_baseline_after_each_evaluation_bytes"] = memory_after
    out["memory_back_to_baseline"] = all(m <= (1 << 20) for m in memory_after)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allow-cpu", action="store_true", help="run the same steps on the CPU when there is no GPU")
    args = parser.parse_args(argv)
    import torch

    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    elif args.allow_cpu:
        device = torch.device("cpu")
    else:
        print(json.dumps({"error": "no CUDA device visible to torch (use --allow-cpu to run on the CPU)"}))
        return 1
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="areal-eval-gpu-check-") as work:
        result = run(Path(work), device)
    result["seconds"] = round(time.monotonic() - started, 1)
    result["prefect_or_mlflow_imported"] = sorted(m for m in ("prefect", "mlflow") if m in sys.modules)
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

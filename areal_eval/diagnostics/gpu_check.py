"""A check of the library on one NVIDIA GPU, with only torch and transformers installed.

    bash scripts/gpu_check.sh            # on the GPU machine: prints one JSON line
    python -m areal_eval.diagnostics.gpu_check --allow-cpu   # the same steps on the CPU (gloo), to try it here
    python -m areal_eval.diagnostics.gpu_check --allow-cpu --small   # every step on little data, in seconds

It brings up an nccl process group; plans training and evaluation on the one GPU with
``eval.share_devices``; trains a small reward model and a causal LM there; evaluates them in
float32 and bfloat16; measures reward-model pairs/s and generation tokens/s; checks that GPU
memory is back to its baseline after each of several evaluations, as warm workers need; and
runs the pipeline's own evaluation path on the planned device: warm torchrun workers
that evaluate checkpoint after checkpoint and keep every item's score; and, where Ray is
installed, one ``eval.launcher: ray`` slot on the GPU.

Generation is scored by ``exact_match``, so nothing beyond torch and transformers is needed
(the ``math`` reward would need math-verify).
"""

from __future__ import annotations

import argparse
import dataclasses
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


def train(model, batches, *, device, steps: int, loss_fn) -> float:
    import torch

    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for step in range(steps):
        loss = loss_fn(model, {k: v.to(device) for k, v in batches[step % len(batches)].items()})
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return float(loss.detach())


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How much data and training the check uses."""

    train_pairs: int = 2000
    valid_pairs: int = 256
    train_problems: int = 2000
    valid_problems: int = 64
    reward_model_steps: int = 60
    causal_lm_steps: int = 100
    trainer_steps: int = 60
    """Steps of the pipeline's own trainer (the demo's reward model), saving every third of them."""


SMALL = Sizes(
    trainer_steps=6,
    train_pairs=200,
    valid_pairs=32,
    train_problems=200,
    valid_problems=16,
    reward_model_steps=4,
    causal_lm_steps=4,
)
"""``--small``: every step on little data, for a quick look (what the tests run)."""

MEMORY_SLACK = 1 << 20
"""Bytes of allocated GPU memory an evaluation may leave behind (allocator rounding)."""


def allocated_above(baseline: int, device) -> int:
    """GPU memory allocated by torch now, above ``baseline``, once garbage is collected (0 on CPU)."""
    import torch

    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - baseline


def free_gpu_bytes(placement) -> int | None:
    """The GPU's free memory now, where ``placement`` is on a GPU (None elsewhere): other
    processes' use of the device (workers, a trainer) shows as its fall."""
    import torch

    return torch.cuda.mem_get_info()[0] if placement is not None and placement.kind == "cuda" else None


def taken_since(free_before: int | None, placement) -> int:
    """GPU memory taken since ``free_before`` (see :func:`free_gpu_bytes`); 0 off a GPU."""
    return 0 if free_before is None else free_before - free_gpu_bytes(placement)


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


def run(work: Path, device, sizes: Sizes = Sizes()) -> dict:
    import torch

    from areal_eval.data.math_problems import SyntheticMathProblems
    from areal_eval.data.preference_data import SyntheticPreferences, read_pairs
    from areal_eval.evaluation.generation import GenerationConfig
    from areal_eval.launchers.devices import Visible, plan_devices
    from areal_eval.models import causal_lm, reward_model
    from areal_eval.models.objectives import ModelConfig, SFTObjective

    out: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}
    out["process_group"] = process_group(device)
    plan = plan_devices("auto", "auto", train_nproc=1, eval_nproc=1, slots=1, share=True, visible=Visible.here())
    out["plan"] = {"train": str(plan.train), "eval": str(plan.eval_slots[0])}

    pairs_train, pairs_valid = SyntheticPreferences(
        SyntheticPreferences.Config(sizes.train_pairs, sizes.valid_pairs)
    ).generate(work / "rm")
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
    out["reward_model_train_loss"] = round(
        train(rm, batches, device=device, steps=sizes.reward_model_steps, loss_fn=rm_loss), 4
    )
    rm_dir = work / "rm" / "checkpoint"
    rm.cpu().save_pretrained(rm_dir)
    rm_tok.save_pretrained(rm_dir)
    del rm
    memory = {"after_training": allocated_above(baseline, device)}

    m32, _ = evaluate("reward_model", rm_dir, pairs_valid, "float32")
    evaluate("reward_model", rm_dir, pairs_valid, "bfloat16")  # the first one pays the kernels' start-up
    m16, seconds = evaluate("reward_model", rm_dir, pairs_valid, "bfloat16")
    out["bf16_vs_fp32"] = {
        "accuracy": [round(m32["accuracy"], 4), round(m16["accuracy"], 4)],
        "loss_rel_diff": round(abs(m16["loss"] - m32["loss"]) / m32["loss"], 5),
    }
    out["reward_model_pairs_per_s_bf16"] = round(m16["n_pairs"] / seconds, 1)

    train_rows, valid_rows = SyntheticMathProblems(
        SyntheticMathProblems.Config(sizes.train_problems, sizes.valid_problems)
    ).generate(work / "sft")
    rows = SFTObjective.read(train_rows)
    SFTObjective.train_tokenizer(rows, work / "sft" / "tokenizer", 512)
    sft_tok = SFTObjective.load_tokenizer(work / "sft" / "tokenizer")
    lm_cfg = ModelConfig(objective="sft", hidden_size=256, num_layers=4, num_heads=4, max_length=64)
    lm = SFTObjective.build_model(lm_cfg, sft_tok)
    examples = SFTObjective.encode(sft_tok, rows, lm_cfg)
    batches = [SFTObjective.collate(rng.sample(examples, 32), sft_tok) for _ in range(20)]
    out["sft_train_loss"] = round(
        train(lm, batches, device=device, steps=sizes.causal_lm_steps, loss_fn=SFTObjective.loss), 4
    )
    lm_dir = work / "sft" / "checkpoint"
    lm.cpu().save_pretrained(lm_dir)
    sft_tok.save_pretrained(lm_dir)
    del lm
    gc.collect()

    memory["after_each_evaluation"] = []
    generation = GenerationConfig(max_new_tokens=32, reward="exact_match")
    for _ in range(3):  # as warm workers do: evaluation after evaluation in one process
        metrics, seconds = evaluate("generation", lm_dir, valid_rows, "bfloat16", generation=generation)
        memory["after_each_evaluation"].append(allocated_above(baseline, device))
    out["generation_tokens_per_s_bf16"] = round(metrics["response_length"] * metrics["n_answers"] / seconds, 1)
    out["generation_accuracy"] = round(metrics["accuracy"], 4)
    sampling = GenerationConfig(max_new_tokens=32, reward="exact_match", n_samples=4, temperature=1.0, top_p=0.95)
    sampled = [evaluate("generation", lm_dir, valid_rows, "bfloat16", generation=sampling) for _ in range(2)]
    (first, _), (again, seconds) = sampled
    out["sampled_tokens_per_s_bf16"] = round(again["response_length"] * again["n_answers"] / seconds, 1)
    out["sampled_answers_reproducible"] = first == again  # each answer's own seeded generator, on the device
    # cuBLAS keeps a workspace per handle in torch's allocator for the process's life: constant, reused.
    if device.type == "cuda" and hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()
    memory["without_cublas_workspaces"] = allocated_above(baseline, device)
    after = memory["after_each_evaluation"]
    out["memory_above_baseline_bytes"] = memory
    out["memory_flat_across_evaluations"] = max(after) - min(after) <= MEMORY_SLACK
    out["memory_back_to_baseline"] = memory["without_cublas_workspaces"] <= MEMORY_SLACK
    out["warm_workers"] = warm_worker_evaluations(
        work, plan.eval_slots[0], (rm_dir, pairs_valid, "reward_model"), (lm_dir, valid_rows, "generation,lm_loss")
    )
    out["warm_workers"]["reward_model_accuracy_equals_in_process"] = out["warm_workers"]["accuracy"] == round(
        m16["accuracy"], 4
    )
    out["pipeline_trainer"] = pipeline_trainer(work / "pipeline", plan, sizes)
    out["ray_slot"] = ray_slot(work / "ray", (rm_dir, pairs_valid), device.type == "cuda")
    if "accuracy" in out["ray_slot"]:
        out["ray_slot"]["accuracy_equals_warm_workers"] = out["ray_slot"]["accuracy"] == out["warm_workers"]["accuracy"]
    return out


def ray_slot(work: Path, reward_model_job: tuple, on_gpu: bool) -> dict:
    """``eval.launcher: ray`` on this machine as a one-node cluster: a Ray instance of the check's
    own, one slot (a placement group of one bundle, with the GPU), its node agent's torchrun
    evaluating the reward model in bfloat16. Where Ray is not installed, says so."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return {"skipped": "ray is not installed here: pip install 'ray[default]>=2.40'"}
    from areal_eval.checkpoints.manifest import CheckpointEvent, checkpoint_name, describe_files
    from areal_eval.evaluation.jobs import EvalConfig, run_evaluation_job
    from areal_eval.launchers.ray_slots import RayConfig, RaySlots

    checkpoint, data = reward_model_job
    event = CheckpointEvent("gpu-check", str(checkpoint), 0, 0, 0, time.time(), {}, describe_files(checkpoint))
    cfg = EvalConfig(nproc=1, dtype="bfloat16", launcher="ray", ray=RayConfig(gpus_per_node=1 if on_gpu else 0))
    started = time.monotonic()
    with RaySlots(cfg, work, run_name="gpu-check") as slots, slots.lease() as slot:
        result = run_evaluation_job(event, data, cfg, work / "evals", max_length=64, workers=slot)
        recorded = json.loads((work / "evals" / f"{checkpoint_name(0)}.json").read_text())
        return {
            "agent_devices": slot.nodes[0]["devices"],
            "rank0_devices": recorded["devices"],
            "accuracy": round(result.metrics["accuracy"], 4),
            "seconds_with_start": round(time.monotonic() - started, 2),
            "ray_started_here": slots.started_ray,
        }


def pipeline_trainer(work: Path, plan, sizes: Sizes) -> dict:
    """The demo's trainer (torchrun, the checkpoint writer, the manifest) on ``plan``'s training
    devices, then a fresh evaluation job on its evaluation devices for its first and final
    checkpoints (trained, the accuracy moves)."""

    from areal_eval.checkpoints.manifest import Manifest
    from areal_eval.evaluation.jobs import run_evaluation_job
    from areal_eval.launchers.local import TorchrunJob
    from areal_eval.pipeline.config import load_pipeline_config
    from areal_eval.pipeline.setup import prepare_run

    every = max(1, sizes.trainer_steps // 3)
    params = {
        "run_name": "gpu-check",
        "work_dir": str(work),
        "data": {"synthetic": {"train_pairs": sizes.train_pairs, "valid_pairs": sizes.valid_pairs}},
        "train": {"nproc": 1, "max_steps": sizes.trainer_steps, "save": {"freq_steps": every}},
        "eval": {"nproc": 1, "share_devices": True, "dtype": "bfloat16"},
    }
    cfg = load_pipeline_config(params=params)
    run = prepare_run(cfg)
    free_before, held = free_gpu_bytes(plan.train), 0
    started = time.monotonic()
    job = TorchrunJob(
        "areal_eval.train", ["--config", str(run.train_config)], 1, run.logs / "train.log", placement=plan.train
    )
    while job.poll() is None and time.monotonic() - started < 600:  # what the trainer holds on the GPU
        held = max(held, taken_since(free_before, plan.train))
        time.sleep(0.1)
    job.wait(60)
    job.raise_for_status("training")
    out: dict = {"train_seconds": round(time.monotonic() - started, 1), "gpu_bytes_held_by_trainer": held}
    events = Manifest(run.manifest).events()
    out["checkpoints"] = [e.global_step for e in events]
    for name, event in (("first", events[0]), ("final", events[-1])):
        result = run_evaluation_job(event, run.valid_data, cfg.eval, run.evals, placement=plan.eval_slots[0])
        out[f"accuracy_{name}"] = round(result.metrics["accuracy"], 4)
    return out


def warm_worker_evaluations(work: Path, placement, reward_model_job: tuple, causal_lm_job: tuple) -> dict:
    """The pipeline's evaluation path on ``placement``: one warm torchrun job evaluates the reward
    model at two steps and the causal LM at a third, in bfloat16, keeping every item's score. On a
    GPU, the device's free memory while the workers live shows they hold their model there (one
    rank needs no process group: nccl is checked apart); idle between evaluations, they keep
    little more than their CUDA context."""

    from areal_eval.checkpoints.manifest import CheckpointEvent, describe_files
    from areal_eval.evaluation.generation import GenerationConfig
    from areal_eval.evaluation.jobs import EvalConfig, run_evaluation_job
    from areal_eval.evaluation.lm_loss import LMLossConfig
    from areal_eval.evaluation.worker_pool import WarmEvalWorkers

    generation = GenerationConfig(max_new_tokens=32, reward="exact_match")
    answer_loss = LMLossConfig(completion_field="answer", max_length=64)
    free_before = free_gpu_bytes(placement)
    out: dict = {"placement": str(placement), "seconds": []}
    with WarmEvalWorkers(1, work / "warm", placement=placement) as workers:
        for step, (checkpoint, data, evaluator) in enumerate((reward_model_job, reward_model_job, causal_lm_job)):
            files = describe_files(checkpoint)
            event = CheckpointEvent("gpu-check", str(checkpoint), 0, step, step, time.time(), {}, files)
            cfg = EvalConfig(nproc=1, evaluator=evaluator, dtype="bfloat16", generation=generation, lm_loss=answer_loss)
            result = run_evaluation_job(event, data, cfg, work / "evals", max_length=64, workers=workers)
            out["seconds"].append(round(result.seconds, 2))
            if step == 0:
                out["accuracy"] = round(result.metrics["accuracy"], 4)
                out["gpu_bytes_held_by_workers"] = taken_since(free_before, placement)
            out[f"step_{step}_items"] = {name: Path(path).stat().st_size > 0 for name, path in result.items.items()}
        out["torchrun_jobs_started"] = workers.started_jobs
        deadline = time.monotonic() + 10
        while any(workers.inbox.glob("*.json")) and time.monotonic() < deadline:  # the last job is done
            time.sleep(0.05)
        out["gpu_bytes_held_by_idle_workers"] = taken_since(free_before, placement)
    out["generation_accuracy"] = round(result.metrics["generation/accuracy"], 4)
    out["lm_loss"] = round(result.metrics["lm_loss/loss"], 4)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allow-cpu", action="store_true", help="run the same steps on the CPU when there is no GPU")
    parser.add_argument("--small", action="store_true", help="every step on little data: a quick look, not figures")
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
        result = run(Path(work), device, SMALL if args.small else Sizes())
    result["seconds"] = round(time.monotonic() - started, 1)
    result["prefect_or_mlflow_imported"] = sorted(m for m in ("prefect", "mlflow") if m in sys.modules)
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

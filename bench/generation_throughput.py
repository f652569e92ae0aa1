"""Generation evaluation throughput: the generation evaluator against one ``generate`` per prompt.

    .venv/bin/python bench/generation_throughput.py [--prompts 401] [--rounds 2]

The loop a user would otherwise write: for each prompt, ``model.generate`` (greedy, KV cache),
decode, score. Same checkpoint (the sft-math demo's model after 200 SFT steps), same prompts,
same ``max_new_tokens``, one thread per process; on 1 process and on 2 (torchrun, each rank its
half of the prompts), alternating with areal-eval's evaluation workers (batched, left-padded).
Every measurement is a fresh process; seconds count the generation loop only (loading
excluded on both sides). The answers are compared text for text in this process. Prints one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import emit, median, prepared_run


def per_prompt_answers(checkpoint: Path, prompts: list[str], max_new_tokens: int) -> tuple[float, list[str]]:
    """One ``generate`` call per prompt, as a user's evaluation loop does."""
    import torch

    from areal_eval.models import causal_lm

    model, tok = causal_lm.load_model(checkpoint).eval(), causal_lm.load_tokenizer(checkpoint)
    answers = []
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt")["input_ids"]
            out = model.generate(
                input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
            )
            answers.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return time.perf_counter() - start, answers


def per_prompt_run(checkpoint: Path, prompts_path: Path, max_new_tokens: int, nproc: int, work: Path) -> float:
    """The per-prompt loop in fresh processes: python for 1, torchrun for 2 (a shard each)."""
    out = work / f"per-prompt-{nproc}"
    out.mkdir(parents=True, exist_ok=True)
    spec = json.dumps([str(checkpoint), str(prompts_path), max_new_tokens, str(out)])
    launch = [sys.executable]
    if nproc > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*launch, __file__, "--per-prompt-worker", spec], check=True, stdout=subprocess.DEVNULL, env=env)
    return max(json.loads(p.read_text())["seconds"] for p in out.glob("rank-*.json"))  # the slower rank ends it


def per_prompt_worker(spec: str) -> None:
    import torch

    from areal_eval.data.prompt_data import read_prompts
    from areal_eval.distributed import shard_range

    torch.set_num_threads(1)
    checkpoint, prompts_path, max_new_tokens, out = json.loads(spec)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    prompts = [p["prompt"] for p in read_prompts(prompts_path)]
    mine = [prompts[i] for i in shard_range(len(prompts), rank, world)]
    seconds, answers = per_prompt_answers(Path(checkpoint), mine, max_new_tokens)
    Path(out, f"rank-{rank}.json").write_text(json.dumps({"seconds": seconds, "answers": answers}))


def areal_run(event, prompts_path: Path, cfg, nproc: int, work: Path) -> tuple[float, dict]:
    """The generation evaluator as the pipeline runs it: a torchrun job from its launcher."""
    import dataclasses

    from areal_eval.evaluation.jobs import run_evaluation_job

    result = run_evaluation_job(event, prompts_path, dataclasses.replace(cfg, nproc=nproc), work)
    loop = json.loads((work / f"global_step_{event.global_step:08d}.json").read_text())["eval_loop_seconds"]
    return loop, result.metrics


def batched_answers(checkpoint: Path, prompts_path: Path, generation, batch_size: int) -> list[str]:
    """The evaluator's own decoding, in this process, to compare answers text for text."""
    from areal_eval import distributed
    from areal_eval.evaluation.generation import GenerationEvaluator

    evaluator = GenerationEvaluator(generation)
    evaluator.load(checkpoint, prompts_path)
    answers: dict[int, str] = {}
    for batch in evaluator.batches(0, 1, batch_size):
        indices = batch["prompt_index"].tolist()
        done = evaluator.decoder.complete([evaluator.prompt_ids[i] for i in indices], [None] * len(indices))
        answers.update({i: c.text for i, c in zip(indices, done, strict=True)})
    assert distributed.world_size() == 1
    return [answers[i] for i in range(len(answers))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=401)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--train-steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--per-prompt-worker", help=argparse.SUPPRESS)  # one process of per_prompt_run
    args = parser.parse_args()
    if args.per_prompt_worker:
        return per_prompt_worker(args.per_prompt_worker)

    from areal_eval.checkpoints.manifest import Manifest
    from areal_eval.data.prompt_data import read_prompts
    from areal_eval.evaluation.generation import GenerationConfig
    from areal_eval.evaluation.jobs import EvalConfig
    from areal_eval.launchers.local import TorchrunJob

    work = Path(tempfile.mkdtemp(prefix="bench-generation-"))
    cfg, run = prepared_run(
        "bench-generation",
        work,
        model={"objective": "sft", "num_layers": 2},
        data={"math": {"train_problems": 6000, "valid_problems": args.prompts}},
        train={"epochs": 1, "max_steps": args.train_steps, "save": {"freq_steps": args.train_steps}},
    )
    job = TorchrunJob("areal_eval.train", ["--config", str(run.train_config)], 2, run.logs / "train.log")
    job.wait(900)
    job.raise_for_status("training")
    event = Manifest(run.manifest).events()[-1]
    checkpoint, prompts_path = Path(event.uri), run.valid_data
    generation = GenerationConfig(reward="math", max_new_tokens=args.max_new_tokens)
    eval_cfg = EvalConfig(evaluator="generation", batch_size=args.batch_size, generation=generation)

    seconds: dict[str, list[float]] = {}
    metrics: dict[int, dict] = {}
    for _ in range(args.rounds):  # alternate: this machine is noisy
        for nproc in (1, 2):
            seconds.setdefault(f"per_prompt_{nproc}", []).append(
                per_prompt_run(checkpoint, prompts_path, args.max_new_tokens, nproc, work)
            )
            t, metrics[nproc] = areal_run(event, prompts_path, eval_cfg, nproc, work / f"w{nproc}")
            seconds.setdefault(f"areal_{nproc}", []).append(t)

    prompts = [p["prompt"] for p in read_prompts(prompts_path)]
    _, reference = per_prompt_answers(checkpoint, prompts, args.max_new_tokens)
    ours = batched_answers(checkpoint, prompts_path, generation, args.batch_size)
    identical = sum(a == b for a, b in zip(reference, ours, strict=True))
    tokens = metrics[1]["response_length"] * len(prompts)
    ratio = lambda a, b: round(median(seconds[b]) / median(seconds[a]), 2)  # noqa: E731
    emit(
        {
            "benchmark": "generation_throughput",
            "prompts": len(prompts),
            "batch_size": args.batch_size,
            "max_new_tokens": args.max_new_tokens,
            "rounds": args.rounds,
            **{f"{key}_prompts_per_s": round(len(prompts) / median(v), 1) for key, v in seconds.items()},
            **{f"{key}_tokens_per_s": round(tokens / median(v), 1) for key, v in seconds.items()},
            "speedup_vs_per_prompt_1proc": ratio("areal_1", "per_prompt_1"),
            "speedup_vs_per_prompt_2rank": ratio("areal_2", "per_prompt_2"),
            "scaling_2_vs_1": ratio("areal_2", "areal_1"),
            "identical_answers": f"{identical}/{len(prompts)}",
            "accuracy_1proc": round(metrics[1]["accuracy"], 4),
            "accuracy_2rank": round(metrics[2]["accuracy"], 4),
            "mean_answer_tokens": round(metrics[1]["response_length"], 2),
        }
    )


if __name__ == "__main__":
    main()

"""Evaluation throughput: areal-eval's evaluator against transformers' Trainer.evaluate.

    .venv/bin/python bench/eval_throughput.py [--pairs 2001] [--rounds 3]

Same reward model, same validation pairs, same batch size, one process, A and B alternating;
then on 2 torchrun ranks: areal-eval against Trainer (DDP over gloo), and areal-eval 2 ranks
against 1. Pairs per second count the evaluation loop only
(model loading excluded on both sides). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from common import emit, median, prepared_run


def trainer_evaluate(checkpoint: Path, pairs_path: Path, batch_size: int, max_length: int) -> tuple[float, float]:
    """Pairwise accuracy the way a transformers user would get it: Trainer + compute_metrics."""
    import numpy as np
    import torch
    from transformers import Trainer, TrainingArguments

    from areal_eval import reward_model
    from areal_eval.preference_data import read_pairs

    tok = reward_model.load_tokenizer(checkpoint)
    model = reward_model.load_model(checkpoint)
    items = reward_model.tokenize_pairs(tok, read_pairs(pairs_path), max_length)

    class PairwiseTrainer(Trainer):
        """As TRL's RewardTrainer: one [chosen, rejected] row of scores per pair."""

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            with torch.no_grad():
                chosen, rejected = reward_model.pair_scores(model, inputs)
                loss = reward_model.bradley_terry_loss(chosen, rejected)
            logits = torch.stack([chosen, rejected], dim=1)
            return loss, logits, torch.zeros(logits.shape[0])

    def collate(batch):
        return reward_model.collate_pairs(batch, tok.pad_token_id)

    def compute_metrics(pred):
        scores = np.asarray(pred.predictions)
        return {"accuracy": float((scores[:, 0] > scores[:, 1]).mean()), "n_pairs": len(scores),
                "padding_rows": int((scores == -100).all(axis=1).sum())}

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_eval_batch_size=batch_size, report_to=[],
                                 use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
                                 remove_unused_columns=False)  # pairs are not forward() kwargs
        trainer = PairwiseTrainer(model=model, args=args, eval_dataset=items, data_collator=collate, compute_metrics=compute_metrics)
        start = time.perf_counter()
        metrics = trainer.evaluate()
        return time.perf_counter() - start, metrics


def areal_evaluate(checkpoint: Path, pairs_path: Path, batch_size: int, max_length: int) -> tuple[float, float]:
    from areal_eval import distributed
    from areal_eval.eval_worker import evaluate
    from areal_eval.evaluator import RewardModelEvaluator

    evaluator = RewardModelEvaluator(max_length=max_length)
    evaluator.load(checkpoint, pairs_path)
    start = time.perf_counter()
    metrics = evaluate(evaluator, distributed.ParallelLayout(1, 0, 1), batch_size)
    return time.perf_counter() - start, metrics["accuracy"]


def areal_torchrun(event, pairs_path: Path, batch_size: int, max_length: int, nproc: int, work: Path) -> tuple[float, float]:
    from areal_eval.evaluation import EvalConfig, evaluate_checkpoint

    result = evaluate_checkpoint(event, pairs_path, EvalConfig(nproc=nproc, batch_size=batch_size), work, max_length)
    loop = json.loads((work / f"global_step_{event.global_step:08d}.json").read_text())["eval_loop_seconds"]
    return loop, result.metrics["accuracy"]


def trainer_torchrun(checkpoint: Path, pairs_path: Path, batch_size: int, max_length: int, nproc: int, work: Path) -> tuple[float, float]:
    """Trainer.evaluate on ``nproc`` ranks, as a user would launch it: torchrun, DDP (gloo on CPU)."""
    import subprocess
    import sys

    out = work / f"trainer-{nproc}.json"
    out.unlink(missing_ok=True)
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
         "--trainer-worker", json.dumps([str(checkpoint), str(pairs_path), batch_size, max_length, str(out)])],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    result = json.loads(out.read_text())
    return result["seconds"], result


def trainer_worker(spec: str) -> None:
    import os

    import torch

    torch.set_num_threads(1)
    checkpoint, pairs_path, batch_size, max_length, out = json.loads(spec)
    seconds, metrics = trainer_evaluate(Path(checkpoint), Path(pairs_path), batch_size, max_length)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, **metrics}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2001)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--length-jitter", type=int, default=100, help="extra words per response, 0..N (HH-RLHF-like spread)")
    parser.add_argument("--trainer-worker", help=argparse.SUPPRESS)  # one rank of trainer_torchrun
    args = parser.parse_args()
    if args.trainer_worker:
        return trainer_worker(args.trainer_worker)

    import torch

    torch.set_num_threads(1)  # both sides single-threaded: the comparison is the loop, not BLAS
    from areal_eval import reward_model
    from areal_eval.checkpoint import CheckpointWriter
    from areal_eval.manifest import Manifest

    work = Path(tempfile.mkdtemp(prefix="bench-eval-"))
    cfg, run = prepared_run(
        "bench-eval", work, model={"max_length": 256},
        data={"synthetic": {"train_pairs": 200, "valid_pairs": args.pairs, "length_jitter": args.length_jitter}},
    )
    tok = reward_model.load_tokenizer(run.tokenizer)
    torch.manual_seed(0)
    model = reward_model.build_model(cfg.model, tok)
    writer = CheckpointWriter(model, tok, run.checkpoints, Manifest(run.manifest), "bench")
    writer.save(0, 0, 0, {}, final=True)
    writer.close()
    event = Manifest(run.manifest).events()[0]
    ckpt, pairs, bs, ml = Path(event.uri), run.valid_data, args.batch_size, cfg.model.max_length

    trainer_s, ours_s, accs = [], [], set()
    for _ in range(args.rounds):  # alternate A and B: this machine is noisy
        t, trainer_metrics = trainer_evaluate(ckpt, pairs, bs, ml)
        a = trainer_metrics["eval_accuracy"]
        trainer_s.append(t)
        o, b = areal_evaluate(ckpt, pairs, bs, ml)
        ours_s.append(o)
        accs.add((round(a, 9), round(b, 9)))
    one, two, trainer_two, accs2 = [], [], [], set()
    for _ in range(args.rounds):
        one.append(areal_torchrun(event, pairs, bs, ml, 1, work / "w1")[0])
        t2, trainer2 = trainer_torchrun(ckpt, pairs, bs, ml, 2, work)
        a2 = trainer2["eval_accuracy"]
        trainer_two.append(t2)
        o2, b2 = areal_torchrun(event, pairs, bs, ml, 2, work / "w2")
        two.append(o2)
        accs2.add((round(a2, 9), round(b2, 9)))
    n = args.pairs
    emit({
        "benchmark": "eval_throughput",
        "pairs": n, "batch_size": bs, "rounds": args.rounds, "length_jitter": args.length_jitter,
        "trainer_pairs_per_s": round(n / median(trainer_s), 1),
        "areal_pairs_per_s": round(n / median(ours_s), 1),
        "speedup_vs_trainer": round(median(trainer_s) / median(ours_s), 2),
        "identical_accuracy": all(a == b for a, b in accs),
        "accuracy": sorted(accs)[0][1],
        "areal_1rank_pairs_per_s": round(n / median(one), 1),
        "areal_2rank_pairs_per_s": round(n / median(two), 1),
        "scaling_2_vs_1": round(median(one) / median(two), 2),
        "trainer_2rank_pairs_per_s": round(n / median(trainer_two), 1),
        "speedup_vs_trainer_2rank": round(median(trainer_two) / median(two), 2),
        "identical_accuracy_2rank": all(a == b for a, b in accs2),
        "accuracy_2rank_trainer_areal": sorted(accs2)[0],
        "trainer_2rank_pairs_counted": trainer2["eval_n_pairs"], "trainer_2rank_padding_rows": trainer2["eval_padding_rows"],
    })


if __name__ == "__main__":
    main()

"""Evaluation throughput: areal-eval's evaluation workers against transformers' Trainer.evaluate.

    .venv/bin/python bench/eval_throughput.py [--pairs 2001] [--rounds 3]

Same reward model, same validation pairs, same batch size, one thread per process; on 1 process
and on 2 torchrun ranks (Trainer with DDP over gloo), alternating. Every measurement is a fresh
process: areal-eval as its launcher starts its workers, Trainer as a user would start it
(``python`` for 1 process, ``torchrun`` for 2), and Trainer once more with the heap settings
areal-eval's launcher gives its workers, so the allocator's share of the gain shows. Pairs per
second count the evaluation loop only (model loading excluded on both sides). Prints one JSON
line.
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


def trainer_evaluate(checkpoint: Path, pairs_path: Path, batch_size: int, max_length: int) -> tuple[float, dict]:
    """Pairwise accuracy the way a transformers user would get it: Trainer + compute_metrics."""
    import numpy as np
    import torch
    from transformers import Trainer, TrainingArguments

    from areal_eval.data.preference_data import read_pairs
    from areal_eval.models import reward_model

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
        return {
            "accuracy": float((scores[:, 0] > scores[:, 1]).mean()),
            "n_pairs": len(scores),
            "padding_rows": int((scores == -100).all(axis=1).sum()),
        }

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_eval_batch_size=batch_size,
            report_to=[],
            use_cpu=True,
            dataloader_num_workers=0,
            disable_tqdm=True,
            remove_unused_columns=False,
        )  # pairs are not forward() kwargs
        trainer = PairwiseTrainer(
            model=model, args=args, eval_dataset=items, data_collator=collate, compute_metrics=compute_metrics
        )
        start = time.perf_counter()
        metrics = trainer.evaluate()
        return time.perf_counter() - start, metrics


def trainer_run(
    checkpoint: Path, pairs_path: Path, batch_size: int, max_length: int, nproc: int, work: Path, heap_settings: bool
) -> tuple[float, dict]:
    """Trainer.evaluate in a fresh process: plain python for 1, torchrun (DDP over gloo) for more."""
    from areal_eval.launchers.local import HEAP_SETTINGS

    out = work / f"trainer-{nproc}.json"
    out.unlink(missing_ok=True)
    spec = json.dumps([str(checkpoint), str(pairs_path), batch_size, max_length, str(out)])
    launch = (
        [sys.executable]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    )
    env = {k: v for k, v in os.environ.items() if k not in HEAP_SETTINGS}
    env.update({"OMP_NUM_THREADS": "1", **(HEAP_SETTINGS if heap_settings else {})})
    subprocess.run(
        [*launch, __file__, "--trainer-worker", spec],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    result = json.loads(out.read_text())
    return result["seconds"], result


def trainer_worker(spec: str) -> None:
    import torch

    torch.set_num_threads(1)
    checkpoint, pairs_path, batch_size, max_length, out = json.loads(spec)
    seconds, metrics = trainer_evaluate(Path(checkpoint), Path(pairs_path), batch_size, max_length)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, **metrics}))


def areal_run(event, pairs_path: Path, batch_size: int, max_length: int, nproc: int, work: Path) -> tuple[float, float]:
    """areal-eval's evaluation as the pipeline runs it: a torchrun job from its launcher."""
    from areal_eval.evaluation.jobs import EvalConfig, run_evaluation_job

    result = run_evaluation_job(
        event, pairs_path, EvalConfig(nproc=nproc, batch_size=batch_size), work, max_length=max_length
    )
    loop = json.loads((work / f"global_step_{event.global_step:08d}.json").read_text())["eval_loop_seconds"]
    return loop, result.metrics["accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2001)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--length-jitter", type=int, default=100, help="extra words per response, 0..N (HH-RLHF-like spread)"
    )
    parser.add_argument("--trainer-worker", help=argparse.SUPPRESS)  # one Trainer process of trainer_run
    args = parser.parse_args()
    if args.trainer_worker:
        return trainer_worker(args.trainer_worker)

    import torch

    from areal_eval.checkpoints.manifest import Manifest
    from areal_eval.checkpoints.saving import CheckpointWriter
    from areal_eval.models import reward_model

    work = Path(tempfile.mkdtemp(prefix="bench-eval-"))
    cfg, run = prepared_run(
        "bench-eval",
        work,
        model={"max_length": 256},
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

    seconds: dict[str, list[float]] = {}
    accuracies: dict[int, set] = {1: set(), 2: set()}
    counted = {}
    for _ in range(args.rounds):  # alternate: this machine is noisy
        for nproc in (1, 2):
            t, plain = trainer_run(ckpt, pairs, bs, ml, nproc, work, heap_settings=False)
            seconds.setdefault(f"trainer_{nproc}", []).append(t)
            t, tuned = trainer_run(ckpt, pairs, bs, ml, nproc, work, heap_settings=True)
            seconds.setdefault(f"trainer_heap_{nproc}", []).append(t)
            t, ours = areal_run(event, pairs, bs, ml, nproc, work / f"w{nproc}")
            seconds.setdefault(f"areal_{nproc}", []).append(t)
            accuracies[nproc] |= {round(plain["eval_accuracy"], 9), round(tuned["eval_accuracy"], 9), round(ours, 9)}
            counted[nproc] = (plain["eval_n_pairs"], plain["eval_padding_rows"])
    n = args.pairs
    rate = {key: round(n / median(values), 1) for key, values in seconds.items()}
    ratio = lambda a, b: round(median(seconds[b]) / median(seconds[a]), 2)  # noqa: E731
    emit(
        {
            "benchmark": "eval_throughput",
            "pairs": n,
            "batch_size": bs,
            "rounds": args.rounds,
            "length_jitter": args.length_jitter,
            **{f"{key}_pairs_per_s": value for key, value in rate.items()},
            "speedup_vs_trainer_1proc": ratio("areal_1", "trainer_1"),
            "speedup_vs_trainer_2rank": ratio("areal_2", "trainer_2"),
            "speedup_vs_trainer_same_heap_1proc": ratio("areal_1", "trainer_heap_1"),
            "speedup_vs_trainer_same_heap_2rank": ratio("areal_2", "trainer_heap_2"),
            "scaling_2_vs_1": ratio("areal_2", "areal_1"),
            "identical_accuracy_1proc": len(accuracies[1]) == 1,
            "identical_accuracy_2rank": len(accuracies[2]) == 1,
            "accuracy": sorted(accuracies[1] | accuracies[2]),
            "trainer_2rank_pairs_counted": counted[2][0],
            "trainer_2rank_padding_rows": counted[2][1],
        }
    )


if __name__ == "__main__":
    main()

"""A loop written the way AReaL's trainers call its ``Evaluator``, with the import swapped:
due evaluations publish the checkpoint instead of blocking training.

    python -m examples.areal_loop --run-dir runs/areal-demo [--epochs 2 --freq-steps 4]
    torchrun --nproc-per-node 2 -m examples.areal_loop --run-dir runs/areal-demo

AReaL's trainer code is unchanged but for the import and the ``publish`` argument:
``evaluator.evaluate(evaluate_fn, epoch, step, global_step)`` after every step.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from areal_eval import distributed
from areal_eval.integrations.areal import Evaluator, EvaluatorConfig, FinetuneSpec, PublishCheckpoint
from areal_eval.runs.directives import scale_learning_rate
from examples.common import ddp_setup, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--freq-steps", type=int, default=4)
    args = parser.parse_args()

    model, ddp, optimizer, tokenizer, examples, valid_path = ddp_setup(args.run_dir / "data")
    batch_size = 16
    ft_spec = FinetuneSpec(args.epochs, len(examples) // distributed.world_size(), batch_size)

    def save(directory: Path) -> None:  # every rank calls it; rank 0 writes the full model
        if distributed.rank() == 0:
            model.save_pretrained(directory)
            tokenizer.save_pretrained(directory)

    def act(directive) -> str | None:  # what evaluation asks of training: applied, or why not
        if directive.action == "lr_scale":
            return scale_learning_rate(directive, optimizer)
        return None if directive.action == "stop" else f"this loop does not {directive.action}"

    evaluator = Evaluator(
        EvaluatorConfig(freq_steps=args.freq_steps, eval_before_train=True),
        ft_spec,
        publish=PublishCheckpoint(
            save,
            args.run_dir / "checkpoints",
            args.run_dir / "manifest.jsonl",
            args.run_dir.name,
            valid_data=valid_path,
        ),
        act=act,
    )
    evaluator.before_train()  # the untouched weights, as step 0
    rng = random.Random(distributed.rank())
    global_step = 0
    for epoch in range(ft_spec.total_train_epochs):
        for step in range(ft_spec.steps_per_epoch):
            train_step(ddp, optimizer, examples, tokenizer.pad_token_id, rng, batch_size)
            evaluator.evaluate(None, epoch, step, global_step)  # as AReaL's trainers call it
            global_step += 1
            if evaluator.stopped:
                break
        if evaluator.stopped:
            break
    if distributed.rank() == 0:
        print(f"published steps {evaluator.published} to {args.run_dir / 'manifest.jsonl'}")
    del ddp  # free the DDP wrapper before the group goes (see distributed.shutdown)
    distributed.shutdown()


if __name__ == "__main__":
    main()

"""A plain PyTorch DDP loop that joins the pipeline with one call: ``publish_checkpoint``.

    torchrun --nproc-per-node 2 -m examples.ddp_loop --run-dir runs/ddp-demo [--steps 12 --save-every 4]

Rank 0 saves the model the way evaluation loads it (``save_pretrained``: safetensors, config,
tokenizer) and publishes it: sizes and sha256 into the run's manifest, then the event to
``$PREFECT_API_URL`` when it is set. Training never waits for an evaluation. At each step the
ranks take what evaluation asks of them (a stop, a lower learning rate) and answer it.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from areal_eval import distributed
from areal_eval.checkpoints.manifest import checkpoint_name
from areal_eval.checkpoints.publisher import publish_checkpoint
from areal_eval.runs.directives import Inbox, scale_learning_rate
from examples.common import ddp_setup, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=4)
    args = parser.parse_args()

    model, ddp, optimizer, tokenizer, examples, valid_path = ddp_setup(args.run_dir / "data")
    rng = random.Random(distributed.rank())
    inbox = Inbox(args.run_dir)  # what evaluation asks of training (docs/feedback.md)
    stop = False
    for step in range(1, args.steps + 1):
        loss = train_step(ddp, optimizer, examples, tokenizer.pad_token_id, rng)
        for directive in inbox.take():  # every rank gets the same, at the same step
            refused = None
            if directive.action == "stop":
                stop = True
            elif directive.action == "lr_scale":
                refused = scale_learning_rate(directive, optimizer)
            else:
                refused = f"this loop does not {directive.action}"
            print(f"rank {distributed.rank()}: {inbox.answer(directive, step, refused).line()}", flush=True)
        if (step % args.save_every == 0 or step == args.steps or stop) and distributed.rank() == 0:
            directory = args.run_dir / "checkpoints" / checkpoint_name(step)
            model.save_pretrained(directory)
            tokenizer.save_pretrained(directory)
            publish_checkpoint(  # the one call to add
                directory,
                args.run_dir / "manifest.jsonl",
                run_id=args.run_dir.name,
                global_step=step,
                train_metrics={"loss": loss},
                final=step == args.steps or stop,
                valid_data=valid_path,
            )
        if stop:
            break
    del ddp  # free the DDP wrapper before the group goes (see distributed.shutdown)
    distributed.shutdown()


if __name__ == "__main__":
    main()

"""An FSDP2 training loop that saves sharded checkpoints with torch.distributed.checkpoint and
publishes them for evaluation (what a torchtitan-style trainer adds to join the pipeline).

    torchrun --nproc-per-node 2 -m examples.dcp_loop --init CHECKPOINT --data train.jsonl \\
        --run-dir runs/fsdp-run --steps 8 --save-every 4 [--format hf|distcp]

``--init`` is a reward model saved with ``save_pretrained`` (its config and tokenizer are
published with every checkpoint, so the evaluation workers can build the model and load the
shards into it). ``--format hf`` (the default) saves safetensors shards with DCP's
``HuggingFaceStorageWriter``; ``distcp`` saves DCP's default format, whose ``.metadata`` is a
pickle, which the workers load only with ``eval.allow_pickle: true``.
"""

from __future__ import annotations

import argparse
import random
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
from torch.distributed.fsdp import fully_shard

from areal_eval import distributed
from areal_eval.checkpoints.manifest import checkpoint_name
from areal_eval.checkpoints.publisher import publish_checkpoint
from areal_eval.data.preference_data import read_pairs
from areal_eval.models import reward_model
from examples.common import train_step


def save_sharded(model, directory: Path, fmt: str, init: Path) -> None:
    """Every rank writes its shards; rank 0 adds the config and tokenizer beside them."""
    if distributed.rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    distributed.barrier()
    writer = (
        HuggingFaceStorageWriter(str(directory), save_distributed=True)
        if fmt == "hf"
        else dcp.FileSystemWriter(str(directory))
    )
    dcp.save(model.state_dict(), storage_writer=writer)
    if distributed.rank() == 0:
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(init / name, directory / name)
    distributed.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--format", choices=("hf", "distcp"), default="hf")
    args = parser.parse_args()

    distributed.init(timeout_s=60)
    torch.manual_seed(0)
    tokenizer = reward_model.load_tokenizer(args.init)
    model = reward_model.load_model(args.init)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)  # parameters are now DTensors, sharded over the ranks
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pairs = reward_model.tokenize_pairs(tokenizer, read_pairs(args.data), max_length=64)
    rng = random.Random(distributed.rank())
    manifest, run_id = args.run_dir / "manifest.jsonl", args.run_dir.name
    for step in range(1, args.steps + 1):
        train_step(model, optimizer, pairs, tokenizer.pad_token_id, rng)
        if step % args.save_every == 0 or step == args.steps:
            directory = args.run_dir / "checkpoints" / checkpoint_name(step)
            save_sharded(model, directory, args.format, args.init)
            if distributed.rank() == 0:
                publish_checkpoint(directory, manifest, run_id, step, final=step == args.steps)
    distributed.shutdown()


if __name__ == "__main__":
    main()

"""What the examples share: a tiny reward model and synthetic preference data, so each example
runs on a laptop CPU in seconds. Swap in your own model and data."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from areal_eval import distributed
from areal_eval.data.preference_data import SyntheticPreferences, read_pairs
from areal_eval.models import reward_model
from areal_eval.models.objectives import ModelConfig


def tiny_reward_model(work: Path, config: ModelConfig | None = None):
    """Synthetic preference pairs under ``work`` (train and valid), a tokenizer trained on them
    and a fresh Llama reward model (one tiny layer, or of ``config``); returns (train pairs,
    valid path, tokenizer, model).

    Under torchrun, rank 0 writes the data and the tokenizer and every rank reads them, so all
    ranks share one vocabulary."""
    if distributed.rank() == 0:
        train_path, _ = SyntheticPreferences(SyntheticPreferences.Config(train_pairs=160, valid_pairs=41)).generate(
            work
        )
        reward_model.train_tokenizer(SyntheticPreferences.corpus(read_pairs(train_path)), work / "tokenizer")
    distributed.barrier()
    tokenizer = reward_model.load_tokenizer(work / "tokenizer")
    config = config or ModelConfig(hidden_size=32, num_layers=1, num_heads=2)
    return (
        read_pairs(work / "train.jsonl"),
        work / "valid.jsonl",
        tokenizer,
        reward_model.build_model(config, tokenizer),
    )


def ddp_setup(work: Path):
    """Join torchrun's process group (if any), then the tiny model (wrapped in DDP on more than
    one rank), AdamW and the tokenized training pairs; returns (model, ddp, optimizer,
    tokenizer, examples, valid path)."""
    distributed.init(timeout_s=60)
    torch.manual_seed(0)  # the same initial weights on every rank
    pairs, valid_path, tokenizer, model = tiny_reward_model(work)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if distributed.world_size() > 1 else model
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    return model, ddp, optimizer, tokenizer, reward_model.tokenize_pairs(tokenizer, pairs, max_length=64), valid_path


def train_step(model, optimizer, examples: list[dict], pad_id: int, rng: random.Random, batch_size: int = 8) -> float:
    """One Bradley-Terry step on a random batch of pairs; returns the loss."""
    batch = reward_model.collate_pairs(rng.sample(examples, batch_size), pad_id)
    loss = reward_model.bradley_terry_loss(*reward_model.pair_scores(model, batch))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()

"""What the examples share: a tiny reward model and synthetic preference data, so each example
runs on a laptop CPU in seconds. Swap in your own model and data."""

from __future__ import annotations

from pathlib import Path

from areal_eval import distributed, reward_model
from areal_eval.preference_data import SyntheticPreferences, read_pairs


def tiny_reward_model(work: Path):
    """Synthetic preference pairs under ``work`` (train and valid), a tokenizer trained on them
    and a fresh one-layer Llama reward model; returns (train pairs, valid path, tokenizer, model).

    Under torchrun, rank 0 writes the data and the tokenizer and every rank reads them, so all
    ranks share one vocabulary."""
    if distributed.rank() == 0:
        train_path, _ = SyntheticPreferences(SyntheticPreferences.Config(train_pairs=160, valid_pairs=41)).generate(
            work
        )
        reward_model.train_tokenizer(SyntheticPreferences.corpus(read_pairs(train_path)), work / "tokenizer")
    distributed.barrier()
    tokenizer = reward_model.load_tokenizer(work / "tokenizer")
    config = reward_model.RewardModelConfig(hidden_size=32, num_layers=1, num_heads=2)
    return (
        read_pairs(work / "train.jsonl"),
        work / "valid.jsonl",
        tokenizer,
        reward_model.build_model(config, tokenizer),
    )

"""What the embedded trainer optimizes: a reward model on preference pairs, or a causal LM by
SFT on prompts with answers. Each objective owns its data, tokenizer, model and loss, so the
training loop and the run's set-up are the same for both.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from areal_eval.config.parsing import TOKENS, Bounds, FieldError, Ranges, check_ranges
from areal_eval.data.math_problems import SyntheticMathProblems
from areal_eval.data.preference_data import SyntheticPreferences, read_pairs
from areal_eval.data.prompt_data import read_prompts
from areal_eval.models import causal_lm, reward_model

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass
class ModelConfig:
    objective: str = "reward_model"
    """``reward_model`` (Bradley-Terry loss on preference pairs, a sequence classifier) or
    ``sft`` (next-token loss on the answers of prompt/answer rows, a causal LM)."""
    pretrained_path: str | None = None
    """Local path of a model to start from (``from_pretrained``); None builds a fresh one."""
    tokenizer_path: str | None = None
    """Local tokenizer path; None trains one on the training data."""
    hidden_size: int = 128
    """Width of the freshly built model."""
    num_layers: int = 4
    """Transformer layers of the freshly built model."""
    num_heads: int = 4
    """Attention heads of the freshly built model."""
    max_length: int = 64
    """Token limit per sequence; longer texts are truncated from the left (keep the answer)."""
    vocab_size: int = 512
    """Vocabulary size of a locally trained tokenizer."""
    chat_template: bool = False
    """SFT only: train on each prompt as a user turn in the tokenizer's chat template and its
    answer as the assistant's turn (an instruct model's own format). Evaluate with the
    evaluators' ``chat_template`` set the same way."""

    CHOICES: ClassVar[dict] = {"objective": lambda: list(OBJECTIVES)}
    RANGES: ClassVar[Ranges] = {
        "hidden_size": Bounds(1, 65536),
        "num_layers": Bounds(1, 1024),
        "num_heads": Bounds(1, 1024),
        "max_length": Bounds(2, TOKENS.high),
        "vocab_size": Bounds(16, 1 << 22),
    }

    def __post_init__(self):
        check_ranges(self, self.RANGES)
        if self.hidden_size % self.num_heads:
            raise FieldError("hidden_size", f"{self.hidden_size} must be divisible by num_heads ({self.num_heads})")
        if self.objective not in OBJECTIVES:
            raise FieldError("objective", f"{self.objective!r} is not one of {', '.join(OBJECTIVES)}")
        if self.chat_template and self.objective != "sft":
            raise FieldError("chat_template", "applies to objective: sft only (a reward model scores whole texts)")


class RewardModelObjective:
    """Preference pairs (HH-RLHF form), a sequence classifier, the Bradley-Terry loss."""

    read = staticmethod(read_pairs)
    load_tokenizer = staticmethod(reward_model.load_tokenizer)
    load_model = staticmethod(reward_model.load_model)
    build_model = staticmethod(reward_model.build_model)

    @staticmethod
    def synthetic(data_cfg) -> SyntheticPreferences:
        return SyntheticPreferences(data_cfg.synthetic)

    @staticmethod
    def train_tokenizer(rows: list[dict], out_dir: Path, vocab_size: int):
        return reward_model.train_tokenizer(SyntheticPreferences.corpus(rows), out_dir, vocab_size)

    @staticmethod
    def encode(tokenizer, rows: list[dict], cfg: ModelConfig) -> list[dict]:
        return reward_model.tokenize_pairs(tokenizer, rows, cfg.max_length)

    @staticmethod
    def collate(items: list[dict], tokenizer) -> dict[str, torch.Tensor]:
        return reward_model.collate_pairs(items, tokenizer.pad_token_id)

    @staticmethod
    def loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        chosen, rejected = reward_model.pair_scores(model, batch)
        return reward_model.bradley_terry_loss(chosen, rejected)


class SFTObjective:
    """Prompt/answer rows, a causal LM, the mean next-token loss over answer tokens (and the
    end-of-sequence token, so the model learns to stop)."""

    read = staticmethod(read_prompts)
    load_tokenizer = staticmethod(causal_lm.load_tokenizer)
    load_model = staticmethod(causal_lm.load_model)

    @staticmethod
    def build_model(cfg: ModelConfig, tokenizer):
        return causal_lm.build_model(
            tokenizer,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            max_length=max(128, cfg.max_length),
        )

    @staticmethod
    def synthetic(data_cfg) -> SyntheticMathProblems:
        return SyntheticMathProblems(data_cfg.math)

    @staticmethod
    def train_tokenizer(rows: list[dict], out_dir: Path, vocab_size: int):
        return causal_lm.train_tokenizer(SyntheticMathProblems.corpus(rows), out_dir, vocab_size)

    @staticmethod
    def encode(tokenizer, rows: list[dict], cfg: ModelConfig) -> list[dict]:
        # Prompt and answer are tokenized apart, as the generation and lm_loss evaluators do.
        items, chat, max_length = [], cfg.chat_template, cfg.max_length
        for row in rows:
            where = f"line {row['line']} of the training data"
            answer = causal_lm.encode_answer(tokenizer, row["answer"], chat)[: max_length - 2]
            answer.append(tokenizer.eos_token_id)  # in a chat template, the end of the assistant's turn
            whole = causal_lm.encode_prompt(
                tokenizer, row["prompt"], chat_template=chat, where=where, setting="model.chat_template"
            )
            prompt = whole[-(max_length - len(answer)) :]
            items.append({"ids": prompt + answer, "context": len(prompt)})
        return items

    @staticmethod
    def collate(items: list[dict], tokenizer) -> dict[str, torch.Tensor]:
        import torch

        width = max(len(item["ids"]) for item in items)
        ids = torch.full((len(items), width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        mask = torch.zeros_like(ids)
        for row, item in enumerate(items):
            n = len(item["ids"])
            ids[row, :n] = torch.tensor(item["ids"])
            labels[row, item["context"] : n] = ids[row, item["context"] : n]
            mask[row, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    @staticmethod
    def loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss


OBJECTIVES = {"reward_model": RewardModelObjective, "sft": SFTObjective}


def objective(name: str):
    return OBJECTIVES[name]

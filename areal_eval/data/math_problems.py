"""Arithmetic word problems with verifiable answers: the causal-LM demo's SFT task.

Rows are ``{"prompt": str, "answer": str}`` in GSM8K's form: a worked solution whose final
answer follows ``#### ``, so the ``math`` verifier (math-verify) and ``exact_match`` both score
them. A small model learns the format within a few dozen steps and the arithmetic over a few
hundred, so greedy accuracy climbs from 0 towards 1 within minutes on CPUs.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from areal_eval import jsonl

_NAMES = "Ann Ben Cleo Dan Eva Finn Gus Hana Ivo Jade".split()
_ITEMS = "apples pears coins books shells stamps cards marbles".split()


@dataclasses.dataclass
class SyntheticMathProblems:
    """Additions and subtractions of small numbers, told as a story with a worked answer."""

    @dataclasses.dataclass
    class Config:
        train_problems: int = 6000
        """Training problems to generate."""
        valid_problems: int = 101
        """Validation prompts; odd by default, so exact sharding is exercised."""
        max_number: int = 9
        """Operands are drawn from 0..max_number (differences are never negative)."""
        seed: int = 0
        """Seed of the generator; the same seed gives the same files."""

        def __post_init__(self):
            if self.train_problems < 1 or self.valid_problems < 1:
                raise ValueError("train_problems and valid_problems must be positive")
            if self.max_number < 1:
                raise ValueError("max_number must be positive")

    config: Config

    def problem(self, rng: random.Random) -> dict:
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b = rng.randint(0, self.config.max_number), rng.randint(0, self.config.max_number)
        if rng.random() < 0.5:
            story, result = f"{name} has {a} {item} and gets {b} more.", f"{a} + {b} = {a + b}"
            value = a + b
        else:
            a, b = max(a, b), min(a, b)
            story, result = f"{name} has {a} {item} and gives away {b}.", f"{a} - {b} = {a - b}"
            value = a - b
        # The answer starts with its separating space: prompt + answer is the training text.
        return {"prompt": f"Q: {story} How many {item} does {name} have now?\nA:", "answer": f" {result} #### {value}"}

    def generate(self, out_dir: str | Path) -> tuple[Path, Path]:
        """Write ``train.jsonl`` and ``valid.jsonl`` under ``out_dir``; returns their paths."""
        rng = random.Random(self.config.seed)
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        train = [self.problem(rng) for _ in range(self.config.train_problems)]
        valid = [self.problem(rng) for _ in range(self.config.valid_problems)]
        jsonl.write_rows(out_dir / "train.jsonl", train)
        jsonl.write_rows(out_dir / "valid.jsonl", valid)
        return out_dir / "train.jsonl", out_dir / "valid.jsonl"

    @staticmethod
    def corpus(problems: list[dict]) -> list[str]:
        return [p["prompt"] + p["answer"] for p in problems]

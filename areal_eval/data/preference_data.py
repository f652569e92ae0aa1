"""Preference pairs in HH-RLHF form: reading, validating, and a learnable synthetic set.

A row is ``{"chosen": str, "rejected": str}`` (extra keys are kept). Readers fail on the first
bad row with the file and line number, because a silently skipped row changes every metric.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from areal_eval import jsonl


class DataError(ValueError):
    """A data file is malformed; the message names the file and line."""


def read_pairs(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such preference file")
    pairs = []
    try:
        for lineno, row in jsonl.rows(path):
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected an object with 'chosen' and 'rejected'")
            for key in ("chosen", "rejected"):
                if not isinstance(row.get(key), str) or not row[key].strip():
                    raise DataError(
                        f"{path}:{lineno}: field '{key}' must be a string with text in it (not empty, "
                        "not only white space)"
                    )
            pairs.append(row)
    except jsonl.JsonlError as exc:
        raise DataError(str(exc)) from exc
    if not pairs:
        raise DataError(f"{path}: no preference pairs")
    return pairs


def line_of_pair(path: str | Path, index: int) -> int:
    """The line number of the ``index``-th pair that :func:`read_pairs` returned (blank lines skipped)."""
    with Path(path).open(encoding="utf-8") as fh:
        rows = (lineno for lineno, line in enumerate(fh, start=1) if line.strip())
        return next(lineno for i, lineno in enumerate(rows) if i == index)


def write_pairs(path: str | Path, pairs: list[dict]) -> None:
    jsonl.write_rows(path, pairs)


_TOPICS = "garden river music bread winter castle robot ocean violin market forest planet".split()
_NEUTRAL = (
    "the a of to and in it is that for on with as this was at by from or an be are "
    "so then when there which about into over after before"
).split()
_GOOD = "helpful clear accurate kind polite precise thorough honest safe correct".split()
_BAD = "rude wrong vague harmful lazy false sloppy unsafe careless mean".split()


@dataclasses.dataclass
class SyntheticPreferences:
    """A preference set whose labels follow a countable rule, with label noise.

    The better answer holds more "good" than "bad" words. A small model learns the rule fast
    (accuracy climbs well above 50%), but ``label_noise`` of the pairs are flipped, so it
    plateaus near ``1 - label_noise``: the curve has a fast phase and a flat phase.
    """

    @dataclasses.dataclass
    class Config:
        train_pairs: int = 8000
        """Training pairs to generate."""
        valid_pairs: int = 501
        """Validation pairs; odd by default, so exact sharding is exercised."""
        label_noise: float = 0.15
        """Share of pairs whose preference is flipped: the accuracy ceiling is about 1 - this."""
        response_words: int = 12
        """Words per assistant response."""
        length_jitter: int = 0
        """Up to this many extra neutral words per response: lengths vary as in real
        conversations (HH-RLHF answers run from a few tokens to hundreds)."""
        seed: int = 0
        """Seed of the generator; the same seed gives the same files."""

        def __post_init__(self):
            if not 0.0 <= self.label_noise < 0.5:
                raise ValueError(f"label_noise must be in [0, 0.5), got {self.label_noise}")
            if self.train_pairs < 1 or self.valid_pairs < 1:
                raise ValueError("train_pairs and valid_pairs must be positive")

    config: Config

    def _response(self, rng: random.Random, quality: int) -> str:
        # Net (good - bad) words equal ``quality``; distractors come as balanced good+bad pairs.
        distractors = rng.randint(0, 2)
        good = max(quality, 0) + distractors
        bad = max(-quality, 0) + distractors
        length = self.config.response_words + (
            rng.randint(0, self.config.length_jitter) if self.config.length_jitter else 0
        )
        words = [rng.choice(_NEUTRAL) for _ in range(length)]
        slots = rng.sample(range(len(words)), k=min(len(words), good + bad))
        for i, slot in enumerate(slots):
            words[slot] = rng.choice(_GOOD if i < good else _BAD)
        return " ".join(words)

    def _pair(self, rng: random.Random) -> dict:
        prompt = f"\n\nHuman: tell me about the {rng.choice(_TOPICS)} please\n\nAssistant:"
        better_q = rng.randint(1, 4)
        worse_q = better_q - rng.randint(1, 3)
        better = prompt + " " + self._response(rng, better_q)
        worse = prompt + " " + self._response(rng, worse_q)
        if rng.random() < self.config.label_noise:
            better, worse = worse, better
        return {"chosen": better, "rejected": worse}

    def generate(self, out_dir: str | Path) -> tuple[Path, Path]:
        """Write ``train.jsonl`` and ``valid.jsonl`` under ``out_dir``; returns their paths."""
        rng = random.Random(self.config.seed)
        out_dir = Path(out_dir)
        train = [self._pair(rng) for _ in range(self.config.train_pairs)]
        valid = [self._pair(rng) for _ in range(self.config.valid_pairs)]
        write_pairs(out_dir / "train.jsonl", train)
        write_pairs(out_dir / "valid.jsonl", valid)
        return out_dir / "train.jsonl", out_dir / "valid.jsonl"

    @staticmethod
    def corpus(pairs: list[dict]) -> list[str]:
        return [text for row in pairs for text in (row["chosen"], row["rejected"])]

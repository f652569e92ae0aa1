"""The ``lm_loss`` evaluator: held-out loss, perplexity and bits per byte of a causal LM.

What SFT and pretraining users watch. Sums of token NLLs, token counts and UTF-8 byte counts
are additive, so distributed equals single-process; batches are fixed for the whole data set
(see :func:`distributed.dealt_batches`), so the sums agree to the bit across world sizes.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import ClassVar

from areal_eval import causal_lm
from areal_eval.config.parsing import Bounds, Ranges, check_ranges
from areal_eval.evaluation.evaluators import BaseEvaluator
from areal_eval.prompt_data import read_texts


@dataclasses.dataclass
class LMLossConfig:
    completion_field: str = "completion"
    """With ``prompt`` rows: the field whose tokens are scored (the prompt is context only).
    ``answer`` scores the reference answers of a generation data set."""
    max_length: int = 512
    """Tokens per row: the prompt keeps its end, the completion its start."""

    RANGES: ClassVar[Ranges] = {"max_length": Bounds(2)}

    def __post_init__(self):
        check_ranges(self, self.RANGES)


class LMLossEvaluator(BaseEvaluator):
    """Token-weighted loss, perplexity and bits per byte, with the loss's standard error."""

    name = "lm_loss"
    supports_subsets = True
    metric_names = ("loss", "loss_stderr", "perplexity", "bits_per_byte", "n_tokens", "n_texts")

    def __init__(self, cfg: LMLossConfig | None = None):
        self.cfg = cfg or LMLossConfig()

    @classmethod
    def from_settings(cls, settings) -> LMLossEvaluator:
        return cls(settings.lm_loss)

    @classmethod
    def check_data(cls, path: Path, settings) -> None:
        read_texts(path, settings.lm_loss.completion_field)

    def load(self, checkpoint_dir: Path, data_path: Path, allow_pickle: bool = False) -> None:
        self.model, self.tokenizer = causal_lm.load_shared(checkpoint_dir, allow_pickle, self.shared_models)
        self.rows = [self._encode(row, data_path) for row in read_texts(data_path, self.cfg.completion_field)]

    def _encode(self, row: dict, data_path: Path) -> dict:
        tok = self.tokenizer
        prompt = tok(row["prompt"])["input_ids"] if row["prompt"] else []
        # A text row starts the sequence: BOS (when the tokenizer adds one) is its context.
        completion = tok(row["completion"], add_special_tokens=not row["prompt"])["input_ids"]
        if row["prompt"] == "" and completion and completion[0] == tok.bos_token_id:
            prompt, completion = completion[:1], completion[1:]
        completion = completion[: self.cfg.max_length - 1]
        prompt = prompt[max(0, len(prompt) + len(completion) - self.cfg.max_length) :]
        if not completion or (not prompt and len(completion) < 2):
            raise ValueError(f"{data_path}:{row['line']}: too few tokens to score (needs one after its context)")
        if not prompt:  # the first token has no context: it is not scored
            prompt, completion = completion[:1], completion[1:]
        scored_text = tok.decode(completion, skip_special_tokens=True)
        return {"ids": prompt + completion, "context": len(prompt), "bytes": len(scored_text.encode("utf-8"))}

    def num_samples(self) -> int:
        return len(self.rows)

    def batches(self, shard, shards, batch_size):
        import torch

        from areal_eval import distributed

        items = self.items()
        for indices in distributed.dealt_batches([len(self.rows[i]["ids"]) for i in items], batch_size, shard, shards):
            yield {"row_index": torch.tensor([items[i] for i in indices], dtype=torch.long)}

    def batch_sums(self, batch):
        import torch

        from areal_eval import distributed

        rows = [self.rows[i] for i in batch["row_index"].tolist()]
        width = max(len(r["ids"]) for r in rows)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        scored = torch.zeros_like(ids, dtype=torch.bool)
        for i, r in enumerate(rows):  # right padding: positions are unchanged by the batch
            ids[i, : len(r["ids"])] = torch.tensor(r["ids"])
            mask[i, : len(r["ids"])] = 1
            scored[i, r["context"] : len(r["ids"])] = True
        device = distributed.device()
        logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.double().cpu()
        logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        nll = (-logprobs * scored[:, 1:]).sum(dim=1)
        tokens = scored[:, 1:].sum(dim=1).double()
        return {
            "n_texts": float(len(rows)),
            "nll": float(nll.sum()),
            "nll_sq": float((nll * nll).sum()),
            "nll_tokens": float((nll * tokens).sum()),
            "tokens": float(tokens.sum()),
            "tokens_sq": float((tokens * tokens).sum()),
            "bytes": float(sum(r["bytes"] for r in rows)),
        }

    def metrics(self, sums):
        n, tokens = sums.get("n_texts", 0.0), sums.get("tokens", 0.0)
        if n == 0 or tokens == 0:
            raise ValueError("evaluation saw no tokens to score")
        loss = sums["nll"] / tokens
        # A ratio of sums over texts: its standard error by the delta method, texts as the units.
        spread = sums["nll_sq"] - 2 * loss * sums["nll_tokens"] + loss * loss * sums["tokens_sq"]
        stderr = math.sqrt(max(spread / n, 1e-12) / n) / (tokens / n)
        return {
            "loss": loss,
            "loss_stderr": stderr,
            "perplexity": math.exp(min(loss, 700.0)),
            "bits_per_byte": sums["nll"] / (math.log(2) * sums["bytes"]) if sums["bytes"] else float("nan"),
            "n_tokens": tokens,
            "n_texts": n,
        }

"""The ``lm_loss`` evaluator: held-out loss, perplexity and bits per byte of a causal LM.

What SFT and pretraining users watch. A ``text`` row (or an empty prompt) is scored whole: its
first token is predicted from the tokenizer's BOS token (EOS where it has none, as
lm-evaluation-harness does), so bits per byte divides by the text's own UTF-8 bytes. Sums of
token NLLs, token counts and byte counts are additive, so distributed equals single-process;
batches are fixed for the whole data set (see :func:`distributed.dealt_batches`), so the sums
agree to the bit across world sizes.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import ClassVar

from areal_eval.config.parsing import TOKENS, Bounds, Ranges, check_ranges
from areal_eval.data.preference_data import DataError
from areal_eval.data.prompt_data import read_texts
from areal_eval.estimates import sample_stderr
from areal_eval.evaluation.evaluators import BaseEvaluator, truncation_warning
from areal_eval.models import causal_lm


@dataclasses.dataclass
class LMLossConfig:
    completion_field: str = "completion"
    """With ``prompt`` rows: the field whose tokens are scored (the prompt is context only).
    ``answer`` scores the reference answers of a generation data set."""
    max_length: int = 512
    """Tokens per row: the prompt keeps its end, the completion its start (rows cut are counted
    in ``truncated_texts`` and warned about; bits per byte then counts the kept tokens' bytes)."""

    chat_template: bool = False
    """Score each completion as the assistant's turn after its prompt as a user turn, in the
    tokenizer's chat template (as ``model.chat_template`` trains); rows without a prompt stay
    plain text."""

    RANGES: ClassVar[Ranges] = {"max_length": Bounds(2, TOKENS.high)}

    def __post_init__(self):
        check_ranges(self, self.RANGES)


def token_logprobs(logits, targets):
    """``log p(target)`` at each position, in float64, on the CPU. Taken on the logits' device
    one row at a time, so only one row's logits are ever held in float64 (a whole batch's are
    batch x length x vocabulary x 8 bytes: 20 GB for 32 rows of 512 tokens over a 150k
    vocabulary), and only the targets' values leave the device."""
    import torch

    out = torch.empty(targets.shape, dtype=torch.float64)
    for row in range(logits.shape[0]):
        exact = logits[row].double()
        out[row] = torch.log_softmax(exact, dim=-1).gather(-1, targets[row, :, None]).squeeze(-1).cpu()
    return out


class LMLossEvaluator(BaseEvaluator):
    """Token-weighted loss, perplexity and bits per byte, with the loss's standard error."""

    name = "lm_loss"
    supports_subsets = True
    metric_names = ("loss", "loss_stderr", "perplexity", "bits_per_byte", "n_tokens", "n_texts", "truncated_texts")

    def __init__(self, cfg: LMLossConfig | None = None):
        self.cfg = cfg or LMLossConfig()

    @classmethod
    def from_settings(cls, settings) -> LMLossEvaluator:
        return cls(settings.lm_loss)

    @classmethod
    def check_data(cls, path: Path, settings, tokenizer_dir: Path | None = None) -> None:
        rows = read_texts(path, settings.lm_loss.completion_field)
        if tokenizer_dir is not None:
            tok = causal_lm.load_tokenizer(tokenizer_dir)
            for row in rows:
                encode_row(tok, row, settings.lm_loss, path)

    def load(self, checkpoint_dir: Path, data_path: Path, allow_pickle: bool = False) -> None:
        self.model, self.tokenizer = causal_lm.load_shared(checkpoint_dir, allow_pickle, self.shared_models, self.dtype)
        rows = read_texts(data_path, self.cfg.completion_field)
        self.rows = [encode_row(self.tokenizer, row, self.cfg, data_path) for row in rows]

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
        ids = ids.to(device)
        logits = self.model(input_ids=ids, attention_mask=mask.to(device)).logits
        nll = (-token_logprobs(logits[:, :-1], ids[:, 1:]) * scored[:, 1:]).sum(dim=1)
        tokens = scored[:, 1:].sum(dim=1).double()
        for row, item in enumerate(batch["row_index"].tolist()):
            self.keep_item(item, nll=float(nll[row]), tokens=int(tokens[row]))
        return {
            "n_texts": float(len(rows)),
            "truncated_texts": float(sum(r["truncated"] for r in rows)),
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
        stderr = sample_stderr(spread, n) / (tokens / n)
        return {
            "loss": loss,
            "loss_stderr": stderr,
            "perplexity": math.exp(min(loss, 700.0)),
            "bits_per_byte": sums["nll"] / (math.log(2) * sums["bytes"]) if sums["bytes"] else float("nan"),
            "n_tokens": tokens,
            "n_texts": n,
            "truncated_texts": sums["truncated_texts"],
        }

    def warnings(self, sums):
        limit = f"max_length ({self.cfg.max_length} tokens)"
        return truncation_warning(
            sums.get("truncated_texts", 0),
            sums.get("n_texts", 0),
            "texts",
            limit=limit,
            kept="the start of their completion",
        )


def encode_row(tok, row: dict, cfg: LMLossConfig, data_path: Path) -> dict:
    """A row's token ids, how many of them are context (not scored), the UTF-8 bytes of the
    text they score, and whether it was cut to ``cfg.max_length``. A row with nothing to score
    is a :class:`DataError` naming its line."""
    where, max_length, completion_text = f"{data_path}:{row['line']}", cfg.max_length, row["completion"]
    if row["prompt"]:
        chat = cfg.chat_template
        prompt = causal_lm.encode_prompt(
            tok, row["prompt"], chat_template=chat, where=where, setting="eval.lm_loss.chat_template"
        )
        completion_text = completion_text.lstrip() if chat else completion_text  # as encode_answer
    else:  # a whole text: its first token is predicted from BOS, or EOS (lm-evaluation-harness)
        start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        prompt = [] if start is None else [start]
    whole = tok(completion_text, add_special_tokens=False)["input_ids"]
    completion = whole[: max_length - 1]
    prompt = prompt[max(0, len(prompt) + len(completion) - max_length) :]
    if not completion or not prompt:
        raise DataError(
            f"{where}: nothing to score: the completion has no tokens, or no context to predict its first token from "
            "(an empty prompt, and the tokenizer has neither a BOS nor an EOS token)"
        )
    truncated = len(completion) < len(whole)
    text = tok.decode(completion, skip_special_tokens=True) if truncated else completion_text
    return {
        "ids": prompt + completion,
        "context": len(prompt),
        "bytes": len(text.encode("utf-8")),
        "truncated": truncated,
    }

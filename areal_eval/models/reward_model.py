"""The reward model: a transformers sequence classifier with one output (num_labels=1).

Built from a small local config and a tokenizer trained here with ``tokenizers``, or loaded
with ``from_pretrained`` from any local path (a saved checkpoint, or a downloaded model).
torch is imported where it is used: the flow process imports this module (through the
objectives) and never computes with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from areal_eval.checkpoints import loading
from areal_eval.data.preference_data import DataError, line_of_pair

if TYPE_CHECKING:
    import torch


def train_tokenizer(texts: list[str], out_dir: str | Path, vocab_size: int = 512):
    """Train a word-level tokenizer locally and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=["[PAD]", "[UNK]", "[EOS]"])
    tok.train_from_iterator(texts, trainer=trainer)
    # Left: a long text keeps its end, where the answer is. Saved in tokenizer_config.json, so
    # the evaluator and a user's own AutoTokenizer truncate alike.
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]", truncation_side="left"
    )
    fast.save_pretrained(str(out_dir))
    return fast


def load_tokenizer(path: str | Path):
    """The tokenizer saved at ``path``, truncating on the side it records (``truncation_side``
    in ``tokenizer_config.json``; transformers' default, the right, when it records none), as
    ``AutoTokenizer.from_pretrained`` outside the pipeline does."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def build_model(cfg, tokenizer):
    """A fresh small Llama-style reward model sized by ``cfg`` (an ``objectives.ModelConfig``)."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.hidden_size * 4,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=max(128, cfg.max_length),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        num_labels=1,
        tie_word_embeddings=False,
    )
    return AutoModelForSequenceClassification.from_config(config)


def load_model(path: str | Path, allow_pickle: bool = False, dtype: str = "float32", device=None):
    """Load a reward model from a local directory, in ``dtype`` on ``device`` (see
    :func:`checkpoints.loading.load_pretrained`)."""
    from transformers import AutoModelForSequenceClassification

    model = loading.load_pretrained(
        AutoModelForSequenceClassification, path, allow_pickle=allow_pickle, dtype=dtype, device=device, num_labels=1
    )
    return score_head_in_float32(model)


def score_head_in_float32(model):
    """A model in bf16 or fp16 keeps its score head (``score``: a decoder's scalar head) in
    float32, fed float32 hidden states. A reward sits at some offset (4.8, say) where bf16 has a
    step of 0.03, so two close scores would round to a tie or swap; float32 keeps their margin.
    The head is one row of weights: it costs no memory."""
    import torch

    head = getattr(model, "score", None)
    if isinstance(head, torch.nn.Linear) and head.weight.dtype in (torch.bfloat16, torch.float16):
        head.float()
        head.register_forward_pre_hook(lambda module, args: (args[0].float(), *args[1:]))
    return model


def tokenize_pairs(tokenizer, pairs: list[dict], max_length: int, source: str | Path | None = None) -> list[dict]:
    """Token ids of each pair's chosen and rejected text (unpadded; batches pad dynamically).

    A text that tokenizes to nothing cannot be scored: it is refused, naming ``source``'s line.
    """
    texts = [t for row in pairs for t in (row["chosen"], row["rejected"])]
    whole = tokenizer(texts, add_special_tokens=False)["input_ids"]
    # What tokenizer(..., truncation=True, max_length=...) keeps, on its truncation side; and which were cut.
    keep_end = tokenizer.truncation_side == "left"
    ids = [seq[-max_length:] if keep_end else seq[:max_length] for seq in whole]
    cut = [len(seq) > max_length for seq in whole]
    for i, seq in enumerate(ids):
        if not seq:
            where = f"{source}:{line_of_pair(source, i // 2)}" if source else f"pair {i // 2}"
            field = ("chosen", "rejected")[i % 2]
            raise DataError(f"{where}: field '{field}' has no tokens for this tokenizer ({texts[i]!r})")
    return [
        {"chosen_ids": ids[2 * i], "rejected_ids": ids[2 * i + 1], "truncated": cut[2 * i] + cut[2 * i + 1]}
        for i in range(len(pairs))
    ]


def collate_pairs(items: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Pad to the longest sequence in the batch; rows alternate chosen, rejected (as AReaL).
    ``identical`` marks pairs whose two texts have the same tokens (a tie, whatever the scores)."""
    import torch

    seqs = [ids for item in items for ids in (item["chosen_ids"], item["rejected_ids"])]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention_mask[row, : len(seq)] = 1
    identical = torch.tensor([item["chosen_ids"] == item["rejected_ids"] for item in items], dtype=torch.bool)
    truncated = torch.tensor([item.get("truncated", 0) for item in items], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "identical": identical, "truncated": truncated}


def pair_scores(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of the chosen and rejected rows of a collated batch."""
    scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    return scores[0::2], scores[1::2]


def pair_scores_trimmed(model, batch: dict[str, torch.Tensor], chunks: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``pair_scores`` with less padding: rows sorted by length and scored in ``chunks`` forward
    passes, each trimmed to its own longest row. Same scores (right padding is masked)."""
    import torch

    mask = batch["attention_mask"]
    lengths = mask.sum(dim=1)
    order = torch.argsort(lengths)
    device = model.device
    # Scores leave the model's dtype (bf16 say) for float64 at once: sums and margins stay exact.
    scores = torch.empty(mask.shape[0], dtype=torch.float64)
    for part in torch.chunk(order, chunks):
        width = int(lengths[part].max())
        ids, part_mask = batch["input_ids"][part, :width].to(device), mask[part, :width].to(device)
        scores[part] = model(input_ids=ids, attention_mask=part_mask).logits.squeeze(-1).double().cpu()
    return scores[0::2], scores[1::2]


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """``-log sigmoid(r_chosen - r_rejected)``: the pairwise reward-model loss (``reduction``:
    ``mean``, ``sum``, or ``none`` for one loss per pair)."""
    import torch.nn.functional as F

    loss = -F.logsigmoid(chosen - rejected)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.mean()

"""The ``reward_model`` evaluator: pairwise accuracy and Bradley-Terry loss of a sequence
classifier on preference pairs, as AReaL's ``hhrlhf_rw.py`` reports them."""

from __future__ import annotations

from pathlib import Path

from areal_eval.data.preference_data import read_pairs
from areal_eval.estimates import mean_and_stderr
from areal_eval.evaluation.evaluators import BaseEvaluator, truncation_warning


class RewardModelEvaluator(BaseEvaluator):
    """Pairwise accuracy, Bradley-Terry loss, chosen/rejected scores and margin."""

    name = "reward_model"
    supports_subsets = True
    metric_names = (
        "accuracy",
        "accuracy_stderr",
        "loss",
        "loss_stderr",
        "chosen_score",
        "rejected_score",
        "margin",
        "n_pairs",
        "truncated_texts",
    )

    def __init__(self, max_length: int = 64):
        self.max_length = max_length

    @classmethod
    def check_data(cls, path: Path, settings, tokenizer_dir: Path | None = None) -> None:
        pairs = read_pairs(path)
        if tokenizer_dir is not None:
            from areal_eval.models import reward_model

            reward_model.tokenize_pairs(reward_model.load_tokenizer(tokenizer_dir), pairs, settings.max_length, path)

    def load(self, checkpoint_dir: Path, data_path: Path, allow_pickle: bool = False) -> None:
        from areal_eval import distributed
        from areal_eval.models import reward_model

        self.tokenizer = reward_model.load_tokenizer(checkpoint_dir)
        self.model = reward_model.load_model(checkpoint_dir, allow_pickle, self.dtype, distributed.device()).eval()
        self.pairs = reward_model.tokenize_pairs(self.tokenizer, read_pairs(data_path), self.max_length, data_path)

    def num_samples(self) -> int:
        return len(self.pairs)

    def batches(self, shard, shards, batch_size):
        import torch

        from areal_eval.distributed import shard_range
        from areal_eval.models import reward_model

        items = self.items()
        indices = [items[i] for i in shard_range(len(items), shard, shards)]
        # Length-grouped batches: less padding, and scores do not depend on the grouping.
        ordered = sorted(
            indices, key=lambda i: max(len(self.pairs[i]["chosen_ids"]), len(self.pairs[i]["rejected_ids"]))
        )
        for start in range(0, len(ordered), batch_size):
            chunk = ordered[start : start + batch_size]
            batch = reward_model.collate_pairs([self.pairs[i] for i in chunk], self.tokenizer.pad_token_id)
            yield {**batch, "pair_index": torch.tensor(chunk, dtype=torch.long)}

    def batch_sums(self, batch):
        import torch

        from areal_eval.models import reward_model

        chosen, rejected = reward_model.pair_scores_trimmed(self.model, batch)
        chosen, rejected = chosen.double(), rejected.double()
        # A pair of identical texts is a tie, scored once: half correct at any world or batch size
        # (its two rows may sit in forward passes of different shapes, whose last bits differ).
        identical = batch["identical"].bool()
        rejected = torch.where(identical, chosen, rejected)
        losses = reward_model.bradley_terry_loss(chosen, rejected, reduction="none")
        correct = torch.where(identical, 0.5, (chosen > rejected).double())
        if self.item_rows is not None and "pair_index" in batch:
            for row, item in enumerate(batch["pair_index"].tolist()):
                self.keep_item(
                    item,
                    correct=float(correct[row]),
                    margin=float(chosen[row] - rejected[row]),
                    loss=float(losses[row]),
                )
        return {
            "n_pairs": float(chosen.numel()),
            "correct": float(correct.sum()),
            "correct_sq": float((correct * correct).sum()),
            "truncated_texts": float(batch["truncated"].sum()),
            "loss": float(losses.sum()),
            "loss_sq": float((losses * losses).sum()),
            "chosen_score": float(chosen.sum()),
            "rejected_score": float(rejected.sum()),
        }

    def metrics(self, sums):
        n = sums["n_pairs"]
        if n == 0:
            raise ValueError("evaluation saw no pairs")
        acc, acc_stderr = mean_and_stderr(sums["correct"], sums["correct_sq"], n)
        loss, loss_stderr = mean_and_stderr(sums["loss"], sums["loss_sq"], n)
        chosen, rejected = sums["chosen_score"] / n, sums["rejected_score"] / n
        return {
            "accuracy": acc,
            "accuracy_stderr": acc_stderr,
            "loss": loss,
            "loss_stderr": loss_stderr,
            "chosen_score": chosen,
            "rejected_score": rejected,
            "margin": chosen - rejected,
            "n_pairs": n,
            "truncated_texts": sums["truncated_texts"],
        }

    def warnings(self, sums):
        kept = "their end" if self.tokenizer.truncation_side == "left" else "their start"
        return truncation_warning(
            sums.get("truncated_texts", 0),
            2 * sums.get("n_pairs", 0),
            "texts",
            limit=f"max_length ({self.max_length} tokens)",
            kept=kept,
        )

"""A Hugging Face Trainer run whose checkpoints the pipeline evaluates: one callback.

    python -m examples.hf_trainer --run-dir runs/hf-demo [--steps 40 --save-steps 8]

The model is a tiny Llama reward model trained as a regression on single responses (chosen 1,
rejected 0) over the synthetic preference data; any Trainer (or TRL trainer) takes the same
callback. With ``PREFECT_API_URL`` set, each checkpoint is also announced to the server, whose
``evaluate-published-checkpoint`` trigger evaluates it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

from areal_eval.integrations.hf import PublishCheckpoints
from areal_eval.models.objectives import ModelConfig
from examples.common import tiny_reward_model


def build_trainer(
    work: Path,
    callbacks: list,
    max_steps: int = 20,
    save_steps: int = 8,
    model: ModelConfig | None = None,
    report_to: tuple = (),
):
    """A Trainer over synthetic preference data written under ``work`` (a tiny model, or one of
    ``model``'s size); returns it and the validation pairs' path."""
    pairs, valid_path, tokenizer, model = tiny_reward_model(work, model)
    rows = [
        {**tokenizer(p[key], truncation=True, max_length=64), "labels": float(key == "chosen")}
        for p in pairs
        for key in ("chosen", "rejected")
    ]
    args = TrainingArguments(
        output_dir=str(work / "trainer"),
        max_steps=max_steps,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        save_steps=save_steps,
        logging_steps=4,
        report_to=list(report_to),
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=rows,
        data_collator=DataCollatorWithPadding(tokenizer),
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    return trainer, valid_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-steps", type=int, default=8)
    args = parser.parse_args()
    work = args.run_dir.with_name(args.run_dir.name + "-work")
    callback = PublishCheckpoints(args.run_dir, valid_data=work / "valid.jsonl")  # the one line to add
    trainer, _ = build_trainer(work, [callback], args.steps, args.save_steps)
    trainer.train()
    print(f"published steps {callback.published} to {args.run_dir / 'manifest.jsonl'}")


if __name__ == "__main__":
    main()

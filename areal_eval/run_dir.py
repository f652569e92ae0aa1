"""Where a run keeps its files: one directory per training run, shared by every stage."""

from __future__ import annotations

from pathlib import Path


class RunDir:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    data = property(lambda self: self.root / "data")
    train_data = property(lambda self: self.root / "data" / "train.jsonl")
    valid_data = property(lambda self: self.root / "data" / "valid.jsonl")
    tokenizer = property(lambda self: self.root / "tokenizer")
    checkpoints = property(lambda self: self.root / "checkpoints")
    manifest = property(lambda self: self.root / "manifest.jsonl")
    train_log = property(lambda self: self.root / "train_log.jsonl")
    train_config = property(lambda self: self.root / "train_config.json")
    stop_file = property(lambda self: self.root / "control" / "stop.json")
    ledger = property(lambda self: self.root / "ledger.jsonl")
    evals = property(lambda self: self.root / "evals")
    logs = property(lambda self: self.root / "logs")
    run_id_file = property(lambda self: self.root / "run_id")

    @property
    def run_id(self) -> str:
        return self.run_id_file.read_text().strip()

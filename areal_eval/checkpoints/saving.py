"""Saving checkpoints without holding up the training loop.

Saving never blocks the training loop for longer than a CPU snapshot of the weights: the
files are written, hashed and announced by a background thread. A checkpoint directory is
renamed into place only when complete, so readers never see a partial one.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from areal_eval.checkpoints.manifest import (
    CheckpointError,
    CheckpointEvent,
    Manifest,
    announcement,
    checkpoint_name,
    describe_files,
)
from areal_eval.checkpoints.remote_run import follow_requests
from areal_eval.checkpoints.store import LocalStore
from areal_eval.disk import named_if_disk_full


def save_clean_tokenizer(tokenizer, directory: Path) -> None:
    """Save the tokenizer without the truncation and padding that training's calls left on its
    fast backend: whoever loads the checkpoint must not get silent truncation they never asked for."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        backend.no_truncation()
        backend.no_padding()
    # The side training and evaluation cut long texts on, in tokenizer_config.json: a user's own
    # AutoTokenizer.from_pretrained(checkpoint) then scores a long text as the evaluator does.
    if hasattr(tokenizer, "truncation_side"):
        tokenizer.init_kwargs["truncation_side"] = tokenizer.truncation_side
    tokenizer.save_pretrained(str(directory))


def cpu_copy(state):
    """A deep copy with every tensor on the CPU (what a background thread may write later)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: cpu_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(cpu_copy(v) for v in state)
    return state


def resume_state_path(resume_dir: Path, global_step: int) -> Path:
    return Path(resume_dir) / f"{checkpoint_name(global_step)}.pt"


def write_resume_state(resume_dir: Path, global_step: int, state: dict) -> None:
    path = resume_state_path(resume_dir, global_step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    torch.save(state, tmp)
    with tmp.open("rb") as fh:
        os.fsync(fh.fileno())
    tmp.rename(path)


def read_resume_state(resume_dir: Path, global_step: int) -> dict:
    """Tensors, numbers and containers only (``weights_only``): no code is unpickled."""
    return torch.load(resume_state_path(resume_dir, global_step), weights_only=True)


@dataclasses.dataclass
class SaveRequest:
    state_dict: dict[str, torch.Tensor]
    epoch: int
    epoch_step: int
    global_step: int
    train_metrics: dict
    final: bool
    resume_state: dict | None = None
    """What training needs to go on from here (optimizer, schedule, trigger state, data
    position), written beside the checkpoint before it is announced, never published."""


class CheckpointWriter:
    """Writes checkpoints in a background thread and appends them to the manifest when durable.

    Durable means written, fsynced and renamed into place, then published by ``store``
    (a :mod:`areal_eval.checkpoints.store` store; on S3, uploaded and verified). A failure or a
    crash before that point leaves the checkpoint out of the manifest: never half-announced.

    ``save`` copies the weights to CPU (the only part the training loop waits for) and queues
    the write. ``close`` waits for queued writes; call it before the process exits.
    """

    def __init__(
        self,
        model,
        tokenizer,
        out_dir: str | Path,
        manifest: Manifest,
        run_id: str,
        on_durable: Callable[[CheckpointEvent], None] | None = None,
        store=None,
        resume_dir: str | Path | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.out_dir = Path(out_dir)
        self.manifest = manifest
        self.run_id = run_id
        self.on_durable = on_durable
        self.store = store if store is not None else LocalStore()
        self.resume_dir = Path(resume_dir) if resume_dir else None
        self.blocked_seconds = 0.0
        self._queue: queue.Queue[SaveRequest | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def save(
        self,
        epoch: int,
        epoch_step: int,
        global_step: int,
        train_metrics: dict,
        *,
        final: bool = False,
        resume_state: dict | None = None,
    ) -> None:
        if self._error:
            raise CheckpointError(f"an earlier checkpoint write failed: {self._error}") from self._error
        global_step, epoch, epoch_step, train_metrics = announcement(
            self.run_id, global_step, epoch=epoch, epoch_step=epoch_step, train_metrics=train_metrics
        )
        start = time.perf_counter()
        snapshot = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        resume_state = cpu_copy(resume_state) if resume_state is not None and self.resume_dir else None
        self.blocked_seconds += time.perf_counter() - start
        self._queue.put(SaveRequest(snapshot, epoch, epoch_step, global_step, train_metrics, final, resume_state))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self._error:
            raise CheckpointError(f"checkpoint write failed: {self._error}") from self._error

    def _run(self) -> None:
        while (request := self._queue.get()) is not None:
            if self._error:
                continue
            try:
                self._write(request)
            except BaseException as exc:  # noqa: BLE001 - surfaced by save()/close()
                self._error = named_if_disk_full(exc, self.out_dir, f"checkpoint step {request.global_step}")

    def _write(self, req: SaveRequest) -> None:
        final_dir = self.out_dir / checkpoint_name(req.global_step)
        tmp_dir = self.out_dir / f".{final_dir.name}.partial"
        shutil.rmtree(tmp_dir, ignore_errors=True)
        tmp_dir.mkdir(parents=True)
        self.model.save_pretrained(str(tmp_dir), state_dict=req.state_dict, safe_serialization=True)
        save_clean_tokenizer(self.tokenizer, tmp_dir)
        for path in tmp_dir.iterdir():
            with path.open("rb") as fh:
                os.fsync(fh.fileno())
        files = describe_files(tmp_dir)
        shutil.rmtree(final_dir, ignore_errors=True)
        tmp_dir.rename(final_dir)
        if req.resume_state is not None:  # before the announcement: every announced checkpoint can be resumed
            write_resume_state(self.resume_dir, req.global_step, req.resume_state)
        uri = self.store.publish(final_dir, files)
        event = CheckpointEvent(
            run_id=self.run_id,
            uri=uri,
            epoch=req.epoch,
            epoch_step=req.epoch_step,
            global_step=req.global_step,
            wall_time=time.time(),
            train_metrics=req.train_metrics,
            files=files,
            final=req.final,
        )
        follow_requests(self.store, self.manifest.path.parent, final=req.final)  # answers sent before the announcement
        self.manifest.append(event)
        self.store.mirror(self.manifest.path, "manifest.jsonl")
        if self.on_durable:
            self.on_durable(event)

"""Training task: data-parallel training (reward model or SFT) that publishes checkpoints.

    torchrun --nproc-per-node 2 -m areal_eval.train --config RUN/train_config.json

DDP over torchrun (gloo on CPU, nccl with CUDA), the model's objective (``objectives``), checkpoints on its own
trigger control. It never waits for an evaluation: checkpoints are written in the background
and announced in the manifest; a stop request (from an alert) ends it at the next step.

The flow process imports this module for the training settings and the job's state, so torch
and the checkpoint writer are imported inside :func:`train`, which runs on the ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import time
from pathlib import Path

from areal_eval import jsonl
from areal_eval.checkpoints.freq_ctl import EpochStepTimeFreqCtl
from areal_eval.checkpoints.manifest import CheckpointError, CheckpointEvent, Manifest, checkpoint_name
from areal_eval.checkpoints.store import S3Config, is_s3, open_store
from areal_eval.disk import named_if_disk_full
from areal_eval.evaluation.job_spec import read_spec
from areal_eval.launchers.local import TorchrunJob
from areal_eval.launchers.process_control import die_with_parent
from areal_eval.models.objectives import objective
from areal_eval.runs.directives import Inbox, apply_directive, multiply_learning_rate
from areal_eval.runs.directory import RunDir, StopSignal
from areal_eval.train_config import TrainJobSpec, steps_per_epoch, total_steps


def last_checkpoint(run: RunDir, run_id: str) -> CheckpointEvent | None:
    """The newest checkpoint this run announced (None: none yet)."""
    events = [e for e in Manifest(run.manifest).events() if e.run_id == run_id]
    return max(events, key=lambda e: e.global_step, default=None)


def training_finished(run: RunDir, run_id: str) -> bool:
    """The run's final checkpoint is announced: there is nothing left to train."""
    last = last_checkpoint(run, run_id)
    return last is not None and last.final


def wrote_done(train_log: Path) -> bool:
    """The training log ends with the ``done`` row rank 0 writes after the final checkpoint:
    everything training had to leave is on disk, whatever its processes do next."""
    if not train_log.exists():
        return False
    tail = jsonl.read_complete(train_log, max(0, train_log.stat().st_size - 4096)).lines  # complete lines only
    try:
        return bool(tail) and json.loads(tail[-1][1]).get("done") is True
    except ValueError:
        return False


DONE_EXIT_GRACE_S = 20.0
"""How long a training job may take to exit once it wrote its ``done`` row. Every rank has
only the final barrier and the group's teardown left, well under a second even on a loaded
machine."""


def wait_for_exit(
    job: TorchrunJob, train_log: Path, timeout_s: float, done_grace_s: float = DONE_EXIT_GRACE_S
) -> str | None:
    """Wait for the training job that announced its final checkpoint; raise WorkerError if it
    failed or does not exit within ``timeout_s``.

    A job that wrote its ``done`` row and is still running ``done_grace_s`` later is stuck
    tearing down (seen with a forked rank that never returned): its work is all on disk, so it
    is killed, its stacks first dumped to its log, and the reason is returned as a warning
    instead of failing a run whose every checkpoint was evaluated.
    """
    deadline = time.monotonic() + timeout_s
    done_at = None
    while job.poll() is None:
        now = time.monotonic()
        if done_at is None and wrote_done(train_log):
            done_at = now
        if done_at is not None and now - done_at > done_grace_s:
            job.dump_stacks()
            job.kill(grace_s=0)
            return (
                f"training finished ({train_log} says done) but had not exited {done_grace_s:.0f}s later; "
                f"killed, its stacks are in {job.log_path}"
            )
        if done_at is None and now > deadline:
            job.time_out(timeout_s)
        time.sleep(0.1)
    job.wait(None)  # reaps what is left of its process group
    job.raise_for_status("training")
    return None


def checkpoint_here(run: RunDir, event: CheckpointEvent, s3: S3Config) -> Path | str:
    """Checkpoint ``event``'s directory on this machine: its local copy, else a copy fetched from
    the store it was published to (the run's ``checkpoint-cache``); or why there is none."""
    where = run.checkpoints / checkpoint_name(event.global_step)
    if where.exists():
        return where
    if not is_s3(event.uri):
        return f"{where} does not exist"
    try:
        return open_store(event.uri, s3).fetch(event.uri, event.files, run.root / "checkpoint-cache")
    except Exception as exc:  # noqa: BLE001 - said by every rank alike: rank 0 hands it on
        return f"{event.uri}: {exc}"


def resume_point(run: RunDir, run_id: str) -> tuple[CheckpointEvent, dict] | None:
    """Where a restarted job goes on: the newest announced checkpoint and its resume state."""
    from areal_eval.checkpoints.saving import read_resume_state, resume_state_path

    last = last_checkpoint(run, run_id)
    if last is None:
        return None
    if not resume_state_path(run.resume_states, last.global_step).exists():
        raise CheckpointError(
            f"{run.resume_states}: no resume state for step {last.global_step}, the newest "
            f"checkpoint of run {run_id}: it cannot be resumed (choose another run_name)"
        )
    return last, read_resume_state(run.resume_states, last.global_step)


def next_position(epoch: int, epoch_step: int, epoch_steps: int) -> tuple[int, int]:
    """The (epoch, epoch step) after the step at ``epoch_step`` of ``epoch``."""
    return (epoch, epoch_step + 1) if epoch_step + 1 < epoch_steps else (epoch + 1, 0)


def train(spec: TrainJobSpec) -> None:
    import torch

    from areal_eval import distributed
    from areal_eval.checkpoints.saving import CheckpointWriter, read_resume_state, resume_state_path

    cfg, run = spec.train, RunDir(spec.run_dir)
    if training_finished(run, spec.run_id):
        return  # a resumed run whose training was over: only its evaluation goes on
    distributed.init(timeout_s=cfg.collective_timeout_s)
    rank, world = distributed.rank(), distributed.world_size()
    torch.set_num_threads(int(os.environ.get("AREAL_TRAIN_THREADS", "1")))
    torch.manual_seed(cfg.seed)
    dev = distributed.device()

    task = objective(spec.model.objective)
    tok_path = spec.model.tokenizer_path or run.tokenizer
    tokenizer = task.load_tokenizer(tok_path)
    resume = resume_point(run, spec.run_id)
    if resume:
        where = checkpoint_here(run, resume[0], spec.storage.s3) if rank == 0 else None
        where = distributed.broadcast_object(where) if world > 1 else where
        if isinstance(where, str):
            raise CheckpointError(f"cannot resume from checkpoint {resume[0].global_step}: {where}")
        model = task.load_model(where)
    elif spec.model.pretrained_path:
        model = task.load_model(spec.model.pretrained_path)
    else:
        model = task.build_model(spec.model, tokenizer)
    model.to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    examples = task.encode(tokenizer, task.read(run.train_data), spec.model)
    epoch_steps = steps_per_epoch(len(examples), world, cfg.batch_size)
    if epoch_steps == 0:
        raise ValueError(
            f"{run.train_data}: {len(examples)} examples is too few for {world} ranks x batch {cfg.batch_size}"
        )
    total = total_steps(len(examples), world, cfg)

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)),
    )
    ctl = EpochStepTimeFreqCtl(
        freq_epoch=cfg.save.freq_epochs,
        freq_step=cfg.save.freq_steps,
        freq_sec=cfg.save.freq_secs,
        initial_epoch_value=cfg.save.eval_before_train,
        fold_within_steps=max(1, (cfg.save.freq_steps or 0) // 2),
    )
    stop = StopSignal(run.stop_file)
    writer = None
    if rank == 0:
        store = open_store(spec.storage.run_root(spec.run_id), spec.storage.s3, spec.storage.keep_local_copy)
        store.mirror(run.valid_data, "data/valid.jsonl")  # so a sweep of the store can evaluate the run
        if run.config_file.exists():  # ... by the evaluators and rules the run was started with
            store.mirror(run.config_file, run.config_file.name)
        writer = CheckpointWriter(
            model,
            tokenizer,
            run.checkpoints,
            Manifest(run.manifest),
            spec.run_id,
            store=store,
            resume_dir=run.resume_states,
        )
    log = TrainLog(run.train_log) if rank == 0 else None

    def resume_state(next_epoch: int, next_epoch_step: int, global_step: int) -> dict:
        return {
            "optimizer": opt.state_dict(),
            "schedule": sched.state_dict(),
            "trigger": ctl.state_dict(),
            "next_epoch": next_epoch,
            "next_epoch_step": next_epoch_step,
            "global_step": global_step,
            "lineage": lineage,
        }

    global_step, metrics, position, lineage = 0, {}, (0, 0), {}
    if resume:  # model, optimizer, schedule, trigger state and data position of the newest checkpoint
        state = resume[1]
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["schedule"])
        ctl.load_state_dict(state["trigger"])
        global_step, position = state["global_step"], (state["next_epoch"], state["next_epoch_step"])
        lineage = state.get("lineage", {})

    def roll_back(to_step: int) -> str | None:
        """Weights, optimizer, schedule and data position of checkpoint ``to_step`` (rank 0 finds
        it, here or on the store, so every rank does the same); global steps go on counting."""
        nonlocal position, lineage
        where = None
        if rank == 0:
            event = next((e for e in Manifest(run.manifest).events() if e.global_step == to_step), None)
            where = checkpoint_here(run, event, spec.storage.s3) if event else "it was never published"
            if not resume_state_path(run.resume_states, to_step).exists():
                where = f"no resume state ({resume_state_path(run.resume_states, to_step)})"
        where = distributed.broadcast_object(where) if world > 1 else where
        if isinstance(where, str):
            return f"its target, checkpoint {to_step}, is gone: {where}"
        model.load_state_dict(task.load_model(where).state_dict())
        state = read_resume_state(run.resume_states, to_step)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["schedule"])
        position, lineage = (state["next_epoch"], state["next_epoch_step"]), {"weights_from_step": to_step}
        return None

    # What evaluation asks of training; an answer made after the step training starts from is void.
    inbox = Inbox(run.root, resumed_at=global_step)
    if not resume and ctl.before_train() and writer:
        writer.save(epoch=0, epoch_step=0, global_step=0, train_metrics={}, resume_state=resume_state(0, 0, 0))
    started, stop_reason, shuffled = time.monotonic(), None, None
    epoch, epoch_step = position
    while position[0] < cfg.epochs and global_step < total:
        epoch, epoch_step = position
        if shuffled != epoch:
            order, shuffled = list(range(len(examples))), epoch
            random.Random(cfg.seed * 1000 + epoch).shuffle(order)
        if global_step + 1 == cfg.lr_jump_at:
            multiply_learning_rate(opt, sched, cfg.lr_jump_factor)
        base = (epoch_step * world + rank) * cfg.batch_size
        batch = task.collate([examples[i] for i in order[base : base + cfg.batch_size]], tokenizer)
        batch = {k: v.to(dev) for k, v in batch.items()}
        loss = task.loss(ddp, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        global_step += 1
        position = next_position(epoch, epoch_step, epoch_steps)
        # One small all-reduce per step: mean loss for the log, a stop request, a directive waiting.
        local = [loss.item(), 1.0 if rank == 0 and stop.requested() else 0.0, float(rank == 0 and inbox.waiting())]
        stats = distributed.all_reduce_sum(torch.tensor(local, dtype=torch.float64, device=dev))
        rolled_back = False
        for directive in inbox.agree(stats[2].item() > 0):  # applied before this step's save
            said = answer_directive(directive, opt, sched, inbox=inbox, step=global_step, roll_back=roll_back)
            stop_reason = said.stop or stop_reason
            rolled_back = rolled_back or said.rolled_back
        metrics = {"loss": stats[0].item() / world, "lr": sched.get_last_lr()[0], "epoch": epoch, **lineage}
        if log and global_step % cfg.log_every == 0:
            elapsed = time.monotonic() - started
            log.write({"step": global_step, **metrics, "samples_per_s": global_step * cfg.batch_size * world / elapsed})
        if stats[1].item() > 0 or stop_reason:
            stop_reason = stop_reason or stop.requested() or "stop requested"
            break
        is_last = global_step >= total
        due = ctl.check(epochs=int(epoch_step == epoch_steps - 1), steps=1)
        # A rollback is saved at once: its checkpoint holds the weights gone back to, at this step,
        # so every sink's curve shows it and a restart goes on from it.
        if (due or rolled_back or global_step in cfg.save.at_steps) and not is_last and writer:
            writer.save(epoch, epoch_step, global_step, metrics, resume_state=resume_state(*position, global_step))
    # What training cost: every rank's CPU seconds, summed (the checkpoint writer's included).
    cpu_s = distributed.all_reduce_sum(torch.tensor([time.process_time()], dtype=torch.float64, device=dev))
    if writer:
        # The final checkpoint is always published (and always evaluated downstream).
        writer.save(
            epoch, epoch_step, global_step, {**metrics, **({"stopped": stop_reason} if stop_reason else {})}, final=True
        )
        writer.close()
        log.write(
            {
                "step": global_step,
                "done": True,
                "stopped": stop_reason,
                "blocked_s": writer.blocked_seconds,
                "train_s": time.monotonic() - started,
                "cpu_s": round(cpu_s[0].item(), 2),
            }
        )
        log.close()
    del ddp  # before the group goes: see distributed.shutdown
    distributed.shutdown()


@dataclasses.dataclass(frozen=True)
class Answered:
    stop: str | None = None
    """The stop reason, for an applied ``stop``."""
    rolled_back: bool = False


def answer_directive(directive, optimizer, schedule, *, inbox: Inbox, step: int, roll_back=None) -> Answered:
    """Apply what evaluation asked and answer it."""
    from areal_eval import distributed

    refused, stop = apply_directive(directive, optimizer, schedule, roll_back=roll_back)
    answer = inbox.answer(directive, step, refused)
    if distributed.rank() == 0:
        print(f"directive {answer.line()}", flush=True)
    return Answered(
        f"{directive.id}: {directive.reason}" if stop else None, directive.action == "rollback" and answer.applied
    )


class TrainLog:
    """Rank 0's training log: one JSON row a line, flushed as written. A full disk is named (the
    file and what was written), not an anonymous ENOSPC."""

    def __init__(self, path: Path):
        self.path = path
        self.file = path.open("a")

    def write(self, row: dict) -> None:
        try:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        except OSError as exc:
            named = named_if_disk_full(exc, self.path, f"the training log (step {row.get('step')})")
            if named is exc:
                raise
            raise named from exc

    def close(self) -> None:
        self.file.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="train_config.json written by the orchestrator")
    args = parser.parse_args(argv)
    spec = read_spec(TrainJobSpec, args.config)
    train(spec)
    return 0


if __name__ == "__main__":
    from areal_eval import distributed

    die_with_parent()  # the torchrun agent: if it is killed outright, its ranks go too
    distributed.exit_process(main())

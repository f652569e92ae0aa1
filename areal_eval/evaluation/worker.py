"""Evaluation worker: the torchrun entry point that evaluates one checkpoint.

    torchrun --nproc-per-node M -m areal_eval.evaluation.worker --checkpoint DIR --data valid.jsonl --out result.json

On more than one node, node 0's agent runs that command and the others run
``torchrun ... -m areal_eval.evaluation.worker --follow``: after joining the group they receive the job
(arguments, file list, validation data) from global rank 0, so only node 0 needs to be told what
to evaluate. Each node's local rank 0 fetches the checkpoint into its own cache.

Runs in its own processes, never in training's. Data-parallel heads read their exact shard and
broadcast each batch to their model-parallel group; statistics are summed over the world;
rank 0 writes the result file atomically. Any failure exits non-zero with the reason on stderr
and in the result file's ``error`` field.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from areal_eval import distributed
from areal_eval.checkpoints.manifest import FileEntry
from areal_eval.checkpoints.store import S3Config, open_store
from areal_eval.evaluation.evaluators import BaseEvaluator, make_evaluator
from areal_eval.launcher import die_with_parent

FAULT_ENV = "AREAL_EVAL_INJECT_FAULT"
"""Fault injection for tests: ``RANK:exit`` or ``RANK:hang`` after that rank's first batch;
``RANK:exit:FILE`` fires once (it creates FILE, and does nothing while FILE exists)."""


def _inject_fault(done_batches: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec or done_batches != 1:
        return
    fault_rank, mode, *once = spec.split(":", 2)
    if int(fault_rank) != distributed.rank():
        return
    if once:
        try:
            Path(once[0]).touch(exist_ok=False)
        except FileExistsError:
            return
    if mode == "exit":
        os._exit(17)
    while mode == "hang":
        time.sleep(3600)


def compute_metrics(evaluator: BaseEvaluator, layout: distributed.ParallelLayout, batch_size: int, mp_group=None) -> dict:
    """Run ``evaluator`` over its shard; returns metrics (identical on every rank)."""
    keys: list[str] | None = None
    local: dict[str, float] = {}
    batches = iter(evaluator.batches(layout.dp_rank, layout.dp_size, batch_size)) if layout.is_dp_head else None
    done = 0
    while True:
        batch = next(batches, None) if batches is not None else None
        if layout.mp_size > 1:
            batch = distributed.broadcast_tensor_container(batch, src_rank=layout.dp_head, group=mp_group)
        if batch is None:
            break
        sums = evaluator.batch_sums(batch)
        done += 1
        _inject_fault(done)
        if layout.is_dp_head:  # model-parallel peers computed the same batch: count it once
            for key, value in sums.items():
                local[key] = local.get(key, 0.0) + value
        keys = keys or sorted(sums)
    # Every rank must reduce the same keys, including a head whose shard was empty.
    keys = _agreed_keys(keys)
    totals = torch.tensor([local.get(k, 0.0) for k in keys], dtype=torch.float64, device=distributed.device())
    distributed.all_reduce_sum(totals)
    return evaluator.metrics(dict(zip(keys, totals.tolist())))


def _agreed_keys(keys: list[str] | None) -> list[str]:
    if distributed.world_size() == 1:
        return keys or []
    gathered: list = [None] * distributed.world_size()
    torch.distributed.all_gather_object(gathered, keys)
    union = sorted({k for ks in gathered if ks for k in ks})
    return union


def receive_job(args: argparse.Namespace) -> argparse.Namespace:
    """On a multi-node job, every rank takes global rank 0's job; node-local paths are rewritten
    into this rank's ``cache_dir``."""
    if not distributed.spans_nodes():
        if args.follow:
            raise ValueError("--follow needs a multi-node torchrun job (--nnodes > 1)")
        return args
    job = None
    if distributed.rank() == 0:
        job = {"args": vars(args), "files": Path(args.files).read_text(), "data": Path(args.data).read_bytes()}
    job = distributed.broadcast_object(job)
    if distributed.rank() == 0:
        return args
    local = Path(args.cache_dir) / "jobs" / f"rank-{distributed.rank()}"
    local.mkdir(parents=True, exist_ok=True)
    (local / "files.json").write_text(job["files"])
    (local / "valid.jsonl").write_bytes(job["data"])
    received = argparse.Namespace(**job["args"])
    received.files, received.data, received.cache_dir = str(local / "files.json"), str(local / "valid.jsonl"), args.cache_dir
    received.out, received.follow = str(local / "unused-result.json"), True
    return received


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def _create_json(path: Path, data: dict) -> None:
    """Write ``path`` whole unless it exists (a hard link is atomic and refuses to replace)."""
    tmp = path.with_suffix(f".{distributed.rank()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="checkpoint directory or s3:// URI")
    parser.add_argument("--data", help="validation pairs (JSONL)")
    parser.add_argument("--out", help="result JSON, written by rank 0")
    parser.add_argument("--files", help="JSON list of {name,size,sha256} to verify before loading")
    parser.add_argument("--follow", action="store_true", help="a node other than 0: take the job from global rank 0")
    parser.add_argument("--serve", metavar="INBOX", help="stay up and evaluate each job file put in INBOX (warm workers)")
    parser.add_argument("--cache-dir", default="checkpoint-cache", help="node-local cache of downloaded checkpoints")
    parser.add_argument("--s3-config", help="S3Config as JSON (endpoint, retries, transfer settings)")
    parser.add_argument("--evaluator", default="reward_model")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--mp-size", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0, help="collective timeout, seconds")
    parser.add_argument("--allow-pickle", action="store_true")
    parser.add_argument("--launched-at", type=float, default=0.0, help="launcher's wall time, for latency records")
    return parser


def run_job(args: argparse.Namespace, started_at: float) -> None:
    """Fetch, load and evaluate one checkpoint on every rank; rank 0 writes the result file."""
    layout = distributed.ParallelLayout(distributed.world_size(), distributed.rank(), args.mp_size)
    mp_group = distributed.new_mp_group(layout)
    files = tuple(FileEntry(**f) for f in json.loads(Path(args.files).read_text()))
    store = open_store(args.checkpoint, S3Config(**json.loads(args.s3_config)) if args.s3_config else None)
    cache_dir = Path(args.cache_dir)
    if distributed.local_rank() == 0:  # one download and verification per node
        store.fetch(args.checkpoint, files, cache_dir)
    if distributed.world_size() > 1:
        torch.distributed.barrier()  # nobody loads before the node's copy is verified
    evaluator = make_evaluator(args.evaluator, max_length=args.max_length)
    evaluator.load(store.local_path(args.checkpoint, files, cache_dir), Path(args.data), allow_pickle=args.allow_pickle)
    loop_start = time.time()
    metrics = compute_metrics(evaluator, layout, args.batch_size, mp_group)
    if layout.rank == 0:
        _write_json(Path(args.out), {
            "checkpoint": args.checkpoint,
            "metrics": metrics,
            "world_size": layout.world_size,
            "mp_size": layout.mp_size,
            "launched_at": args.launched_at,
            "started_at": started_at,
            "seconds": time.time() - started_at,
            "eval_loop_seconds": time.time() - loop_start,
        })


def next_job(inbox: Path, done: set[str], poll_s: float = 0.01) -> Path:
    """The oldest job file not yet handled. Every rank watches the inbox itself, so idle ranks
    wait on the file system, not in a collective that would time out."""
    while True:
        jobs = sorted(p for p in inbox.glob("*.json") if p.name not in done)
        if jobs:
            return jobs[0]
        time.sleep(poll_s)


def serve(parser: argparse.ArgumentParser, inbox: Path) -> None:
    """Warm workers: evaluate job after job from ``inbox`` until a stop job (see worker_pool).

    Whatever fails while a job is handled (its file, its arguments, the evaluation, the barrier
    after it) is reported against that job: in its result file and this rank's log.
    """
    done: set[str] = set()
    while True:
        path = next_job(inbox, done)
        args = None
        try:
            argv = json.loads(path.read_text())["argv"]
            if argv is None:
                return
            args = parse_job(parser, argv)
            run_job(args, started_at=time.time())
            done.add(path.name)
            if distributed.world_size() > 1:
                torch.distributed.barrier()  # every rank has read the job before it is removed
            if distributed.rank() == 0:
                path.unlink()
        except Exception as exc:
            _fail(args or job_outline(argv if "argv" in locals() else None), exc, job=path.name)
            exc.reported = True  # against the job that failed: main() need not report it again
            raise


def job_outline(argv: list[str] | None) -> argparse.Namespace:
    """Where a job that could not be parsed wanted its result, so its failure lands there."""
    argv = argv if isinstance(argv, list) else []

    def value(flag: str) -> str | None:
        return argv[argv.index(flag) + 1] if flag in argv[:-1] else None

    return argparse.Namespace(out=value("--out"), checkpoint=value("--checkpoint"))


def parse_job(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """A job's arguments; a bad one raises (argparse would exit the rank with only a usage line)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        raise ValueError(f"bad job arguments {argv!r} (argparse exit {exc.code})") from None


def _fail(args: argparse.Namespace, exc: Exception, job: str | None = None) -> None:
    """Log the failure and record it in the job's result file, whichever rank it hit: the first
    rank to fail writes the file (its cause), and peers that fail after it, often only because
    it is gone, leave it alone."""
    cause = f"{type(exc).__name__}: {exc}"
    where = f" (job {job})" if job else ""
    print(f"[rank {distributed.rank()}] evaluation failed{where}: {cause}", file=sys.stderr, flush=True)
    if getattr(args, "out", None):
        error = cause if distributed.rank() == 0 else f"rank {distributed.rank()}: {cause}"
        _create_json(Path(args.out), {"checkpoint": args.checkpoint, "error": error})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    missing = [a for a in ("checkpoint", "data", "out", "files") if getattr(args, a) is None]
    if missing and not (args.follow or args.serve):
        parser.error(f"--{', --'.join(missing)} required (or --follow on nodes other than 0, or --serve)")

    torch.set_num_threads(int(os.environ.get("AREAL_EVAL_THREADS", "1")))
    start = time.time()  # workers are up (interpreter, torch imported): start-up latency ends here
    distributed.init(timeout_s=args.timeout)
    ok = False
    try:
        if args.serve:
            serve(parser, Path(args.serve))
        else:
            args = receive_job(args)
            run_job(args, start)
        ok = True
        return 0
    except Exception as exc:
        if not getattr(exc, "reported", False):  # serve() reports a job's failure against that job
            _fail(args, exc)
        return 1
    finally:
        # After a failure peers may be gone: skip the barrier; the launcher's kill is the backstop.
        distributed.shutdown(clean=ok)


if __name__ == "__main__":
    die_with_parent()  # the torchrun agent: if it is killed outright, its ranks go too
    distributed.exit_process(main())

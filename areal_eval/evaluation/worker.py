"""Evaluation worker: the torchrun entry point that evaluates one checkpoint.

    torchrun --nproc-per-node M -m areal_eval.evaluation.worker --spec job.json

On more than one node, node 0's agent runs that command and the others run
``torchrun ... -m areal_eval.evaluation.worker --follow``: after joining the group they receive the job
(its spec and the validation data) from global rank 0, so only node 0 needs to be told what
to evaluate. Each node's local rank 0 fetches the checkpoint into its own cache.

Runs in its own processes, never in training's. Data-parallel heads read their exact shard and
broadcast each batch to their model-parallel group; statistics are summed over the world;
rank 0 writes the result file atomically. Any failure exits non-zero with the reason on stderr
and in the result file's ``error`` field.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from areal_eval import distributed, jsonl
from areal_eval.checkpoints.store import open_store
from areal_eval.evaluation.evaluators import BaseEvaluator, check_metric_names, make_evaluator
from areal_eval.evaluation.items import gather_items, items_dir, write_items
from areal_eval.evaluation.job_spec import COLLECTIVE_TIMEOUT_S, EvalJobSpec, parse_spec, read_spec, to_json
from areal_eval.evaluation.vllm_decoder import shutdown_engines
from areal_eval.launchers.process_control import die_with_parent
from areal_eval.scheduling.probes import probe_items, probe_rest

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


def compute_sums(
    evaluator: BaseEvaluator, layout: distributed.ParallelLayout, batch_size: int, mp_group=None
) -> dict[str, float]:
    """Run ``evaluator`` over its shard; returns the sums over the world (identical on every rank)."""
    keys: set[str] = set()
    local: dict[str, float] = {}
    batches = iter(evaluator.batches(layout.dp_rank, layout.dp_size, batch_size)) if layout.is_dp_head else None
    done = 0
    while True:
        batch = next(batches, None) if batches is not None else None
        if layout.mp_size > 1:
            batch = distributed.broadcast_tensor_container(batch, src_rank=layout.dp_head, group=mp_group)
        if batch is None:
            break
        with torch.inference_mode():
            sums = evaluator.batch_sums(batch)
        done += 1
        _inject_fault(done)
        if layout.is_dp_head:  # model-parallel peers computed the same batch: count it once
            for key, value in sums.items():
                local[key] = local.get(key, 0.0) + value
        keys.update(sums)
    # Every rank must reduce the same keys, including a head whose shard was empty.
    keys = _agreed_keys(sorted(keys))
    totals = torch.tensor([local.get(k, 0.0) for k in keys], dtype=torch.float64, device=distributed.device())
    distributed.all_reduce_sum(totals)
    return dict(zip(keys, totals.tolist(), strict=False))


def compute_metrics(
    evaluator: BaseEvaluator, layout: distributed.ParallelLayout, batch_size: int, mp_group=None
) -> dict:
    """Run ``evaluator`` over its shard; returns metrics (identical on every rank)."""
    return evaluator.metrics(compute_sums(evaluator, layout, batch_size, mp_group))


def compute_with_probe(
    evaluator: BaseEvaluator,
    layout: distributed.ParallelLayout,
    batch_size: int,
    *,
    fraction: float,
    probe_only: bool,
    mp_group=None,
) -> tuple[dict, dict]:
    """(metrics, probe metrics): see :func:`probe_sums`."""
    whole, subset = probe_sums(
        evaluator, layout, batch_size, fraction=fraction, probe_only=probe_only, mp_group=mp_group
    )
    return (evaluator.metrics(whole) if not probe_only else {}), evaluator.metrics(subset)


def probe_sums(evaluator, layout, batch_size, *, fraction, probe_only, mp_group=None) -> tuple[dict, dict]:
    """(sums, probe subset's sums): the probe subset's sums, then (unless ``probe_only``, when
    the first are the subset's) the rest's, kept apart. The whole set's sums are the two added,
    exactly, and the subset's are what a probe of this checkpoint sees."""
    evaluator.select(lambda n: probe_items(n, fraction))
    subset = compute_sums(evaluator, layout, batch_size, mp_group)
    if probe_only:
        return subset, subset
    evaluator.select(lambda n: probe_rest(n, fraction))
    rest = compute_sums(evaluator, layout, batch_size, mp_group)
    evaluator.select(None)
    return {k: subset.get(k, 0.0) + rest.get(k, 0.0) for k in subset.keys() | rest.keys()}, subset


def evaluation_notes(evaluator: BaseEvaluator, sums: dict) -> list[str]:
    """What went wrong without failing the evaluation: the warnings of the global ``sums``, and
    the first error any rank scored past (all ranks call this: it gathers)."""
    errors = [evaluator.first_error]
    if distributed.world_size() > 1:
        errors = [None] * distributed.world_size()
        torch.distributed.all_gather_object(errors, evaluator.first_error)
    first = next((f"rank {r}: {e}" if len(errors) > 1 else e for r, e in enumerate(errors) if e), None)
    return evaluator.warnings(sums) + ([f"first error: {first}"] if first else [])


def _agreed_keys(keys: list[str] | None) -> list[str]:
    if distributed.world_size() == 1:
        return keys or []
    gathered: list = [None] * distributed.world_size()
    torch.distributed.all_gather_object(gathered, keys)
    union = sorted({k for ks in gathered if ks for k in ks})
    return union


def receive_job(spec: EvalJobSpec | None, cache_dir: str) -> EvalJobSpec:
    """On a multi-node job, every rank takes global rank 0's job; its node-local paths are
    rewritten into this rank's ``cache_dir``."""
    if not distributed.spans_nodes():
        if spec is None:
            raise ValueError("--follow needs a multi-node torchrun job (--nnodes > 1)")
        return spec
    job = None
    if distributed.rank() == 0:
        job = {"spec": to_json(spec), "data": Path(spec.data).read_bytes()}
    job = distributed.broadcast_object(job)
    if distributed.rank() == 0:
        return spec
    local = Path(cache_dir) / "jobs" / f"rank-{distributed.rank()}"
    local.mkdir(parents=True, exist_ok=True)
    (local / "valid.jsonl").write_bytes(job["data"])
    received = parse_spec(EvalJobSpec, job["spec"], "job from rank 0")
    return dataclasses.replace(
        received, data=str(local / "valid.jsonl"), cache_dir=cache_dir, out=str(local / "unused-result.json")
    )


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
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--spec", help="the job: an EvalJobSpec JSON file (areal_eval.evaluation.job_spec)")
    mode.add_argument("--follow", action="store_true", help="a node other than 0: take the job from global rank 0")
    mode.add_argument("--serve", metavar="INBOX", help="stay up and evaluate each job file put in INBOX (warm workers)")
    parser.add_argument("--cache-dir", default="checkpoint-cache", help="--follow: node-local cache and job files")
    parser.add_argument(
        "--timeout",
        type=float,
        default=COLLECTIVE_TIMEOUT_S,
        help="--follow, --serve: collective timeout of the group, seconds (a --spec job sets its own)",
    )
    return parser


def run_job(spec: EvalJobSpec, started_at: float) -> None:
    """Fetch, load and evaluate one checkpoint on every rank; rank 0 writes the result file."""
    layout = distributed.ParallelLayout(distributed.world_size(), distributed.rank(), spec.mp_size)
    mp_group = distributed.new_mp_group(layout)
    store = open_store(spec.checkpoint, spec.s3)
    files = tuple(spec.files)
    cache_dir = Path(spec.cache_dir)
    if distributed.local_rank() == 0:  # one download and verification per node
        store.fetch(spec.checkpoint, files, cache_dir)
    distributed.barrier()  # nobody loads before the node's copy is verified
    evaluator = make_evaluator(spec.evaluator, spec)
    evaluator.load(store.local_path(spec.checkpoint, files, cache_dir), Path(spec.data), allow_pickle=spec.allow_pickle)
    if spec.items:
        evaluator.keep_items()
    loop_start = time.time()
    if spec.probe_fraction is None:
        sums = compute_sums(evaluator, layout, spec.batch_size, mp_group)
        metrics, probe_metrics = evaluator.metrics(sums), {}
    else:
        sums, subset = probe_sums(
            evaluator,
            layout,
            spec.batch_size,
            fraction=spec.probe_fraction,
            probe_only=spec.probe_only,
            mp_group=mp_group,
        )
        metrics = {} if spec.probe_only else evaluator.metrics(sums)
        probe_metrics = evaluator.metrics(subset)
    metrics = check_metric_names(metrics, spec.evaluator)
    notes = evaluation_notes(evaluator, sums)
    tables = gather_items(evaluator, layout)
    if layout.rank == 0:
        try:
            item_files = write_items(tables, items_dir(spec.out), spec.item_text_chars)
        except OSError as exc:  # a full disk, say: the metrics still go out, the loss is said
            item_files = {}
            notes.append(f"per-item results not kept: {exc}")
        for note in notes:
            print(f"warning: {note}", file=sys.stderr, flush=True)
        jsonl.write_json(
            Path(spec.out),
            {
                "checkpoint": spec.checkpoint,
                "metrics": metrics,
                "probe_metrics": check_metric_names(probe_metrics, spec.evaluator),
                "world_size": layout.world_size,
                "mp_size": layout.mp_size,
                "devices": os.environ.get("CUDA_VISIBLE_DEVICES"),  # what its launcher gave rank 0
                "launched_at": spec.launched_at,
                "started_at": started_at,
                "seconds": time.time() - started_at,
                "eval_loop_seconds": time.time() - loop_start,
                "notes": notes,
                "items": item_files,
            },
        )


def release_device_memory() -> None:
    """Hand the evaluation's freed GPU memory back to the driver. Torch's allocator keeps what a
    job freed for its next tensors, so an idle warm rank would hold its last checkpoint's model
    and activations: on a device shared with training (``eval.share_devices``) that is memory
    training cannot have between evaluations. A CUDA context is all an idle rank keeps."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def next_job(inbox: Path, done: set[str], poll_s: float = 0.05) -> Path:
    """The oldest job file not yet handled. Every rank watches the inbox itself, so idle ranks
    wait on the file system, not in a collective that would time out."""
    while True:
        jobs = sorted(p for p in inbox.glob("*.json") if p.name not in done)
        if jobs:
            return jobs[0]
        time.sleep(poll_s)


def serve(inbox: Path) -> None:
    """Warm workers: evaluate job after job from ``inbox`` until a stop job (see worker_pool).

    Whatever fails while a job is handled (its file, its spec, the evaluation, the barrier
    after it) is reported against that job: in its result file and this rank's log.
    """
    done: set[str] = set()
    while True:
        path = next_job(inbox, done)
        raw = None
        try:
            raw = jsonl.read_json(path)["spec"]
            if raw is None:
                return
            run_job(parse_spec(EvalJobSpec, raw, f"job {path.name}"), started_at=time.time())
            release_device_memory()
            done.add(path.name)
            distributed.barrier()  # every rank has read the job before it is removed
            if distributed.rank() == 0:
                path.unlink()
        except Exception as exc:
            outline = raw if isinstance(raw, dict) else {}
            _fail(outline.get("out"), outline.get("checkpoint"), exc, job=path.name)
            exc.reported = True  # against the job that failed: main() need not report it again
            raise


def _fail(out: str | None, checkpoint: str | None, exc: Exception, job: str | None = None) -> None:
    """Log the failure and record it in the job's result file, whichever rank it hit: the first
    rank to fail writes the file (its cause), and peers that fail after it, often only because
    it is gone, leave it alone."""
    cause = f"{type(exc).__name__}: {exc}"
    where = f" (job {job})" if job else ""
    print(f"[rank {distributed.rank()}] evaluation failed{where}: {cause}", file=sys.stderr, flush=True)
    if isinstance(out, str) and out:
        error = cause if distributed.rank() == 0 else f"rank {distributed.rank()}: {cause}"
        _create_json(Path(out), {"checkpoint": checkpoint, "error": error})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = read_spec(EvalJobSpec, args.spec) if args.spec else None
    except Exception as exc:  # a result file still says why, where the spec names one
        outline = jsonl.read_json(args.spec, {}) if Path(args.spec).exists() else {}
        outline = outline if isinstance(outline, dict) else {}
        _fail(outline.get("out"), outline.get("checkpoint"), exc)
        return 1
    torch.set_num_threads(int(os.environ.get("AREAL_EVAL_THREADS", "1")))
    start = time.time()  # workers are up (interpreter, torch imported): start-up latency ends here
    distributed.init(timeout_s=spec.collective_timeout_s if spec else args.timeout)
    ok = False
    try:
        if args.serve:
            serve(Path(args.serve))
        else:
            spec = receive_job(spec, args.cache_dir)
            run_job(spec, start)
        ok = True
        return 0
    except Exception as exc:
        if not getattr(exc, "reported", False):  # serve() reports a job's failure against that job
            _fail(spec.out if spec else None, spec.checkpoint if spec else None, exc)
        return 1
    finally:
        stop_engines()
        # After a failure peers may be gone: skip the barrier; the launcher's kill is the backstop.
        distributed.shutdown(clean=ok)


def stop_engines() -> None:
    """Stop the vLLM engine this rank keeps, if any: its processes are the rank's children, and a
    forked rank's exit waits for its children (the launcher would kill it 30 s later)."""
    try:
        shutdown_engines()
    except Exception as exc:  # noqa: BLE001 - an engine that died already: the rank still exits
        print(f"[rank {distributed.rank()}] vllm engine did not shut down: {exc!r}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    die_with_parent()  # the torchrun agent: if it is killed outright, its ranks go too
    distributed.exit_process(main())

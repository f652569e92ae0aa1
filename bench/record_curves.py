"""Record learning curves from our own training runs, for tuning and checking the scheduler.

    .venv/bin/python bench/record_curves.py [--out bench/curves/areal-demo.jsonl] [--runs 3]
    .venv/bin/python bench/record_curves.py --geometric   # -> bench/curves/areal-demo-geometric.jsonl
    .venv/bin/python bench/record_curves.py --preset sft-math [--geometric]   # -> bench/curves/sft-math*.jsonl

``--preset areal-demo`` (the default) trains the demo's reward model (2 DDP ranks) with a few
seeds and label-noise levels: one curve per run and metric (accuracy, higher is better;
Bradley-Terry loss, lower is better). ``--preset sft-math`` trains the sft-math preset's causal
LM with a few seeds and save intervals: one curve per run, the greedy answers' math-verify
accuracy on 401 held-out problems. Every checkpoint is evaluated once (2 torchrun ranks) and
written in the replay format ``{"curve", "higher_is_better", "points": [{"step", "value",
"stderr", "items"}]}``, ``items`` being each validation item's score in the same order at every
point. Ends by replaying them through the adaptive and fixed policies; prints one JSON line.

Each checkpoint is also evaluated on a fixed random subset of the validation pairs (a fifth,
``--subset-fraction``), recorded as ``subset_value`` / ``subset_stderr`` beside the full value:
what a probe of tiered evaluation would have seen there. ``bench/probe_noise.py`` checks replay's
model of probe noise against them, and replay uses them as the probes' results.

``--preset collapse`` trains the demo's reward model with its learning rate raised 30x at step
300, a collapse part-way. Every curve also carries ``train``: each checkpoint's training metrics as
its trainer published them (loss, learning rate), for the scheduler's ``train_metric``.

``--geometric`` saves at steps 1, 2, 4, ... before the even cadence takes over, as Pythia's
published schedule does (0, 1, 2, 4, ... 512, then every 1000): the schedule whose growing gaps
a scheduler must not mistake for "too long without an evaluation".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import tempfile
from pathlib import Path

from common import ROOT, emit, prepared_run


@dataclasses.dataclass(frozen=True)
class Recording:
    """What one preset's curves are recorded from."""

    runs: list[tuple[int, float, int]]
    """(seed, label noise, checkpoint every N steps); the noise is the reward model's only."""
    geometric_runs: list[tuple[int, float, int]]
    """The same, saving first at steps 1, 2, 4, ... below N."""
    metrics: dict[str, tuple[str, str, bool]]
    """Curve metric -> (evaluator, its item column, higher is better)."""
    config: Path | None = None
    """The preset's config file (None: the demo's defaults)."""
    sections: dict = dataclasses.field(default_factory=dict)
    """Settings over the config, for every run of the preset."""


PRESETS = {
    # The demo's reward model: uneven spacing on purpose in the last even run.
    "areal-demo": Recording(
        runs=[(1, 0.15, 25), (2, 0.25, 25), (3, 0.10, 40), (4, 0.20, 15)],
        geometric_runs=[(5, 0.15, 50), (6, 0.20, 100), (7, 0.10, 64)],
        metrics={"accuracy": ("reward_model", "correct", True), "loss": ("reward_model", "loss", False)},
    ),
    # The demo's reward model collapsing part-way: its learning rate raised 30x at step 300 (as
    # `--preset collapse`), with the training rows each checkpoint published: the scheduler's
    # training signal (scheduler.train_metric) is judged on these and the areal-demo runs.
    "collapse": Recording(
        runs=[(1, 0.15, 25), (2, 0.25, 25), (3, 0.10, 40), (4, 0.20, 15)],
        geometric_runs=[],
        metrics={"accuracy": ("reward_model", "correct", True)},
        sections={"train": {"lr_jump_at": 300, "lr_jump_factor": 30}},
    ),
    # The sft-math preset's causal LM, judged by its greedy answers checked with math-verify
    # (one answer a prompt: the item is that answer's reward).
    "sft-math": Recording(
        runs=[(1, 0.0, 10), (2, 0.0, 15), (3, 0.0, 25), (4, 0.0, 10)],
        geometric_runs=[(5, 0.0, 25), (6, 0.0, 40), (7, 0.0, 32)],
        metrics={"accuracy": ("generation", "reward", True)},
        config=ROOT / "configs" / "sft-math.yaml",
        sections={
            "data": {"math": {"valid_problems": 401}},
            "eval": {"evaluator": "generation", "generation": {"temperature": 0.0, "n_samples": 1, "k": [1]}},
            "scheduler": {"metric": "accuracy"},  # the generation evaluator's alone: no prefix
            "alerts": {"rules": []},
        },
    ),
}


def doubling_steps(below: int) -> list[int]:
    return [2**i for i in range(below.bit_length()) if 2**i < below]


def write_subset(valid: Path, fraction: float, seed: int) -> Path:
    """A fixed random ``fraction`` of the validation rows, in their order: the probes' items."""
    from areal_eval import jsonl

    lines = valid.read_text().splitlines(keepends=True)
    keep = sorted(random.Random(seed).sample(range(len(lines)), max(1, round(fraction * len(lines)))))
    subset = valid.with_name(f"{valid.stem}-subset{valid.suffix}")
    jsonl.write_atomic(subset, "".join(lines[i] for i in keep))
    return subset


def record_run(
    preset: str, work: Path, seed: int, noise: float, every: int, geometric: bool = False, subset_fraction: float = 0.2
) -> list[dict]:
    from areal_eval.checkpoints.manifest import Manifest
    from areal_eval.config.parsing import merge
    from areal_eval.evaluation.items import read_items
    from areal_eval.evaluation.jobs import run_evaluation_job
    from areal_eval.evaluation.worker_pool import WarmEvalWorkers
    from areal_eval.launchers.local import TorchrunJob

    recording = PRESETS[preset]
    noise_part = f"-noise{noise}" if preset == "areal-demo" else ""
    name = f"seed{seed}{noise_part}-{'doubling-then-' if geometric else ''}every{every}"
    at_steps = doubling_steps(every) if geometric else []
    data = {"synthetic": {"seed": seed, "label_noise": noise}} if preset == "areal-demo" else {"math": {"seed": seed}}
    sections = merge(
        recording.sections,
        {"train": {"seed": seed, "save": {"freq_steps": every, "at_steps": at_steps}}, "data": data},
    )
    cfg, run = prepared_run(name, work, recording.config, **sections)
    job = TorchrunJob("areal_eval.train", ["--config", str(run.train_config)], cfg.train.nproc, run.logs / "train.log")
    job.wait(1800)
    job.raise_for_status("training")
    subset = write_subset(Path(run.valid_data), subset_fraction, seed)
    points: dict[str, list[dict]] = {metric: [] for metric in recording.metrics}
    with WarmEvalWorkers(cfg.eval.nproc, run.evals) as workers:
        for event in Manifest(run.manifest).events():
            whole, part = (
                run_evaluation_job(
                    event, data, cfg.eval, run.evals / tag, max_length=cfg.model.max_length, workers=workers
                )
                for data, tag in ((run.valid_data, "full"), (subset, "subset"))
            )
            for metric, (evaluator, column, _) in recording.metrics.items():
                rows = read_items(whole.items[evaluator])
                points[metric].append(
                    {
                        "step": event.global_step,
                        "value": whole.metrics[metric],
                        "stderr": whole.metrics[f"{metric}_stderr"],
                        "subset_value": part.metrics[metric],
                        "subset_stderr": part.metrics[f"{metric}_stderr"],
                        "items": [round(r[column], 6) for r in rows],
                    }
                )
    train = [  # what each checkpoint's publisher said of training (the manifest's train_metrics)
        {"step": e.global_step, **{k: v for k, v in e.train_metrics.items() if isinstance(v, (int, float))}}
        for e in Manifest(run.manifest).events()
    ]
    return [
        {
            "curve": f"{preset}/{name}/{metric}",
            "higher_is_better": recording.metrics[metric][2],
            "subset_fraction": subset_fraction,
            "points": pts,
            "train": train,
        }
        for metric, pts in points.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="areal-demo", help="what is trained and judged")
    parser.add_argument("--geometric", action="store_true", help="log-spaced early saves (geometric_runs)")
    parser.add_argument("--out", help="default: bench/curves/PRESET[-geometric].jsonl")
    parser.add_argument("--runs", type=int, help="the first N runs only")
    parser.add_argument("--subset-fraction", type=float, default=0.2, help="share of the validation rows probed")
    args = parser.parse_args()
    from areal_eval.scheduling import replay
    from areal_eval.scheduling.curves import read_curves

    recording = PRESETS[args.preset]
    runs = recording.geometric_runs if args.geometric else recording.runs
    work = Path(tempfile.mkdtemp(prefix="bench-curves-"))
    curves = [
        c
        for s, noise, every in runs[: args.runs]
        for c in record_run(args.preset, work, s, noise, every, args.geometric, args.subset_fraction)
    ]
    suffix = "-geometric" if args.geometric else ""
    out = Path(args.out or ROOT / "bench" / "curves" / f"{args.preset}{suffix}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(c) + "\n" for c in curves))
    policies = [replay.parse_policy(p) for p in ("adaptive", "fixed:1", "fixed:2", "fixed:3", "fixed:4")]
    emit(
        {
            "benchmark": "record_curves",
            "out": str(out),
            "curves": len(curves),
            "replay_injected": replay.replay(read_curves(out), policies, regression=True)["policies"],
        }
    )


if __name__ == "__main__":
    main()

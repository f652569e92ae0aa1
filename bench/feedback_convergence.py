"""Evaluation steering training, measured: no feedback, the synchronous baseline, this project's
asynchronous feedback, on the project's own reward-model and causal-LM runs.

    .venv/bin/python bench/feedback_convergence.py [--seeds 1 2 3] [--scenarios healthy ...]
        [--out bench/results/feedback-convergence.jsonl] [--plot docs/images/feedback-convergence.png]
        [--pin] [--rejudge WORK] [--keep-weights] [--ways async ...]

Scenarios (the demo's reward model, 2 DDP ranks, saving every 25 steps):

* ``healthy``: the demo's data (8,000 pairs, 15% of labels flipped) with a budget it still
  learns through (400 steps);
* ``plateau``: the demo as it is (3 epochs, 750 steps): flat from about step 350;
* ``overfit``: 400 pairs, 30% flipped, 60 epochs (720 steps): the model learns the flipped labels;
* ``collapse``: the demo with its learning rate raised 30x at step 300 (``--preset collapse``);
* ``sft-plateau``: the sft-math preset's causal LM (``--preset sft-math``, judged by the greedy
  accuracy of its generated answers) trained 3 epochs (561 steps), saving every 25: at 1.0 from
  about step 300.

Ways, each a real run of the scenario with the same seed (same data, same validation items):

* ``none``: the ``train-and-evaluate`` flow with every feedback rule in shadow mode (its default):
  the fixed budget, and what the rules would have done, recorded;
* ``sync``: what a Hugging Face ``Trainer`` user has today (``eval_strategy="steps"`` at every
  save, ``EarlyStoppingCallback(early_stopping_patience=3)``, ``load_best_model_at_end``): the
  project's trainer is paused (SIGSTOP of its ranks) while each checkpoint it publishes is
  evaluated on the same evaluation ranks, and asked to stop once 3 evaluations in a row did not
  beat the best; its model at the end is its best checkpoint;
* ``async``: the flow with ``feedback.stop``, ``lr_scale`` and ``rollback`` acting, the rules'
  defaults otherwise (a stop only once the learning rate was lowered twice);
* ``async-stop``: the same with ``feedback.max_lr_scales: 0``: a stop at the first confirmed plateau;
* ``async-every``: ``async`` with every checkpoint evaluated (``scheduler.policy: fixed``), as
  ``sync`` evaluates them: the same evaluations, but training never waits for them.

For each run: training steps and the ranks' CPU seconds (the trainer's own count), wall seconds,
the best and the final evaluated checkpoint, steps trained after the best, and the directives.
For each scenario and seed, paired on the validation items: each way against ``none`` (best,
and the model each ends with). Wall time at equal quality, as time-to-accuracy benchmarks count
it: the seconds from a way's start until a result at least as good as the model ``sync`` ends
with was known (its result file written), against ``sync``'s own (the target
``less_wall_than_sync``); the whole runs' ratio is ``wall_vs_sync``. Writes a row a run to
``--out``; prints one JSON line. ``--ways`` runs only some ways: such rows are judged once their
runs are joined with the others' in one work directory (``--rejudge``).

On this 2-core machine the flow's evaluations share the cores with training (on a cluster they run
on devices of their own), so ``async``'s wall time carries its evaluations' CPU; ``sync``'s does
too, serially. ``--pin`` gives each its own core instead, in every way alike: the training job's
processes core 0, everything else (the evaluation workers, the flow, MLflow) core 1: the layout
of a cluster where evaluation has devices of its own, on which ``sync``'s training waits while
its evaluation core works and the other way round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

from common import ROOT, emit, prepared_run
from convergence_judge import WAYS, compare, targets_met, verdict
from convergence_plot import plot

SFT_MATH = ROOT / "configs" / "sft-math.yaml"
SCENARIOS = {  # name: (kind, preset, settings over it)
    "healthy": ("healthy", None, {"train": {"max_steps": 400}}),
    "plateau": ("plateau", None, {}),
    "overfit": (
        "overfit",
        None,
        {"train": {"epochs": 60}, "data": {"synthetic": {"train_pairs": 400, "label_noise": 0.3}}},
    ),
    "collapse": ("collapse", None, {"train": {"lr_jump_at": 300, "lr_jump_factor": 30}}),
    "sft-plateau": ("plateau", SFT_MATH, {"train": {"epochs": 3, "save": {"freq_steps": 25}}}),
}
"""The kind decides which targets apply; ``sft-*`` train the sft-math preset's causal LM (its
metric: greedy accuracy of the generated answers)."""
ACTING = {"stop": "act", "lr_scale": "act", "rollback": "act"}
FLOW_SETTINGS = {
    "none": {},
    "async": {"feedback": ACTING},
    "async-stop": {"feedback": {**ACTING, "max_lr_scales": 0}},
    "async-every": {"feedback": ACTING, "scheduler": {"policy": "fixed", "fixed_interval_steps": 1}},
}
"""The settings of the ways that run the flow (``none``: every feedback rule in shadow mode)."""
PATIENCE = 3
"""Evaluations without a better one before ``sync`` stops (EarlyStoppingCallback's patience)."""


def settings(scenario: str, seed: int) -> dict:
    from areal_eval.config.parsing import merge

    _, preset, sections = SCENARIOS[scenario]
    data = "math" if preset == SFT_MATH else "synthetic"
    base = {"train": {"seed": seed}, "data": {data: {"seed": seed}}, "tracking": {"sinks": ["mlflow"]}}
    return merge(base, sections)


def metric_of(scenario: str) -> str:
    from areal_eval.pipeline.config import load_pipeline_config

    return load_pipeline_config(SCENARIOS[scenario][1]).scheduler.metric


def start_prefect() -> None:
    """This process's own Prefect API, started before any run is timed (the first flow would
    otherwise pay for it), without usage reports (as the tests turn them off)."""
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.hello()


class TrainingOnItsOwnCore:
    """``--pin``: this process (and what it starts) on core 1, the training job on core 0: a
    thread moves each process of a training job (``areal_eval.train``) as it appears."""

    def __init__(self):
        import threading

        os.sched_setaffinity(0, {1})
        self._done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        import psutil

        while not self._done.wait(0.02):
            for proc in psutil.process_iter(["cmdline"]):
                with contextlib.suppress(psutil.Error):
                    if "areal_eval.train" in (proc.info["cmdline"] or []) and proc.cpu_affinity() != [0]:
                        for p in [proc, *proc.children(recursive=True)]:
                            with contextlib.suppress(psutil.Error):
                                p.cpu_affinity([0])

    def close(self) -> None:
        self._done.set()


def run_flow(work: Path, name: str, sections: dict, preset: Path | None) -> Path:
    """The train-and-evaluate flow on this process's own Prefect API; the run's directory."""
    from areal_eval.config.parsing import merge
    from flows.train_and_evaluate import train_and_evaluate

    params = merge({"run_name": name, "work_dir": str(work)}, sections)
    params["tracking"]["tracking_uri"] = f"sqlite:///{work / 'mlflow.db'}"
    train_and_evaluate(params=params, config_path=str(preset) if preset else None)
    return work / name


def run_synchronous(work: Path, name: str, sections: dict, preset: Path | None, metric: str) -> Path:
    """Train with every published checkpoint evaluated while training waits, and early stopping."""
    import psutil

    from areal_eval.checkpoints.manifest import Manifest
    from areal_eval.evaluation.jobs import run_evaluation_job
    from areal_eval.evaluation.worker_pool import WarmEvalWorkers
    from areal_eval.launchers.local import TorchrunJob
    from areal_eval.runs.directory import StopSignal

    cfg, run = prepared_run(name, work, preset, **sections)
    job = TorchrunJob("areal_eval.train", ["--config", str(run.train_config)], cfg.train.nproc, run.logs / "train.log")
    best, worse, seen, final = None, 0, 0, False
    with WarmEvalWorkers(cfg.eval.nproc, run.evals) as workers:
        while not final:
            events = Manifest(run.manifest).events()[seen:] if run.manifest.exists() else []
            if not events:
                if job.poll() is not None:
                    job.raise_for_status("training")  # it ended without its final checkpoint
                time.sleep(0.05)
                continue
            for event in events:
                ranks = _signal_tree(psutil.Process(job.pid), signal.SIGSTOP)
                try:
                    result = run_evaluation_job(
                        event, run.valid_data, cfg.eval, run.evals, max_length=cfg.model.max_length, workers=workers
                    )
                finally:
                    for rank in ranks:
                        with contextlib.suppress(psutil.NoSuchProcess):
                            rank.send_signal(signal.SIGCONT)
                value = result.metrics[metric]
                if best is None or value > best:
                    best, worse = value, 0
                else:
                    worse += 1
                if worse >= PATIENCE:
                    StopSignal(run.stop_file).request(f"early stopping: {PATIENCE} evaluations without a better one")
                final = final or event.final
            seen += len(events)
    job.wait(300)
    job.raise_for_status("training")
    return run.root


def _signal_tree(process, sig) -> list:
    """``sig`` to the training job and every process under it (its ranks); those signalled."""
    import psutil

    sent = []
    for p in [process, *process.children(recursive=True)]:
        try:
            p.send_signal(sig)
            sent.append(p)
        except psutil.NoSuchProcess:  # a rank that has just ended
            pass
    return sent


def evaluated(run_dir: Path, metric: str, started: float) -> tuple[dict[int, float], dict[int, float]]:
    """Every evaluated checkpoint's metric, by step; and the seconds from ``started`` (epoch) until
    its result was written (when whoever waits on it knows it)."""
    found, known = {}, {}
    for path in sorted((run_dir / "evals").glob("global_step_????????.json")):
        metrics = json.loads(path.read_text()).get("metrics", {})
        if metric in metrics:
            step = int(path.stem.rsplit("_", 1)[1])
            found[step], known[step] = metrics[metric], round(path.stat().st_mtime - started, 1)
    return found, known


def measured(run_dir: Path, way: str, started: float, metric: str) -> dict:
    from areal_eval.runs.directives import directive_records

    wall_s = time.time() - started
    curve, known = evaluated(run_dir, metric, started)
    done = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()][-1]
    best_step = max(curve, key=lambda s: (curve[s], -s))
    final_step = max(curve)
    ends_with = best_step if way == "sync" else final_step  # sync: load_best_model_at_end
    return {
        "way": way,
        "steps": done["step"],
        "train_cpu_s": done["cpu_s"],
        "wall_s": round(wall_s, 1),
        "metric": metric,
        "best": {"step": best_step, "value": curve[best_step]},
        "end": {"step": ends_with, "value": curve[ends_with]},
        "steps_after_best": done["step"] - best_step,
        "evaluations": len(curve),
        "stopped": done.get("stopped"),
        "directives": directive_records(run_dir),
        "curve": sorted(curve.items()),
        "known_at_s": sorted(known.items()),
    }


def main() -> None:
    from areal_eval.config.parsing import merge

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "feedback-convergence.jsonl")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "images" / "feedback-convergence.png")
    parser.add_argument("--pin", action="store_true", help="training on core 0, the rest on core 1")
    parser.add_argument(
        "--rejudge", type=Path, metavar="WORK", help="judge the rows in --out again from their runs in WORK"
    )
    parser.add_argument(
        "--ways", nargs="+", choices=WAYS, default=list(WAYS), help="run only these (a row is judged with all five)"
    )
    parser.add_argument("--keep-weights", action="store_true", help="keep every run's checkpoints (GBs a scenario)")
    args = parser.parse_args()
    if args.rejudge:
        results = [judged(json.loads(line), args.rejudge) for line in args.out.read_text().splitlines()]
        args.out.write_text("".join(json.dumps(r) + "\n" for r in results))
        return summarize(results, args)
    if args.pin:
        TrainingOnItsOwnCore()
    work = Path(tempfile.mkdtemp(prefix="bench-feedback-"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    start_prefect()
    with args.out.open("w") as out:
        for seed in args.seeds:  # every scenario once before the next seed
            for scenario in args.scenarios:
                _, preset, _ = SCENARIOS[scenario]
                sections, metric = settings(scenario, seed), metric_of(scenario)
                rows = {}
                for way in args.ways:
                    name, started = f"{scenario}-seed{seed}-{way}", time.time()
                    if way == "sync":
                        run_dir = run_synchronous(work, name, sections, preset, metric)
                    else:
                        run_dir = run_flow(work, name, merge(sections, FLOW_SETTINGS[way]), preset)
                    rows[way] = measured(run_dir, way, started, metric)
                result = {"scenario": scenario, "seed": seed, "runs": rows}
                if len(rows) == len(WAYS):
                    result = judged(result, work)
                if not args.keep_weights:
                    drop_weights(work, scenario, seed)
                out.write(json.dumps(result) + "\n")
                out.flush()
                results.append(result)
                said = {k: result[k] for k in ("scenario", "seed", "compared", "targets") if k in result}
                print(json.dumps({**said, "work": str(work)}), flush=True)
    if all("targets" in r for r in results):
        summarize(results, args)


def judged(result: dict, work: Path) -> dict:
    """A scenario's row with its ways compared and the targets judged (its runs are in ``work``)."""
    dirs = {way: work / f"{result['scenario']}-seed{result['seed']}-{way}" for way in WAYS}
    compared = compare(result["runs"], dirs)
    kind = SCENARIOS[result["scenario"]][0]
    return {
        **result,
        "compared": compared,
        "targets": {way: verdict(kind, way, compared, result["runs"]) for way in WAYS[2:]},
    }


def drop_weights(work: Path, scenario: str, seed: int) -> None:
    """Remove a judged scenario's checkpoints and resume states (75 runs keep about 60 GB of
    them); the records ``--rejudge`` reads stay."""
    for way in WAYS:
        for weights in ("checkpoints", "resume"):
            shutil.rmtree(work / f"{scenario}-seed{seed}-{way}" / weights, ignore_errors=True)


def summarize(results: list[dict], args) -> None:
    plot(results, args.plot, WAYS)
    scenarios = list(dict.fromkeys(r["scenario"] for r in results))
    emit(
        {
            "benchmark": "feedback_convergence",
            "runs": len(results),
            "out": str(args.out),
            "targets_met": {s: targets_met([r for r in results if r["scenario"] == s]) for s in scenarios},
            "of": {s: sum(r["scenario"] == s for r in results) for s in scenarios},
        }
    )


if __name__ == "__main__":
    main()

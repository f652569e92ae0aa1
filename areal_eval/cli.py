"""``areal-eval``: command-line tools that need no orchestrator.

areal-eval replay CURVES.jsonl [--policy adaptive] [--policy fixed:K ...] [--inject-regression] [--without-items]
    [--feedback [field=value,...]] [--json]
areal-eval follow-node [--cache-dir DIR] [--once]
areal-eval compare RUN_DIR STEP_A STEP_B [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from areal_eval.alerts import NOISE_AWARE_REGRESSION, AlertRule
from areal_eval.config.parsing import ConfigError, from_dict, override_value
from areal_eval.feedback import FeedbackConfig
from areal_eval.scheduling import replay as replay_mod
from areal_eval.scheduling.curves import read_curves


def _number_or(word: str, kind: type = int):
    """An argparse type: a number (``int``: a whole one), or ``word`` for None."""
    what = "a whole number" if kind is int else "a number"

    def parse(text: str) -> int | float | None:
        if text == word:
            return None
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is neither {what} nor {word!r}") from None

    return parse


def _replay(args) -> int:
    curves = read_curves(args.curves)
    specs = args.policy or ["adaptive", "fixed:1", "fixed:2", "fixed:3", "fixed:4"]
    policies = [replay_mod.parse_policy(s) for s in specs]
    rules = [
        AlertRule("any_drop", "regression"),
        AlertRule(
            "noise_aware",
            "regression",
            stderrs=args.alert_stderrs,
            consecutive=args.alert_consecutive,
            baseline_results=args.alert_baseline_results,
            confirm=args.alert_confirm,
            at_once_stderrs=args.alert_at_once_stderrs if args.alert_confirm else None,
            final_stderrs=args.alert_final_stderrs if args.alert_confirm else None,
        ),
    ]
    result = replay_mod.replay(
        curves,
        policies,
        regression=args.inject_regression,
        seed=args.seed,
        alert_rules=rules,
        use_items=not args.without_items,
        feedback=args.feedback,
    )
    if not args.json or sys.stdout.isatty():
        cols = ["evaluations", "mean_tracking_error", "mean_regret", "max_regret"] + (
            ["detection_delay"] if args.inject_regression else []
        )
        print(f"{len(curves)} curves, {sum(len(c.points) for c in curves)} checkpoints")
        print(f"{'policy':<28}" + "".join(f"{c:>22}" for c in cols))
        for name, row in result["policies"].items():
            print(f"{name:<28}" + "".join(f"{row[c]:>22}" for c in cols))
        for name, row in result["policies"].items():
            for rule, scores in row["alerts"].items():
                print(f"{name:<28}alert rule {rule}: " + ", ".join(f"{k} {v}" for k, v in scores.items()))
            for action, scores in row.get("feedback", {}).items():
                print(f"{name:<28}feedback {action}: " + ", ".join(f"{k} {v}" for k, v in scores.items()))
    if args.json:
        print(json.dumps(result))
    return 0


def _feedback_config(spec: str) -> FeedbackConfig:
    """``field=value,...`` of the feedback rules, read as ``--set`` reads them."""
    fields = {}
    for item in filter(None, spec.split(",")):
        if "=" not in item:
            raise argparse.ArgumentTypeError(f"--feedback: {item!r} is not field=value")
        key, value = item.split("=", 1)
        fields[key.strip()] = override_value(f"feedback.{key.strip()}", value)
    try:
        return from_dict(FeedbackConfig, fields, "feedback")
    except (ConfigError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _follow_node(args) -> int:
    """A node other than 0 of a multi-node evaluation pool (``infra/k8s``): join each evaluation
    that node 0 starts, until the pod is stopped. The layout comes from ``AREAL_EVAL_*``."""
    from areal_eval.launchers.local import NodeLayout, torchrun_command

    nodes = NodeLayout.from_env()
    if nodes.nnodes < 2 or nodes.node_rank == 0:
        raise ValueError(
            "follow-node runs on nodes 1..N-1 of a multi-node pool (AREAL_EVAL_NNODES >= 2, AREAL_EVAL_NODE_RANK >= 1)"
        )
    worker_args = ["--follow", "--cache-dir", args.cache_dir]
    command = torchrun_command("areal_eval.evaluation.worker", worker_args, nodes.nproc_per_node or 1, nodes=nodes)
    while True:
        code = subprocess.run(command).returncode
        print(f"areal-eval follow-node: evaluation job ended with exit {code}", file=sys.stderr, flush=True)
        if args.once:
            return code
        time.sleep(1)


def _compare(args) -> int:
    from areal_eval.compare import compare_steps, format_table

    comparisons = compare_steps(args.run_dir, args.step_a, args.step_b)
    if args.json:
        print(json.dumps([{"evaluator": c.evaluator, "score": c.score, **vars(c.result)} for c in comparisons]))
    else:
        print(format_table(args.run_dir, args.step_a, args.step_b, comparisons))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="areal-eval", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rp = sub.add_parser("replay", help="score scheduling policies on recorded learning curves")
    rp.add_argument("curves", help="curves JSONL: one {curve, higher_is_better, points:[{step,value,stderr}]} a line")
    rp.add_argument(
        "--policy",
        action="append",
        help="adaptive | adaptive:field=value,... (scheduler fields; probe_fraction and probe_escalate_stderrs "
        "simulate probes) | fixed:K (repeatable)",
    )
    rp.add_argument(
        "--inject-regression", action="store_true", help="drop 5 stderr from a seeded checkpoint in the second half"
    )
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument(
        "--without-items",
        action="store_true",
        help="judge probes and alerts unpaired: drop the curves' items once the regression is injected",
    )
    rp.add_argument(
        "--alert-stderrs",
        type=float,
        default=NOISE_AWARE_REGRESSION["stderrs"],
        help="the noise-aware regression rule's stderrs (AlertRule.stderrs; default %(default)s)",
    )
    rp.add_argument(
        "--alert-baseline-results",
        type=_number_or("best"),
        default=NOISE_AWARE_REGRESSION["baseline_results"],
        help="... measured from the mean of this many recent results, or 'best' (AlertRule.baseline_results; "
        "default %(default)s)",
    )
    rp.add_argument(
        "--alert-confirm",
        type=_number_or("none"),
        default=NOISE_AWARE_REGRESSION["confirm"],
        help="... confirmed by this many results in a row, or 'none' (AlertRule.confirm; default %(default)s)",
    )
    rp.add_argument(
        "--alert-at-once-stderrs",
        type=float,
        default=NOISE_AWARE_REGRESSION["at_once_stderrs"],
        help="... unconfirmed past this many (AlertRule.at_once_stderrs, with --alert-confirm; default %(default)s)",
    )
    rp.add_argument(
        "--alert-final-stderrs",
        type=_number_or("none", float),
        default=NOISE_AWARE_REGRESSION.get("final_stderrs"),
        help="... and at the final checkpoint past this many, or 'none' (AlertRule.final_stderrs, with "
        "--alert-confirm; default %(default)s)",
    )
    rp.add_argument(
        "--alert-consecutive", type=int, default=None, help="... and its consecutive (AlertRule.consecutive)"
    )
    rp.add_argument(
        "--feedback",
        type=_feedback_config,
        nargs="?",
        const=FeedbackConfig(),
        help="also report what the feedback rules would have asked of training: their defaults, or "
        "field=value,... (FeedbackConfig fields, e.g. patience=4,target=0.8)",
    )
    rp.add_argument("--json", action="store_true", help="last line of stdout: one JSON object")
    rp.set_defaults(run=_replay)
    fp = sub.add_parser("follow-node", help="serve evaluations started by node 0 (multi-node pools)")
    fp.add_argument("--cache-dir", default="/cache", help="node-local checkpoint cache")
    fp.add_argument("--once", action="store_true", help="serve one evaluation, then exit with its status")
    fp.set_defaults(run=_follow_node)
    cp = sub.add_parser("compare", help="two evaluations of a run, paired on their common items")
    cp.add_argument("run_dir", help="the run directory (work_dir/run_name, e.g. runs/demo)")
    cp.add_argument("step_a", type=int)
    cp.add_argument("step_b", type=int)
    cp.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    cp.set_defaults(run=_compare)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as exc:  # bad input or a file that cannot be read: said, not a traceback
        print(f"areal-eval: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

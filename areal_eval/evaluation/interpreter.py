"""Whether the evaluation workers' interpreter (``eval.python``) can import what the configured
evaluators need, checked when the config is read: a missing package is then one line naming the
field, not a failed evaluation per checkpoint. Modules are found with ``find_spec`` in a
subprocess of that interpreter (nothing is imported; about 50 ms, once per interpreter)."""

from __future__ import annotations

import functools
import subprocess

from areal_eval.config.parsing import FieldError

FIND = "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))"


def required_modules(evaluator: str, generation) -> dict[str, str]:
    """The modules the workers import for ``evaluator`` (a comma-separated ``eval.evaluator``),
    each with the setting that needs it."""
    needs = {"areal_eval": "eval.python", "torch": "eval.python", "transformers": "eval.python"}
    for name in (n.strip() for n in evaluator.split(",")):
        if name == "lm_eval":  # the harness's HFLM imports accelerate
            needs |= {"lm_eval": "eval.evaluator: lm_eval", "accelerate": "eval.evaluator: lm_eval"}
        elif name == "generation" and generation.backend == "vllm":
            needs["vllm"] = "eval.generation.backend: vllm"
        if name == "generation" and generation.reward == "math":
            needs["math_verify"] = "eval.generation.reward: math"
    return needs


@functools.cache
def missing_modules(python: str, modules: tuple[str, ...]) -> tuple[str, ...]:
    try:
        done = subprocess.run([python, "-c", FIND, *modules], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FieldError("python", f"{python!r} could not be run: {exc}") from exc
    if done.returncode:
        raise FieldError("python", f"{python!r} failed to start: {done.stderr.strip()[-300:]}")
    return tuple(done.stdout.split())


def check_interpreter(python: str, evaluator: str, generation) -> None:
    """Refuse ``python`` for the workers where it lacks a module the evaluators need."""
    needs = required_modules(evaluator, generation)
    missing = missing_modules(python, tuple(sorted(needs)))
    if missing:
        wanted = "; ".join(f"{m} (for {needs[m]})" for m in missing)
        raise FieldError(
            "python",
            f"{python!r} cannot import {wanted}: install them in that environment, or point eval.python elsewhere",
        )

"""Tokenizing the validation data with the checkpoint's tokenizer before any worker starts.

    python -m areal_eval.evaluation.preflight job.json

A row that tokenizes to nothing to score, or a setting the tokenizer cannot honour, is refused
here, naming file and line, instead of inside a torchrun job. It runs in a process of its own,
so the flow's process never imports torch or transformers; once the data, the settings and the
tokenizer are known good, later checkpoints with the same tokenizer skip it (:func:`preflight_cache`).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from areal_eval.checkpoints.manifest import CheckpointEvent, sha256_file

WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".distcp", ".index.json")
"""Checkpoint files that change with every step and never hold the tokenizer."""

TOKENIZING_SETTINGS = ("evaluator", "max_length", "generation", "lm_loss", "lm_eval")
"""The job spec's fields the check reads (batch sizes, timeouts and probes change nothing)."""

REFUSED_EXIT = 3
"""Exit status of a refusal (its reason on stderr): anything else is the check's own failure."""


def preflight_cache() -> Path:
    """Where checks that passed are remembered (``$XDG_CACHE_HOME/areal-eval/preflight``): keyed
    by everything they depend on, so every run, flow run and work directory of the user shares them."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "areal-eval" / "preflight"


def preflight_key(event: CheckpointEvent, data: Path, spec_json: dict) -> str:
    """What the check depends on: the data, the settings that say how it is read and tokenized,
    and the checkpoint's non-weight files (tokenizer and config): the same for every checkpoint
    of a run."""
    settings = {k: spec_json.get(k) for k in TOKENIZING_SETTINGS}
    tokenizer = sorted((f.name, f.sha256) for f in event.files if not f.name.endswith(WEIGHTS))
    blob = json.dumps([sha256_file(data), settings, tokenizer], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def run_preflight(spec_file: Path, env: dict, timeout_s: float) -> str | None:
    """None if the data passes; the refusal's one line (``DataError: file:line: ...``) if not.
    A check that cannot run (a crash, a timeout) passes: the workers meet the same rows anyway.
    In a process that has imported transformers already (a notebook, a test), it runs here."""
    if "transformers" in sys.modules:
        return refusal(spec_file)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "areal_eval.evaluation.preflight", str(spec_file)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return None
    if done.returncode == REFUSED_EXIT:
        return done.stderr.strip().splitlines()[-1]
    return None


def refusal(spec_file: Path) -> str | None:
    """The check itself: None, or why the job's data or settings are refused."""
    from areal_eval.config.parsing import ConfigError
    from areal_eval.data.preference_data import DataError
    from areal_eval.evaluation.evaluators import check_evaluation_data
    from areal_eval.evaluation.job_spec import EvalJobSpec, read_spec

    spec = read_spec(EvalJobSpec, spec_file)
    try:
        check_evaluation_data(spec.evaluator, Path(spec.data), spec, tokenizer_dir=Path(spec.checkpoint))
    except (DataError, ConfigError) as exc:
        return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return None


def main(argv: list[str]) -> int:
    refused = refusal(Path(argv[0]))
    if refused:
        print(refused, file=sys.stderr)
        return REFUSED_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Which failures a retry can fix.

A failed evaluation is *permanent* when the same inputs fail the same way every time: a corrupt
or missing checkpoint, validation data that is missing or malformed, a config that cannot run.
Those are recorded ``failed`` at once and never retried, on any path. Everything else is
*transient*: a killed or hung rank, a collective timeout, an orchestrator (the Prefect API, a
concurrency slot) that cannot be reached for a while. Those are retried with backoff, in the task
(``eval.retries``) and then across flow runs (``eval.max_attempts``), and recorded as attempts.
A full disk is neither: nothing is recorded and the run stops (the in-flow loop) or the flow run
fails (``evaluate-checkpoint``), the checkpoint still scheduled for when space is freed.
"""

from __future__ import annotations

from areal_eval.checkpoints.manifest import CheckpointError
from areal_eval.config.parsing import ConfigError
from areal_eval.data.preference_data import DataError
from areal_eval.disk import is_disk_full
from areal_eval.evaluation.jobs import CorruptCheckpoint, EvaluationConfigError, EvaluationDataError, EvaluationFailed

PERMANENT = (CorruptCheckpoint, EvaluationDataError, EvaluationConfigError, CheckpointError, DataError, ConfigError)


class OrchestrationUnavailable(RuntimeError):
    """The orchestrator (the Prefect API, a concurrency slot on it) stayed out of reach: transient."""


def is_permanent(exc: BaseException) -> bool:
    return isinstance(exc, PERMANENT)


def is_known_failure(exc: BaseException) -> bool:
    """A failure whose cause its message names (bad input, an evaluation that failed, a full disk,
    the orchestrator away): said in one line, with no traceback. Anything else is a bug."""
    return is_permanent(exc) or is_disk_full(exc) or isinstance(exc, (EvaluationFailed, OrchestrationUnavailable))


def one_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (what follows, a log's summary, stays on record)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def is_bad_checkpoint(exc: BaseException) -> bool:
    """The checkpoint itself is at fault (missing, corrupt, unreadable): an older one may be good."""
    return isinstance(exc, (CorruptCheckpoint, CheckpointError))


def retry_backoff_s(attempts: int, base_s: float = 60.0, cap_s: float = 3600.0) -> float:
    """How long after its last failed attempt a checkpoint is tried again (doubling per attempt)."""
    return min(cap_s, base_s * 2 ** max(0, attempts - 1))

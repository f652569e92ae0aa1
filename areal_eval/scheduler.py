"""Which checkpoints to evaluate: a pure decision, ``decide(event, history) -> Decision``.

History is the evaluations so far (step, time, metric, stderr; metric None while pending), so
the scheduler keeps no state of its own: a restarted flow rebuilds it from the ledger.

The adaptive policy spends evaluations where they change what the dashboard shows, and where
the best checkpoint may be. From the
last two finished evaluations it estimates how fast the metric moves, after subtracting their
noise, and evaluates once the drift predicted since the last evaluation reaches
``drift_tolerance`` standard errors; while the latest result is also the best and still rising,
a smaller predicted gain (``best_drift_tolerance``) is enough, so the peak before a plateau or a
drop is not skipped. So it evaluates densely while the metric moves, rarely on a
plateau, densely again after a regression, always within ``[min_interval_steps,
max_interval_steps]``, and always the first and the final checkpoint. It reasons in steps, not
checkpoint counts, so uneven checkpoint spacing does not change it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Protocol, Sequence


@dataclasses.dataclass(frozen=True)
class HistoryEntry:
    step: int
    time: float
    metric: float | None
    """None while the evaluation is queued or running."""
    stderr: float | None = None


@dataclasses.dataclass(frozen=True)
class Decision:
    evaluate: bool
    reason: str
    pinned: bool = False
    """Never coalesced away when evaluation falls behind (the first and the final checkpoint)."""


class StepEvent(Protocol):
    global_step: int
    final: bool


@dataclasses.dataclass
class SchedulerConfig:
    policy: Literal["adaptive", "fixed"] = "adaptive"
    """``adaptive``: follow the metric; ``fixed``: every ``fixed_interval_steps``."""
    metric: str = "accuracy"
    """Monitored evaluation metric."""
    stderr_metric: str | None = "accuracy_stderr"
    """Metric holding the monitored metric's standard error (None: use ``default_stderr``)."""
    higher_is_better: bool = True
    """Direction of the monitored metric (for regressions)."""
    fixed_interval_steps: int = 100
    """Interval of the fixed policy, in training steps."""
    min_interval_steps: int = 0
    """Never evaluate two checkpoints closer than this (the final one excepted)."""
    max_interval_steps: int | None = None
    """Adaptive: always evaluate once this many steps passed since the last evaluation."""
    max_interval_fraction: float | None = 0.3
    """Adaptive: also evaluate once the gap reaches this fraction of the checkpoint's step: a scale-free
    bound (log-spaced: dense early, sparser later) that bounds how late a regression is seen."""
    drift_tolerance: float = 2.0
    """Evaluate when the predicted drift since the last evaluation reaches this many stderr."""
    noise_discount: float = 1.0
    """Standard errors subtracted from an observed change before it counts as movement."""
    best_drift_tolerance: float | None = 0.5
    """While the latest result is the best so far and still rising, evaluate once the predicted
    gain reaches this many stderr (no noise discount): the best checkpoint is most often the last
    one before a plateau or a drop, and a skipped one cannot be picked. None: off."""
    regression_z: float = 3.0
    """A result this many (combined) stderr below the best is a regression."""
    default_stderr: float = 0.01
    """Noise assumed when an evaluation reports none."""
    queue_capacity: int = 2
    """Evaluations waiting for a worker; beyond that the queue coalesces to the newest."""
    coalesce: bool = True
    """When evaluation falls behind, evaluate the newest waiting checkpoint and record the older
    ones as superseded. False evaluates every scheduled checkpoint in order (offline sweeps)."""

    def __post_init__(self):
        if self.max_interval_steps is not None and self.max_interval_steps < self.min_interval_steps:
            raise ValueError("max_interval_steps must be >= min_interval_steps")
        if self.max_interval_fraction is not None and self.max_interval_fraction <= 0:
            raise ValueError("max_interval_fraction must be positive")
        if self.fixed_interval_steps < 1:
            raise ValueError("fixed_interval_steps must be >= 1")
        if self.queue_capacity < 1:
            raise ValueError("queue_capacity must be >= 1")


def decide(event: StepEvent, history: Sequence[HistoryEntry], cfg: SchedulerConfig) -> Decision:
    step = event.global_step
    if any(h.step == step for h in history):
        return Decision(False, f"step {step} already evaluated or queued")
    if not history:
        return Decision(True, "first checkpoint", pinned=True)
    if event.final:
        return Decision(True, "final checkpoint", pinned=True)
    last = max(history, key=lambda h: h.step)
    gap = step - last.step
    if gap < 0:
        return Decision(False, f"older than step {last.step}, which is already evaluated or queued")
    if gap < cfg.min_interval_steps:
        return Decision(False, f"{gap} steps since step {last.step} < min interval {cfg.min_interval_steps}")
    if cfg.policy == "fixed":
        if gap >= cfg.fixed_interval_steps:
            return Decision(True, f"fixed interval: {gap} >= {cfg.fixed_interval_steps} steps")
        return Decision(False, f"fixed interval: {gap} < {cfg.fixed_interval_steps} steps")
    limit = max_interval(step, cfg)
    if limit is not None and gap >= limit:
        return Decision(True, f"{gap} steps since step {last.step} >= max interval {limit:.0f}")
    return _adaptive(step, last, history, cfg)


def max_interval(step: int, cfg: SchedulerConfig) -> float | None:
    """The largest gap allowed before ``step``: the tighter of the absolute and relative bounds."""
    bounds = [b for b in (cfg.max_interval_steps,) if b is not None]
    if cfg.max_interval_fraction is not None:
        bounds.append(max(cfg.min_interval_steps, cfg.max_interval_fraction * step))
    return min(bounds) if bounds else None


def _stderr(h: HistoryEntry, cfg: SchedulerConfig) -> float:
    return h.stderr if h.stderr and h.stderr > 0 else cfg.default_stderr


def _adaptive(step: int, last: HistoryEntry, history: Sequence[HistoryEntry], cfg: SchedulerConfig) -> Decision:
    done = sorted((h for h in history if h.metric is not None and math.isfinite(h.metric)), key=lambda h: h.step)
    if len(done) < 2:
        return Decision(True, "too few results to estimate the trend")
    sign = 1.0 if cfg.higher_is_better else -1.0
    latest, prev = done[-1], done[-2]
    best = max(done, key=lambda h: sign * h.metric)
    se_latest = _stderr(latest, cfg)
    drop = sign * (best.metric - latest.metric)
    noise_best = math.hypot(se_latest, _stderr(best, cfg))
    prev_drop = sign * (best.metric - prev.metric)
    newly_regressed = prev_drop <= cfg.regression_z * math.hypot(_stderr(prev, cfg), _stderr(best, cfg))
    # A fresh regression is confirmed at once; after that the drop itself reads as movement.
    if best is not latest and drop > cfg.regression_z * noise_best and newly_regressed:
        return Decision(True, f"regression: {drop:.4g} below best at step {best.step} (> {cfg.regression_z} stderr)")
    change = abs(latest.metric - prev.metric)
    noise = math.hypot(se_latest, _stderr(prev, cfg))
    rate = max(0.0, change - cfg.noise_discount * noise) / max(1, latest.step - prev.step)
    drift = rate * (step - last.step)
    if drift >= cfg.drift_tolerance * se_latest:
        return Decision(True, f"moving: predicted drift {drift:.3g} >= {cfg.drift_tolerance} stderr ({se_latest:.3g})")
    if cfg.best_drift_tolerance is not None and latest is best:
        gain = max(0.0, sign * (latest.metric - prev.metric)) / max(1, latest.step - prev.step) * (step - last.step)
        if gain >= cfg.best_drift_tolerance * se_latest:
            return Decision(True, f"rising at the best: predicted gain {gain:.3g} >= {cfg.best_drift_tolerance} stderr ({se_latest:.3g})")
    return Decision(False, f"plateau: predicted drift {drift:.3g} < {cfg.drift_tolerance} stderr ({se_latest:.3g})")

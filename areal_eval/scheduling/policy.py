"""Which checkpoints to evaluate: pure decisions, ``decide(event, history) -> Decision``, after a
suspicious result ``look_back(history, step, skipped) -> steps`` and, once the run is over,
``refine(history, skipped) -> steps``.

History is the evaluations so far (step, time, metric, stderr; metric None while pending), so
the scheduler keeps no state of its own: a restarted flow rebuilds it from the ledger.

The adaptive policy spends evaluations where they change what the dashboard shows, where a
regression would hide, and where the best checkpoint may be:

* movement: from the last two finished evaluations it estimates how fast the metric moves,
  after subtracting the noise of their difference (paired on their items, where both kept
  them: see ``paired``), and evaluates once the drift predicted since the last
  evaluation reaches ``drift_tolerance`` standard errors, so it is dense while the metric
  moves, sparse on a plateau, and dense again after a regression;
* growth: early in a run, where learning curves move per doubling of steps, it evaluates once
  training has grown by ``max_interval_growth`` since the last evaluation;
* cover: it never lets more than ``max_interval_checkpoints`` checkpoints in a row go
  unevaluated, since a regression on a plateau shows no movement beforehand and is seen only by
  looking; counting checkpoints (not step gaps against a typical gap) keeps the bound blind to
  the schedule's shape, so a geometric, bursty or resumed schedule forces nothing by itself;
* look-back: when a result falls ``regression_z`` below the best, the checkpoints skipped just
  before it are evaluated too, so that a drop is confirmed by two results in a row at once;
* refinement: after the final checkpoint, the skipped neighbours of the best result whose
  interpolated value comes close to it are evaluated, because the best checkpoint is most often
  a peak that the sparse evaluations stepped over.

Movement is reasoned in steps (drift per step), so uneven checkpoint spacing does not change it,
and it always evaluates the first and the final checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Sequence
from typing import ClassVar, Literal, Protocol

from areal_eval.config.parsing import (
    AT_LEAST_1,
    NON_NEGATIVE,
    OPEN_UNIT,
    POSITIVE,
    Bounds,
    FieldError,
    Ranges,
    check_ranges,
)


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
    probe: bool = False
    """Evaluate on the probe subset only (``probe_fraction``), where the scheduler skipped."""


class StepEvent(Protocol):
    global_step: int
    final: bool


COVER_WINDOW = 1024
"""The most checkpoints the cover bound counts (and ``DecisionHistory`` hands it)."""


@dataclasses.dataclass
class SchedulerConfig:
    policy: Literal["adaptive", "fixed"] = "adaptive"
    """``adaptive``: follow the metric; ``fixed``: every ``fixed_interval_steps``."""
    metric: str = "accuracy"
    """Monitored evaluation metric."""
    stderr_metric: str | None = "{metric}_stderr"
    """Metric holding the monitored metric's standard error; ``{metric}`` stands for ``metric``
    (``generation/accuracy`` -> ``generation/accuracy_stderr``). None: use ``default_stderr``."""
    higher_is_better: bool = True
    """Direction of the monitored metric (for regressions)."""
    fixed_interval_steps: int = 100
    """Interval of the fixed policy, in training steps."""
    min_interval_steps: int = 0
    """Never evaluate two checkpoints closer than this (the final one excepted)."""
    max_interval_steps: int | None = None
    """Adaptive: always evaluate once this many steps passed since the last evaluation."""
    max_interval_checkpoints: int | None = 3
    """Adaptive: evaluate at least every this many checkpoints offered (at most 1024), however they are
    spaced. With 3 a regression is seen at most 2 checkpoints late, 1 on average on a plateau.
    None: bound in steps only."""
    max_interval_growth: float | None = 0.5
    """Adaptive: also evaluate once the steps since the last evaluation reach this fraction of
    its step (0.5: training grew by half since), since early training moves the metric per
    doubling of steps rather than per step. It binds early in a run, whatever the schedule;
    later the other bounds do. None: off."""
    drift_tolerance: float = 4.0
    """Evaluate when the predicted drift since the last evaluation reaches this many stderr."""
    noise_discount: float = 2.0
    """Standard errors subtracted from an observed change before it counts as movement."""
    refine_stderrs: float | None = 2.0
    """Adaptive, after the final checkpoint: evaluate a skipped neighbour of the best result when its
    value interpolated from the evaluations around it is within this many stderr of the best.
    None: no refinement."""
    regression_z: float = 2.0
    """Adaptive: a result this many standard errors of the difference below the best is a
    suspected regression, and the next checkpoint is evaluated, so that an alert rule confirming
    at that many (the default regression rule does, at 2) can confirm it there."""
    look_back: int = 2
    """Adaptive: when a result is a fresh suspected regression (``regression_z``), also evaluate
    up to this many of the checkpoints skipped since the result before it, newest first, so that
    a drop that began there is confirmed by two results in a row at once rather than at the next
    evaluated checkpoint. 0: off."""
    train_metric: str | None = None
    """Adaptive: a metric training publishes with each checkpoint (``loss``). Where the scheduler
    would skip a checkpoint but this metric jumped there (``train_jump``), it is evaluated:
    training changed (a collapse, a new phase). None: off."""
    train_jump: float = 4.0
    """A jump: the change from the checkpoint before is more than this many times the metric's
    typical checkpoint-to-checkpoint change (the root mean square of the 7 changes before)."""
    default_stderr: float = 0.01
    """Noise assumed when an evaluation reports none."""
    queue_capacity: int = 2
    """Evaluations waiting for a worker; beyond that the queue coalesces to the newest."""
    coalesce: bool = True
    """When evaluation falls behind, evaluate the newest waiting checkpoint and record the older
    ones as superseded. False evaluates every scheduled checkpoint in order (offline sweeps)."""
    probe_fraction: float | None = None
    """Tiered evaluation: a checkpoint the scheduler skips is probed, evaluated on this fixed random
    share of the validation set (costing that share), and evaluated in full if the probe moved.
    Probes are logged as ``eval_probe/*``, never as results. None: no probes. Replay measured that
    they buy earlier detection for more compute at equal tracking (README, "Scheduling")."""
    probe_escalate_stderrs: float = 2.0
    """A probe escalates to a full evaluation when it differs from the newest full evaluation's
    result on the same subset by more than this many standard errors of the difference."""

    @property
    def stderr_name(self) -> str | None:
        """The name of the monitored metric's standard error (None: none is reported)."""
        return self.stderr_metric.format(metric=self.metric) if self.stderr_metric else None

    RANGES: ClassVar[Ranges] = {
        "fixed_interval_steps": AT_LEAST_1,
        "min_interval_steps": NON_NEGATIVE,
        "max_interval_steps": AT_LEAST_1,
        "max_interval_checkpoints": Bounds(1, COVER_WINDOW),
        "max_interval_growth": POSITIVE,
        "drift_tolerance": NON_NEGATIVE,
        "noise_discount": NON_NEGATIVE,
        "refine_stderrs": NON_NEGATIVE,
        "regression_z": POSITIVE,
        "look_back": NON_NEGATIVE,
        "default_stderr": POSITIVE,
        "queue_capacity": AT_LEAST_1,
        "probe_escalate_stderrs": NON_NEGATIVE,
        "probe_fraction": OPEN_UNIT,
        "train_jump": POSITIVE,
    }

    def __post_init__(self):
        check_ranges(self, self.RANGES)
        if self.max_interval_steps is not None and self.max_interval_steps < self.min_interval_steps:
            raise FieldError("max_interval_steps", f"must be >= min_interval_steps ({self.min_interval_steps})")


TrainValues = Sequence[tuple[int, float]]
"""``(step, value)`` of ``train_metric`` at each checkpoint offered so far, in step order."""

PairedStderr = Callable[[int, int], "float | None"]
"""(step_a, step_b) -> the paired standard error of the difference of the metric between two
evaluated steps, on the items both scored (None: either kept none)."""


def decide(
    event: StepEvent,
    history: Sequence[HistoryEntry],
    cfg: SchedulerConfig,
    offered_steps: Sequence[int] = (),
    *,
    paired: PairedStderr | None = None,
    train: TrainValues = (),
) -> Decision:
    """Evaluate this checkpoint? ``offered_steps``: every checkpoint offered before it, evaluated or
    not (the cover bound counts those after the newest entry in ``history``); ``paired``: where
    two results kept their items, the error of their difference paired on them, which the
    movement and regression tests then use instead of the two errors combined; ``train``: the
    training metric at each checkpoint offered so far (``train_metric``)."""
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
    if cfg.max_interval_steps is not None and gap >= cfg.max_interval_steps:
        return Decision(True, f"{gap} steps since step {last.step} >= max interval {cfg.max_interval_steps}")
    if cfg.max_interval_growth is not None and gap >= cfg.max_interval_growth * max(1, last.step):
        return Decision(True, f"{gap} steps since step {last.step} >= max_interval_growth {cfg.max_interval_growth:g}x")
    since = checkpoints_since(last.step, step, offered_steps)
    if cfg.max_interval_checkpoints is not None and since >= cfg.max_interval_checkpoints:
        return Decision(True, f"checkpoint {since} since step {last.step} (max_interval_checkpoints)")
    decision = _adaptive(step, last, history, cfg, paired)
    if not decision.evaluate and cfg.train_metric and (moved := train_moved(train, step, cfg)):
        return Decision(True, f"training moved: {moved}")
    return decision


def train_moved(train: TrainValues, step: int, cfg: SchedulerConfig) -> str | None:
    """How ``train_metric`` jumped at this checkpoint, where its change from the checkpoint before
    is more than ``train_jump`` times its typical change (the root mean square of the 7 changes
    before): a collapse, or a new phase of training."""
    values = [(s, v) for s, v in train if s <= step and math.isfinite(v)][-9:]
    if len(values) < 4 or values[-1][0] != step:
        return None
    *before, now = (v for _, v in values)
    typical = math.sqrt(sum((b - a) ** 2 for a, b in zip(before, before[1:], strict=False)) / (len(before) - 1))
    jump = abs(now - before[-1])
    if typical <= 0 or jump <= cfg.train_jump * typical:
        return None
    return f"{cfg.train_metric} {before[-1]:.4g} -> {now:.4g} ({jump / typical:.1f}x its typical change)"


def checkpoints_since(last_step: int, step: int, offered_steps: Sequence[int]) -> int:
    """Checkpoints offered after ``last_step`` up to ``step``, this one included."""
    return 1 + sum(1 for s in set(offered_steps) if last_step < s < step)


def _stderr(h: HistoryEntry, cfg: SchedulerConfig) -> float:
    return h.stderr if h.stderr and h.stderr > 0 else cfg.default_stderr


def _difference_noise(a: HistoryEntry, b: HistoryEntry, cfg: SchedulerConfig, paired: PairedStderr | None) -> float:
    """The standard error of ``a - b``: paired on their items where both kept them, else their
    two errors combined as if independent."""
    se = paired(a.step, b.step) if paired is not None else None
    return se if se is not None and se > 0 else math.hypot(_stderr(a, cfg), _stderr(b, cfg))


def _finished(history: Sequence[HistoryEntry]) -> list[HistoryEntry]:
    return sorted((h for h in history if h.metric is not None and math.isfinite(h.metric)), key=lambda h: h.step)


def _adaptive(
    step: int, last: HistoryEntry, history: Sequence[HistoryEntry], cfg: SchedulerConfig, paired: PairedStderr | None
) -> Decision:
    done = _finished(history)
    if len(done) < 2:
        return Decision(True, "too few results to estimate the trend")
    latest, prev = done[-1], done[-2]
    se_latest = _stderr(latest, cfg)
    # A fresh regression is confirmed at once; after that the drop itself reads as movement.
    if suspected := _fresh_regression(done, cfg, paired):
        return Decision(True, f"regression: {suspected}")
    change = abs(latest.metric - prev.metric)
    noise = _difference_noise(latest, prev, cfg, paired)
    rate = max(0.0, change - cfg.noise_discount * noise) / max(1, latest.step - prev.step)
    drift = rate * (step - last.step)
    if drift >= cfg.drift_tolerance * se_latest:
        return Decision(True, f"moving: predicted drift {drift:.3g} >= {cfg.drift_tolerance} stderr ({se_latest:.3g})")
    return Decision(False, f"plateau: predicted drift {drift:.3g} < {cfg.drift_tolerance} stderr ({se_latest:.3g})")


def _fresh_regression(done: list[HistoryEntry], cfg: SchedulerConfig, paired: PairedStderr | None) -> str | None:
    """Is the newest of the finished results ``done`` (in step order) ``regression_z`` errors of
    the difference below the best, where the one before it was not? How far, if so."""
    if len(done) < 2:
        return None
    sign = 1.0 if cfg.higher_is_better else -1.0
    best = max(done, key=lambda h: sign * h.metric)

    def below(h: HistoryEntry) -> float:
        return sign * (best.metric - h.metric)

    def regressed(h: HistoryEntry) -> bool:
        return h is not best and below(h) > cfg.regression_z * _difference_noise(h, best, cfg, paired)

    if regressed(done[-1]) and not regressed(done[-2]):
        return f"{below(done[-1]):.4g} below best at step {best.step} (> {cfg.regression_z} stderr)"
    return None


def look_back(
    history: Sequence[HistoryEntry],
    step: int,
    skipped_steps: Collection[int],
    cfg: SchedulerConfig,
    *,
    paired: PairedStderr | None = None,
    deleted_steps: Collection[int] = (),
) -> list[tuple[int, str]]:
    """The result of ``step`` is in: the skipped checkpoints to evaluate now, newest first, with
    their reason.

    Where that result is the newest and a fresh suspected regression (``regression_z``), the
    checkpoints skipped since the result before it, the ``look_back`` newest of them, are
    evaluated at once: a drop that began there shows in two results in a row now (two chances
    where two were skipped), where an alert rule confirming on two (the default does) would
    otherwise wait for the next checkpoint. A result that is not the newest (a look-back, a
    refinement) looks back at nothing.
    """
    if cfg.policy != "adaptive" or not cfg.look_back:
        return []
    done = _finished(history)
    if not done or done[-1].step != step or not (suspected := _fresh_regression(done, cfg, paired)):
        return []
    before = sorted((s for s in skipped_steps if done[-2].step < s < step and s not in deleted_steps), reverse=True)
    return [(s, f"look back: step {step} is {suspected}") for s in before[: cfg.look_back]]


def refine(
    history: Sequence[HistoryEntry],
    skipped_steps: Sequence[int],
    cfg: SchedulerConfig,
    deleted_steps: Collection[int] = (),
) -> list[tuple[int, str]]:
    """After the final checkpoint: the skipped checkpoints worth evaluating, with their reasons.

    These are the skipped neighbours of the best result whose value, interpolated in steps between
    the finished evaluations on either side (or the best's own value where one side has none),
    comes within ``refine_stderrs`` of the best. A neighbour retention deleted stays a neighbour
    (the one beyond it is not next to the best) but is not returned.
    """
    done = _finished(history)
    if cfg.policy != "adaptive" or cfg.refine_stderrs is None or not done:
        return []
    sign = 1.0 if cfg.higher_is_better else -1.0
    best = max(done, key=lambda h: sign * h.metric)
    known = sorted({h.step for h in history} | set(skipped_steps))
    at = known.index(best.step)
    out = []
    for step in known[at - 1 : at] + known[at + 1 : at + 2]:
        if step not in skipped_steps or step in deleted_steps:
            continue
        below = [h for h in done if h.step < step]
        above = [h for h in done if h.step > step]
        guess = best.metric
        if below and above:
            lo, hi = below[-1], above[0]
            guess = lo.metric + (hi.metric - lo.metric) * (step - lo.step) / (hi.step - lo.step)
        margin = sign * (guess - best.metric) + cfg.refine_stderrs * _stderr(best, cfg)
        if margin >= 0:
            out.append(
                (
                    step,
                    f"refine: next to the best (step {best.step}), interpolated {guess:.4g} "
                    f"within {cfg.refine_stderrs} stderr of {best.metric:.4g}",
                )
            )
    return out

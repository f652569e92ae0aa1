"""Feedback rules: what the evaluation results ask of training, decided the same on every path.

Pure logic, as the alert rules: :class:`FeedbackJudge` reads the evaluated results in step order
(whatever order they arrived in) and returns the directives they call for, each with its
evidence; :mod:`areal_eval.runs.directives` keeps them and carries them to the trainer. The
same results give the same directives, with the same ids, on every path.

- ``stop`` on a target: the metric lies past ``target`` by ``target_stderrs`` of its standard error.
- on a plateau: ``patience`` evaluations in a row, after the best, none of them better than the
  best by more than ``min_delta``, and the newest not above the result ``patience`` evaluations
  before it by more than ``min_delta`` on a paired test (``improve_stderrs``) where both kept
  their items; not where the newest lies below the best level by ``regression_stderrs`` (a drop
  is the regression rule's). A plateau scales the learning rate (``lr_scale``, ``factor``) up to
  ``max_lr_scales`` times, ``cooldown`` evaluations apart; a plateau after that stops training
  (an acting ``stop`` beside a shadow or off ``lr_scale`` stops at the first plateau).

- ``rollback`` on a confirmed regression: the two newest results in a row below the best level
  the run held (the best mean of ``level_results`` results in a row before them), each by more
  than ``min_delta`` plus ``regression_stderrs`` (paired) standard errors. The best single result
  of many sits above the true level by its noise, more so the more results there are: a level
  held over several does not. Training goes back to the best checkpoint's weights, optimizer,
  schedule and data position, its learning rate times ``factor``; up to ``max_rollbacks`` times,
  ``cooldown`` evaluations apart.

Each action is ``off``, ``shadow`` (recorded with what it would have done, never applied; the
default) or ``act``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Literal

from areal_eval.config.parsing import AT_LEAST_1, NON_NEGATIVE, POSITIVE, FieldError, Ranges, check_ranges
from areal_eval.paired import ItemScores, NoCommonItems, mean_scores, paired_difference

Mode = Literal["off", "shadow", "act"]


@dataclasses.dataclass
class FeedbackConfig:
    stop: Mode = "shadow"
    """A stop on a target reached, or on a plateau once the learning rate was scaled
    ``max_lr_scales`` times (at the first plateau where ``lr_scale`` does not act): ``off``,
    ``shadow`` (only recorded) or ``act`` (training stops)."""
    lr_scale: Mode = "shadow"
    """A lower learning rate on a plateau: ``off``, ``shadow`` or ``act``."""
    rollback: Mode = "shadow"
    """Back to the best checkpoint on a confirmed regression, the learning rate times ``factor``:
    ``off``, ``shadow`` or ``act``."""
    regression_stderrs: float = 2.0
    """A regression: each of the two newest results lies below the best level by more than
    ``min_delta`` plus this many (paired) standard errors."""
    level_results: int = 2
    """The best level a regression is measured from: the best mean of this many results in a row
    before the two newest (paired on their items' means). The best single result (1) is the high
    point of the noise too, and the more often a run is evaluated, the higher: two results in a
    row below it are then often noise. A level held as long as the drop confirming it is not."""
    max_rollbacks: int = 1
    """Rollbacks in one run; a regression after that is only recorded."""
    metric: str | None = None
    """The metric the rules watch. None: the scheduler's (``scheduler.metric``)."""
    higher_is_better: bool | None = None
    """Its direction. None: the scheduler's."""
    target: float | None = None
    """Stop once the metric lies past this value (None: no target)."""
    target_stderrs: float = 2.0
    """How many of the result's standard errors past ``target`` confirm it."""
    patience: int | None = 3
    """A plateau: this many evaluations in a row after the best without a better one. None: no
    plateau rule."""
    min_delta: float = 0.0
    """What counts as better: more than this above the best (in the metric's direction)."""
    improve_stderrs: float = 1.0
    """A plateau also needs the newest result not above the one ``patience`` evaluations before
    it by ``min_delta`` plus this many paired standard errors (where both kept their items; else
    their two errors combined): a curve still climbing through noise is not a plateau."""
    factor: float = 0.5
    """What ``lr_scale`` multiplies the learning rate by."""
    max_lr_scales: int = 2
    """Plateaus answered by a lower learning rate; the next one stops training."""
    cooldown: int = 2
    """Evaluations after an action before a plateau or a regression is counted again."""
    min_step: int = 0
    """Results before this step (an untrained baseline) are not looked at."""

    RANGES: ClassVar[Ranges] = {
        "target_stderrs": NON_NEGATIVE,
        "patience": AT_LEAST_1,
        "min_delta": NON_NEGATIVE,
        "improve_stderrs": NON_NEGATIVE,
        "factor": POSITIVE,
        "max_lr_scales": NON_NEGATIVE,
        "regression_stderrs": NON_NEGATIVE,
        "level_results": AT_LEAST_1,
        "max_rollbacks": NON_NEGATIVE,
        "cooldown": NON_NEGATIVE,
        "min_step": NON_NEGATIVE,
    }

    def __post_init__(self):
        check_ranges(self, self.RANGES)
        if self.factor >= 1:
            raise FieldError("factor", f"lowers the learning rate: below 1, got {self.factor}")
        for name in ("stop", "lr_scale", "rollback"):
            if getattr(self, name) not in ("off", "shadow", "act"):
                raise FieldError(name, f"off, shadow or act, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class Directive:
    """What evaluation asks of training, and why."""

    id: str
    """``<action>@<step>``: the same on every path for the same results, issued once."""
    action: str
    """``stop``, ``lr_scale`` (``args["factor"]``) or ``rollback`` (``args["to_step"]``)."""
    steps: tuple[int, ...]
    """The evaluated steps it rests on, the newest last."""
    reason: str
    """Why, in one line."""
    evidence: dict = dataclasses.field(default_factory=dict)
    """The rule, the metric, the (paired) difference and its standard error, the items."""
    mode: str = "act"
    """``act``: the trainer applies it; ``shadow``: only recorded, for what it would have done."""
    args: dict = dataclasses.field(default_factory=dict)
    made_at: float = 0.0

    def line(self) -> str:
        """How logs say it: ``lr_scale@40 (shadow): <reason>``."""
        return f"{self.id} ({self.mode}): {self.reason}"

    @classmethod
    def from_json(cls, data: dict) -> Directive:
        return cls(**{**data, "steps": tuple(data.get("steps", ()))})


class FeedbackJudge:
    """The directives a run's results call for (:class:`FeedbackConfig`)."""

    def __init__(
        self, cfg: FeedbackConfig, *, metric: str, higher_is_better: bool = True, items: ItemScores | None = None
    ):
        self.cfg = cfg
        self.metric = cfg.metric or metric
        self.sign = 1.0 if (higher_is_better if cfg.higher_is_better is None else cfg.higher_is_better) else -1.0
        self._items = items
        self._scores: dict[int, tuple[dict, dict | None] | None] = {}
        """Each step's items, read once (a judgement reads the same steps again and again)."""

    @property
    def active(self) -> bool:
        return any(mode != "off" for mode in (self.cfg.stop, self.cfg.lr_scale, self.cfg.rollback))

    @property
    def acting(self) -> bool:
        return "act" in (self.cfg.stop, self.cfg.lr_scale, self.cfg.rollback)

    def directives(self, results: list[tuple[int, dict]]) -> list[Directive]:
        """Every directive the results call for, in step order: ``results`` are ``(step,
        metrics)`` of the evaluated checkpoints, in any order. Nothing follows a stop."""
        cfg, out = self.cfg, []
        series = sorted((s, m) for s, m in results if s >= cfg.min_step and _finite(m.get(self.metric)))
        levels = self._levels(series)
        best_i, since_action, scales, rollbacks = None, None, 0, 0
        for i, (step, metrics) in enumerate(series):
            value = metrics[self.metric]
            if best_i is None or self.sign * (value - series[best_i][1][self.metric]) > cfg.min_delta:
                best_i = i
            if since_action is not None:
                since_action += 1
            if cfg.target is not None and cfg.stop != "off" and (hit := self._target(step, metrics)):
                out.append(hit)
                break
            if since_action is not None and since_action <= cfg.cooldown:
                continue
            if cfg.rollback != "off" and rollbacks < cfg.max_rollbacks and i - best_i >= 2:
                if back := self._regression(series, best_i, i, levels[i - 1]):
                    out.append(back)
                    rollbacks, since_action = rollbacks + 1, 0
                    continue
            if cfg.patience is None or i - best_i < cfg.patience:
                continue
            plateau = self._plateau(series, i, levels[max(1, i - 1)])
            if plateau is None:
                continue
            # A stop that acts beside a shadow ``lr_scale`` waits for no cut that is never made.
            cuts = cfg.lr_scale == "act" or (cfg.lr_scale == "shadow" and cfg.stop != "act")
            if scales < cfg.max_lr_scales and cuts:
                scales += 1
                out.append(self._directive("lr_scale", series, i, plateau, {"factor": cfg.factor}, cfg.lr_scale))
                since_action = 0
            elif cfg.stop != "off":
                out.append(self._directive("stop", series, i, plateau, {}, cfg.stop))
                break
        return out

    def watching(self, results: list[tuple[int, dict]]) -> str | None:
        """Why the next checkpoint is worth evaluating though the scheduler would skip it: a rule
        in ``act`` mode is counting evaluations since the best (a plateau or a regression under
        way) and may still act, past its cooldown. Patience counts evaluations, and the scheduler
        evaluates flat stretches sparsely: this keeps the count moving with training. Shadow mode
        changes nothing, the schedule included."""
        cfg = self.cfg
        if not self.acting:
            return None
        series = sorted((s, m) for s, m in results if s >= cfg.min_step and _finite(m.get(self.metric)))
        made = self.directives(results)
        if not series or any(d.action == "stop" for d in made):
            return None  # nothing follows a stop
        counts = {a: sum(d.action == a for d in made) for a in ("lr_scale", "rollback")}
        plateau = cfg.stop == "act" or (cfg.lr_scale == "act" and counts["lr_scale"] < cfg.max_lr_scales)
        may_act = (cfg.patience is not None and plateau) or (
            cfg.rollback == "act" and counts["rollback"] < cfg.max_rollbacks
        )
        acted = [d.steps[-1] for d in made if d.mode == "act"]
        if acted and sum(step > max(acted) for step, _ in series) <= cfg.cooldown:
            return None
        best = 0
        for i, (_, metrics) in enumerate(series):
            if self.sign * (metrics[self.metric] - series[best][1][self.metric]) > cfg.min_delta:
                best = i
        since = len(series) - 1 - best
        if not may_act or since < 1:
            return None
        return f"feedback: {since} evaluation(s) since the best (step {series[best][0]}) without a better one"

    def _target(self, step: int, metrics: dict) -> Directive | None:
        value, stderr = metrics[self.metric], metrics.get(f"{self.metric}_stderr")
        past = self.sign * (value - self.cfg.target)
        margin = self.cfg.target_stderrs * (stderr if _finite(stderr) else 0.0)
        if past <= margin:
            return None
        said = f"{self.metric} {value:.4g} is past the target {self.cfg.target:g}"
        if _finite(stderr) and stderr > 0:
            said += f" by {past / stderr:.1f} standard errors"
        evidence = {"rule": "target", "metric": self.metric, "value": value, "stderr": stderr}
        evidence["target"] = self.cfg.target
        return Directive(f"stop@{step}", "stop", (step,), said, evidence, self.cfg.stop)

    def _regression(
        self, series: list[tuple[int, dict]], best_i: int, i: int, level: list[tuple[int, dict]]
    ) -> Directive | None:
        """A rollback to ``series[best_i]`` where the two newest results lie confirmed below
        ``level``, the best level before them."""
        cfg, drops = self.cfg, []
        for j in (i - 1, i):
            delta, stderr, n = self._difference(level, series[j])
            drop = -self.sign * delta
            if drop - cfg.min_delta <= cfg.regression_stderrs * (stderr or 0.0) or drop <= cfg.min_delta:
                return None
            drops.append({"step": series[j][0], "delta": delta, "stderr": stderr, "n_items": n})
        step, to_step = series[i][0], series[best_i][0]
        worst, held = drops[-1], [s for s, _ in level]
        where = f"step {held[0]}" if len(held) == 1 else f"steps {held[0]}-{held[-1]}"
        said = f"{self.metric} below its best level ({where}) in 2 evaluations in a row ({worst['delta']:+.4g}"
        said += f", stderr {worst['stderr']:.2g})" if worst["stderr"] is not None else ")"
        said += f": back to the best, step {to_step}, learning rate x{cfg.factor:g}"
        evidence = {"rule": "regression", "metric": self.metric, "best_step": to_step, "drops": drops}
        evidence |= {"level_steps": held, "regression_stderrs": cfg.regression_stderrs, "min_delta": cfg.min_delta}
        args = {"to_step": to_step, "factor": cfg.factor}
        steps = (to_step, series[i - 1][0], step)
        return Directive(f"rollback@{step}", "rollback", steps, said, evidence, cfg.rollback, args)

    def _plateau(self, series: list[tuple[int, dict]], i: int, level: list[tuple[int, dict]]) -> dict | None:
        """The evidence that the curve is flat at ``series[i]``, or None where it still climbs, or
        where ``series[i]`` lies confirmed below ``level``, the regression rule's (a drop, for
        that rule: a stop there would end training on a damaged model)."""
        drop, drop_stderr, _ = self._difference(level, series[i])
        drop = -self.sign * drop
        if drop_stderr is not None and drop - self.cfg.min_delta > self.cfg.regression_stderrs * drop_stderr:
            return None
        start, now = series[i - self.cfg.patience], series[i]
        delta, stderr, n = self._difference([start], now)
        rise = self.sign * delta
        if stderr is not None and rise - self.cfg.min_delta > self.cfg.improve_stderrs * stderr:
            return None  # still improving, through the noise
        if stderr is None and rise > self.cfg.min_delta:
            return None
        return {
            "rule": "plateau",
            "metric": self.metric,
            "since_step": start[0],
            "delta": delta,
            "stderr": stderr,
            "n_items": n,
            "patience": self.cfg.patience,
            "min_delta": self.cfg.min_delta,
        }

    def _levels(self, series: list[tuple[int, dict]]) -> list[list[tuple[int, dict]]]:
        """``levels[m]``, the best level in ``series[:m]`` (m >= 1): the ``level_results`` results
        in a row (or all there are) whose mean is the best, the earliest of equals. One pass: a
        judgement reads every prefix."""
        k, levels, best, top = self.cfg.level_results, [[]], [], -math.inf
        for m in range(1, len(series) + 1):
            if m < k:
                best = series[:m]
            else:
                run = series[m - k : m]
                score = self.sign * math.fsum(metrics[self.metric] for _, metrics in run)
                if m == k or score > top:
                    best, top = run, score
            levels.append(best)
        return levels

    def _difference(self, base: list[tuple[int, dict]], b: tuple[int, dict]) -> tuple[float, float | None, int | None]:
        """``b`` minus the mean of ``base`` (one result or several) in the metric, with its paired
        standard error where all kept their items (else the errors combined, or None without
        them) and the items paired."""
        if self._items is not None:
            scores = [self._item_scores(step) for step, _ in [*base, b]]
            if all(s is not None for s in scores):
                *before, (now, clusters) = scores
                baseline = before[0][0] if len(before) == 1 else mean_scores([s[0] for s in before])
                try:
                    paired = paired_difference(baseline, now, clusters)
                    return paired.difference, paired.guarded_stderr, paired.n
                except NoCommonItems:
                    pass
        level = math.fsum(m[self.metric] for _, m in base) / len(base)
        errors = [m.get(f"{self.metric}_stderr") for _, m in base]
        stderr = None
        if all(_finite(e) for e in errors) and _finite(b[1].get(f"{self.metric}_stderr")):
            stderr = math.hypot(math.hypot(*errors) / len(base), b[1][f"{self.metric}_stderr"])
        return b[1][self.metric] - level, stderr, None

    def _item_scores(self, step: int) -> tuple[dict, dict | None] | None:
        if step not in self._scores:
            if len(self._scores) >= 256:  # a long run: the oldest go first
                self._scores.pop(next(iter(self._scores)))
            self._scores[step] = self._items(step, self.metric)
        return self._scores[step]

    def _directive(
        self, action: str, series: list[tuple[int, dict]], i: int, evidence: dict, args: dict, mode: str
    ) -> Directive:
        step = series[i][0]
        steps = tuple(s for s, _ in series[i - self.cfg.patience : i + 1])
        flat = f"{self.metric} flat for {self.cfg.patience} evaluations since step {evidence['since_step']}"
        change = f" ({evidence['delta']:+.4g}"
        change += f", stderr {evidence['stderr']:.2g})" if evidence["stderr"] is not None else ")"
        todo = f"learning rate x{args['factor']:g}" if action == "lr_scale" else "stop"
        return Directive(f"{action}@{step}", action, steps, f"{flat}{change}: {todo}", evidence, mode, args)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

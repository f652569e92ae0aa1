"""Alert rules evaluated on every evaluation outcome, with throttling.

Pure logic: which rules fire for a result. Sending notifications and stopping training are
the orchestrator's job (the alert task branch), so rules are testable without any service.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
import time
from collections.abc import Callable
from typing import ClassVar, Literal

from areal_eval.config.parsing import AT_LEAST_1, NON_NEGATIVE, FieldError, Ranges, check_ranges
from areal_eval.paired import ItemScores, NoCommonItems, mean_scores, paired_difference


@dataclasses.dataclass
class AlertRule:
    name: str
    """Unique name; throttling is per rule."""
    kind: Literal["threshold", "regression", "nonfinite", "eval_failed"]
    """``threshold``: metric crosses ``value``; ``regression``: metric falls ``tolerance`` below
    the best so far; ``nonfinite``: any metric is NaN/inf; ``eval_failed``: the evaluation failed."""
    metric: str = "accuracy"
    """Metric the rule watches (threshold, regression)."""
    op: Literal["<", ">"] = "<"
    """Fire when ``metric op value`` (threshold)."""
    value: float = 0.0
    """Threshold value."""
    tolerance: float = 0.0
    """Allowed drop below the best before a regression fires."""
    higher_is_better: bool = True
    """Direction of ``metric`` for regressions."""
    min_step: int = 0
    """Ignore checkpoints before this step (e.g. the untrained baseline)."""
    stderrs: float | None = None
    """Noise-aware (threshold, regression): a breach fires when the result lies this many
    standard errors past the line (a regression: past its baseline; where both kept their
    items, paired on their common items, by McNemar's exact test where every score is 0 or 1,
    else in the guarded paired error; without items, their two errors combined; a threshold:
    past ``value``). A result without a standard error counts as past. None: the noise is not
    looked at."""
    baseline_results: int | None = None
    """Regression: compare with the mean of this many most recent results before the step
    (their errors averaged too) instead of the best. The best of several noisy results sits
    above the true level by their noise, so a drop below it is partly luck; a recent mean does
    not, and its error shrinks with every result in it. None: the best so far."""
    consecutive: int | None = None
    """Noise-aware (threshold, regression): a breach also fires when this many evaluations in a
    row, in step order, breach the line, however small each breach. With ``stderrs`` unset and
    this unset, every breach fires."""
    confirm: int | None = None
    """With ``stderrs``: a breach of that many standard errors fires only once this many
    evaluations in a row, in step order (this one among them, whatever order they arrived in),
    each lie as many past the baseline from before the first of them. A single noisy result, or
    a spike that recovers at the next evaluation, does not fire; a lasting drop fires at its
    ``confirm``-th evaluation. None: the first such breach fires."""
    at_once_stderrs: float | None = None
    """With ``confirm``: a breach of this many standard errors fires at once, unconfirmed. A
    drop at the newest checkpoint has no next result to confirm it until the next evaluation,
    which may be long coming; a drop this large is not noise. None: every breach waits."""
    final_stderrs: float | None = None
    """With ``confirm``: at the run's final checkpoint a breach of this many standard errors fires
    unconfirmed, since no result will come to confirm it. Noise puts one result 3.3 errors out
    as rarely as two independent ones in a row 2 out. None: it waits there too."""
    stderr_metric: str = "{metric}_stderr"
    """Where ``metric``'s standard error is (``{metric}`` stands for the metric's name)."""
    stop_training: bool = False
    """Ask training to stop when this rule fires."""
    throttle_secs: float = 300.0
    """After a notification, further firings of this rule are only logged for this long."""

    RANGES: ClassVar[Ranges] = {
        "tolerance": NON_NEGATIVE,
        "min_step": NON_NEGATIVE,
        "throttle_secs": NON_NEGATIVE,
        "stderrs": NON_NEGATIVE,
        "consecutive": AT_LEAST_1,
        "baseline_results": AT_LEAST_1,
        "confirm": AT_LEAST_1,
        "at_once_stderrs": NON_NEGATIVE,
        "final_stderrs": NON_NEGATIVE,
    }

    def __post_init__(self):
        check_ranges(self, self.RANGES)
        if self.baseline_results is not None and self.kind != "regression":
            raise FieldError("baseline_results", f"is for regression rules, not {self.kind}")
        if self.confirm is not None and self.stderrs is None:
            raise FieldError("confirm", "confirms a breach of stderrs: set stderrs too")
        if self.at_once_stderrs is not None and self.confirm is None:
            raise FieldError("at_once_stderrs", "skips the confirmation of confirm: set confirm too")
        if self.final_stderrs is not None and self.confirm is None:
            raise FieldError("final_stderrs", "skips the confirmation of confirm: set confirm too")

    @property
    def noise_aware(self) -> bool:
        return self.stderrs is not None or self.consecutive is not None


NOISE_AWARE_REGRESSION = {
    "stderrs": 2.0,
    "baseline_results": 3,
    "confirm": 2,
    "at_once_stderrs": 5.0,
    "final_stderrs": 3.5,
}
"""The regression rule we measure best on clean and regressed curves, paired and unpaired
(docs/performance.md): 2 standard errors below the mean of the 3 results before, confirmed by
the next result, or 5 at once, or 3.5 at the final checkpoint (noise puts two results in a row
2 out about as rarely as one result 2.9-3.3 out). Replay's ``noise_aware`` rule by default."""


@dataclasses.dataclass
class AlertsConfig:
    rules: list[AlertRule] = dataclasses.field(default_factory=list)
    """The rules; see AlertRule."""
    webhook_url: str | None = None
    """Generic webhook to notify (Prefect CustomWebhookNotificationBlock), for a URL that holds no
    secret: scheme, host and port only (``http://alerts.internal:8080``). One with a path, a
    query or a ``user@`` is refused, since webhooks keep their token there: give such a URL
    through ``webhook_url_env`` or ``webhook_url_secret``. Recorded as scheme and host only."""
    webhook_url_env: str | None = None
    """Name of an environment variable of the flow's process that holds the webhook URL."""
    webhook_url_secret: str | None = None
    """Name of a Prefect ``Secret`` block that holds the webhook URL."""
    notification_block: str | None = None
    """Name of a saved Prefect notification block (Slack, e-mail, ...) to notify as well."""

    PATTERNS: ClassVar[dict] = {"webhook_url": lambda: PLAIN_WEBHOOK_PATTERN}

    def __post_init__(self):
        if self.webhook_url and has_credentials(self.webhook_url):
            raise FieldError(
                "webhook_url",
                "may hold only scheme://host:port: a path, a query or a user@ is where webhooks keep "
                "their token, and this field is stored in Prefect's parameters; put the URL in an "
                "environment variable named by alerts.webhook_url_env, or a Prefect Secret "
                "block named by alerts.webhook_url_secret",
            )
        if sum(x is not None for x in (self.webhook_url, self.webhook_url_env, self.webhook_url_secret)) > 1:
            raise FieldError("webhook_url", "give one of webhook_url, webhook_url_env, webhook_url_secret")
        names = [r.name for r in self.rules]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise ValueError(f"alerts.rules: duplicate rule names {sorted(dupes)}")


def _ratio(distance: float, stderr: float | None) -> float:
    """``distance`` in standard errors (infinite without a known, positive error)."""
    return distance / stderr if stderr else math.inf


PLAIN_WEBHOOK_PATTERN = r"^https?://[^/?#@\s]+/?$"
"""What ``alerts.webhook_url`` may hold: a scheme, a host and a port, nothing after them. Slack,
Discord and Teams put their secret in the path (``/services/T0/B0/TOKEN``) and others in the
query or before an ``@``; none of that may reach Prefect's parameters, MLflow or a file."""


def has_credentials(url: str) -> bool:
    """``url`` has more than :data:`PLAIN_WEBHOOK_PATTERN` lets in: a path, a query, a fragment
    or a user, any of which may be its secret."""
    return re.fullmatch(PLAIN_WEBHOOK_PATTERN, url) is None


@dataclasses.dataclass(frozen=True)
class Alert:
    rule: str
    step: int
    message: str
    stop_training: bool
    throttled: bool = False


class AlertEngine:
    """Which rules fire for each outcome.

    A result is judged against what was known at its step: a regression compares it with the
    best result of an *earlier* step, whatever order results arrive in (two slots, refinement
    after the run, a sweep of old checkpoints). ``notified`` (rule -> clock time of its last
    notification) carries throttling across processes when ``clock`` is wall time.
    """

    def __init__(
        self,
        cfg: AlertsConfig,
        clock: Callable[[], float] = time.monotonic,
        notified: dict[str, float] | None = None,
        items: ItemScores | None = None,
    ):
        self.cfg = cfg
        self._clock = clock
        self._results: dict[str, list[tuple[int, float]]] = {}
        self.notified: dict[str, float] = dict(notified or {})
        self._items = items
        self._item_cache: dict[tuple[int, str], tuple[dict, dict | None] | None] = {}
        self._paired_cache: dict[tuple, tuple[float, float, int] | None] = {}

    def remember(self, step: int, metrics: dict) -> None:
        """Know a result without judging it (history from before this process)."""
        for key, value in (metrics or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                bisect.insort(self._results.setdefault(key, []), (step, float(value)))

    def best_before(self, metric: str, step: int, higher_is_better: bool) -> float | None:
        values = [v for s, v in self._results.get(metric, ()) if s < step]
        if not values:
            return None
        return max(values) if higher_is_better else min(values)

    def check(self, step: int, metrics: dict | None, error: str | None = None, final: bool = False) -> list[Alert]:
        """Alerts for one outcome; ``metrics`` None with ``error`` means the evaluation failed;
        ``final``: the run's final checkpoint."""
        alerts = []
        for rule in self.cfg.rules:
            message = self._message(rule, step, metrics or {}, error, final)
            if message:
                alerts.append(self._throttle(rule, step, message))
        self.remember(step, metrics or {})
        return alerts

    def _message(self, rule: AlertRule, step: int, metrics: dict, error: str | None, final: bool) -> str | None:
        if rule.kind == "eval_failed":
            return f"evaluation of step {step} failed: {error}" if error else None
        if error or step < rule.min_step:
            return None
        if rule.kind == "nonfinite":
            bad = sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))
            return f"non-finite metrics at step {step}: {', '.join(bad)}" if bad else None
        value = metrics.get(rule.metric)
        if value is None or not math.isfinite(value):
            return None
        if rule.confirm is not None:
            confirmed = self._confirmed(rule, step, value, metrics)
            if confirmed is not None:
                return confirmed
        breach = self._breach(rule, step, value, metrics.get(rule.stderr_metric.format(metric=rule.metric)))
        if breach is None:
            return None
        message, separated = breach
        if not rule.noise_aware:
            return message
        if rule.stderrs is not None and rule.confirm is None and separated >= rule.stderrs:
            return f"{message} ({separated:.1f} standard errors)"
        if rule.at_once_stderrs is not None and separated >= rule.at_once_stderrs:
            return f"{message} ({separated:.1f} standard errors, unconfirmed)"
        if final and rule.final_stderrs is not None and separated >= rule.final_stderrs:
            return f"{message} ({separated:.1f} standard errors at the final checkpoint, unconfirmed)"
        if rule.consecutive is not None:
            streak = self._streak(rule, step)
            if streak + 1 >= rule.consecutive:
                return f"{message} ({streak + 1} evaluations in a row)"
        return None

    def _confirmed(self, rule: AlertRule, step: int, value: float, metrics: dict) -> str | None:
        """The message when ``step`` completes a run of ``confirm`` results in a row, in step
        order, that each lie ``stderrs`` past the baseline from before the first of them, else
        None. The run may hold results of later steps that arrived first (two slots, a sweep):
        the order results arrive in changes nothing. One baseline for the whole run: a baseline
        that moved on with each would take in the drop it is confirming."""
        stderr_key = rule.stderr_metric.format(metric=rule.metric)
        known = [(s, v) for s, v in self._results.get(rule.metric, ()) if s >= rule.min_step and s != step]
        at = bisect.bisect_left(known, (step,))
        lo = max(0, at - rule.confirm + 1)
        results = [(s, v, self._value_at(stderr_key, s)) for s, v in known[lo : at + rule.confirm - 1]]
        results.insert(at - lo, (step, value, metrics.get(stderr_key)))
        for first in range(at - lo + 1):  # each run of confirm results that holds step
            run = results[first : first + rule.confirm]
            if len(run) < rule.confirm:
                break
            breaches = [self._breach(rule, s, v, stderr, since=run[0][0]) for s, v, stderr in run]
            if all(b is not None and b[1] >= rule.stderrs for b in breaches):
                message, separated = breaches[-1]
                return f"{message} ({separated:.1f} standard errors, {rule.confirm} evaluations in a row)"
        return None

    def _breach(
        self, rule: AlertRule, step: int, value: float, stderr: float | None, since: int | None = None
    ) -> tuple[str, float] | None:
        """(message, how many standard errors past the line) when ``value`` at ``step`` breaches
        the rule's line (a regression: its baseline from before ``since``, by default ``step``),
        else None."""
        if rule.kind == "threshold":
            crossed = value < rule.value if rule.op == "<" else value > rule.value
            if not crossed:
                return None
            return f"{rule.metric}={value:.4g} {rule.op} {rule.value} at step {step}", _ratio(
                abs(value - rule.value), stderr
            )
        if rule.kind == "regression":
            baseline = self._baseline(rule, step if since is None else since)
            if baseline is None:
                return None
            level, level_stderr, what, steps = baseline
            paired = self._paired_drop(rule, step, steps)
            if paired is not None:  # the same items at both: the error of their differences
                drop, error, n = paired
                how = f" (paired on {n} items)"
            else:
                drop = (level - value) if rule.higher_is_better else (value - level)
                error = math.hypot(stderr or 0.0, level_stderr or 0.0) if stderr or level_stderr else None
                how = ""
            if drop <= rule.tolerance:
                return None
            message = f"{rule.metric}={value:.4g} at step {step} is {drop:.4g} worse than {what} {level:.4g} before it"
            return message + how, _ratio(drop, error)
        return None

    def _item_scores(self, step: int, metric: str) -> tuple[dict, dict | None] | None:
        key = (step, metric)
        if key not in self._item_cache:
            if len(self._item_cache) >= 64:  # a streak looks back a few steps; a run may have thousands
                self._item_cache.pop(next(iter(self._item_cache)))
            self._item_cache[key] = self._items(step, metric) if self._items else None
        return self._item_cache[key]

    def _paired_drop(self, rule: AlertRule, step: int, steps: list[int]) -> tuple[float, float, int] | None:
        """(drop, its paired standard error, common items) of ``step`` against the baseline
        ``steps`` (their items' mean), where every one of them kept its items; else None. Where
        every score is 0 or 1 the error is the one that gives McNemar's exact test, elsewhere the
        guarded one: an alert should not fire on four items lost out of four hundred."""
        key = (rule.metric, rule.higher_is_better, step, tuple(steps))
        if key not in self._paired_cache:  # a confirmation asks again for each run that holds the step
            if len(self._paired_cache) >= 256:
                self._paired_cache.pop(next(iter(self._paired_cache)))
            self._paired_cache[key] = self._paired_drop_of(rule, step, steps)
        return self._paired_cache[key]

    def _paired_drop_of(self, rule: AlertRule, step: int, steps: list[int]) -> tuple[float, float, int] | None:
        current = self._item_scores(step, rule.metric)
        bases = [self._item_scores(s, rule.metric) for s in steps]
        if current is None or not bases or any(b is None for b in bases):
            return None
        baseline = mean_scores([b[0] for b in bases])
        try:
            paired = paired_difference(baseline, current[0], current[1])
        except NoCommonItems:
            return None
        drop = -paired.difference if rule.higher_is_better else paired.difference
        if paired.mcnemar_z is not None and drop > 0:  # 0/1 scores: the exact test says how far
            return drop, drop / paired.mcnemar_z if paired.mcnemar_z else math.inf, paired.n
        return drop, paired.guarded_stderr, paired.n

    def _baseline(self, rule: AlertRule, step: int) -> tuple[float, float | None, str, list[int]] | None:
        """What a regression at ``step`` is measured from: (level, its standard error, its name,
        the steps it is of)."""
        stderr_key = rule.stderr_metric.format(metric=rule.metric)
        if rule.baseline_results is None:
            best = self.best_before(rule.metric, step, rule.higher_is_better)
            if best is None:
                return None
            best_step = self._best_step(rule, step)
            return best, self._value_at(stderr_key, best_step), "the best", [best_step]
        recent = [(s, v) for s, v in self._results.get(rule.metric, ()) if s < step][-rule.baseline_results :]
        if not recent:
            return None
        errors = [self._value_at(stderr_key, s) for s, _ in recent]
        level_stderr = math.sqrt(sum(e * e for e in errors)) / len(recent) if all(errors) else None
        what = f"the mean of the {len(recent)} results"
        return sum(v for _, v in recent) / len(recent), level_stderr, what, [s for s, _ in recent]

    def _best_step(self, rule: AlertRule, step: int) -> int | None:
        earlier = [(v, s) for s, v in self._results.get(rule.metric, ()) if s < step]
        if not earlier:
            return None
        return (max if rule.higher_is_better else min)(earlier)[1]

    def _value_at(self, key: str, step: int | None) -> float | None:
        return next((v for s, v in self._results.get(key, ()) if s == step), None)

    def _streak(self, rule: AlertRule, step: int) -> int:
        """How many evaluations right before ``step`` (in step order) breached the rule."""
        streak = 0
        for s, v in reversed([(s, v) for s, v in self._results.get(rule.metric, ()) if rule.min_step <= s < step]):
            stderr = self._value_at(rule.stderr_metric.format(metric=rule.metric), s)
            if self._breach(rule, s, v, stderr) is None:
                break
            streak += 1
        return streak

    def _throttle(self, rule: AlertRule, step: int, message: str) -> Alert:
        now = self._clock()
        last = self.notified.get(rule.name)
        throttled = last is not None and now - last < rule.throttle_secs
        if not throttled:
            self.notified[rule.name] = now
        return Alert(rule.name, step, message, rule.stop_training, throttled)

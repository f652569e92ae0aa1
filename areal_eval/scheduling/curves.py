"""Recorded learning curves: a metric's value, standard error and (where recorded) every item's
score at each checkpoint of a run, read from JSONL with errors naming the line and point."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from areal_eval import jsonl

DEFAULT_STDERR = 0.01


@dataclasses.dataclass(frozen=True)
class Point:
    step: int
    value: float
    stderr: float
    subset: tuple[float, float] | None = None
    """(value, stderr) on the curve's fixed probe subset, where it was recorded."""
    items: tuple[float, ...] | None = None
    """Every item's score, in the same order at every point of the curve, where recorded."""


@dataclasses.dataclass(frozen=True)
class Curve:
    name: str
    higher_is_better: bool
    points: tuple[Point, ...]
    subset_fraction: float | None = None
    """The share of the validation set the points' ``subset`` values were measured on."""
    train: tuple[dict, ...] = ()
    """Training's rows as the trainer published them (``{"step", "loss", ...}``), in step order."""


def read_curves(path: str | Path) -> list[Curve]:
    """Curves JSONL (``{"curve", "higher_is_better", "points": [{"step", "value", "stderr"}]}``;
    optionally ``subset_fraction`` and, per point, ``subset_value`` and ``subset_stderr``, and
    ``items``: every item's score, the same items in the same order at every point; and
    ``train``: training's rows, ``[{"step", "loss", ...}]``, as the trainer published them).

    A stderr that is missing or 0 counts as ``DEFAULT_STDERR``, as the scheduler's
    ``default_stderr`` does in the pipeline; a value or stderr that is NaN, infinite or (stderr)
    negative is refused, naming the line and point, since every score divides by the stderr.
    Anything else a curve cannot be read as is refused naming the line, point and field."""
    curves, lines = [], {}
    for lineno, row in jsonl.rows(path):
        where = f"{path}:{lineno}"
        curve = _curve(row, where)
        if curve.name in lines:
            raise ValueError(f"{where}: curve {curve.name!r} is on line {lines[curve.name]} too: name each curve once")
        lines[curve.name] = lineno
        _check_points(curve, where)
        curves.append(curve)
    if not curves:
        raise ValueError(f"{path}: no curves")
    return curves


def _curve(row, where: str) -> Curve:
    if not isinstance(row, dict):
        raise ValueError(f'{where}: a curve is a JSON object ({{"curve", "points": [...]}}), got {type(row).__name__}')
    if "curve" not in row:
        raise ValueError(f"{where}: needs 'curve', the curve's name")
    higher = row.get("higher_is_better", True)
    if not isinstance(higher, bool):
        raise ValueError(f"{where}: 'higher_is_better' must be true or false, got {higher!r}")
    fraction = row.get("subset_fraction")
    if fraction is not None and not (_is_number(fraction) and 0 < float(fraction) <= 1):
        raise ValueError(f"{where}: 'subset_fraction' must be a number in (0, 1], got {fraction!r}")
    points = row.get("points")
    if not isinstance(points, list):
        raise ValueError(f"{where}: 'points' must be a list of points, got {points!r}")
    return Curve(
        str(row["curve"]),
        higher,
        tuple(_point(p, i, fraction, f"{where}: point {i}") for i, p in enumerate(points)),
        float(fraction) if fraction else None,
        _train_rows(row.get("train", []), where),
    )


def _train_rows(rows, where: str) -> tuple[dict, ...]:
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f'{where}: \'train\' must be a list of rows ({{"step", "loss", ...}}), got {rows!r}')
    for i, r in enumerate(rows):
        if not (_is_number(r.get("step")) and float(r["step"]).is_integer()):
            raise ValueError(f"{where}: train row {i}: 'step' must be an integer, got {r.get('step')!r}")
    return tuple(sorted(rows, key=lambda r: int(r["step"])))


def _point(p, i: int, fraction, where: str) -> Point:
    if not isinstance(p, dict):
        raise ValueError(f'{where}: a point is a JSON object ({{"step", "value", "stderr"}}), got {p!r}')
    step = p.get("step")
    if not (_is_number(step) and float(step).is_integer()):
        raise ValueError(f"{where}: 'step' must be an integer, got {step!r}")
    named = {"value": p.get("value"), "stderr": p.get("stderr") or DEFAULT_STDERR}
    if fraction:
        named |= {"subset_value": p.get("subset_value"), "subset_stderr": p.get("subset_stderr")}
    for field, number in named.items():
        if not _is_number(number):
            why = " (the curve has a subset_fraction)" if field.startswith("subset") else ""
            raise ValueError(f"{where} (step {int(step)}): '{field}' must be a number{why}, got {number!r}")
    items = p.get("items")
    if items is not None:
        if not isinstance(items, list) or not items:
            raise ValueError(f"{where} (step {int(step)}): 'items' must be a non-empty list of scores, got {items!r}")
        bad = [v for v in items if not (isinstance(v, (int, float)) or _is_float_word(v))]  # true/false: 1/0
        if bad:
            raise ValueError(f"{where} (step {int(step)}): 'items' must all be scores (numbers), got {bad[0]!r}")
        items = tuple(float(v) for v in items)
    subset = (float(named["subset_value"]), float(named["subset_stderr"])) if fraction else None
    return Point(int(step), float(named["value"]), float(named["stderr"]), subset, items)


def _is_number(x) -> bool:
    """A JSON number (``true`` and ``false`` are not), or a float JSON spells as a word (NaN)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) or _is_float_word(x)


def _is_float_word(x) -> bool:
    return isinstance(x, str) and x in ("NaN", "Infinity", "-Infinity")


def _check_points(curve: Curve, where: str) -> None:
    points = curve.points
    if not points:
        raise ValueError(f"{where}: curve {curve.name!r} has no points")
    for i, (a, b) in enumerate(zip(points, points[1:], strict=False), start=1):
        if b.step <= a.step:
            raise ValueError(
                f"{where}: point {i} (step {b.step}) must come after step {a.step}: "
                "steps strictly increase along a curve"
            )
    sizes = {len(p.items) if p.items is not None else None for p in points}
    if len(sizes) > 1:
        first = len(points[0].items) if points[0].items is not None else "no"
        odd = next(i for i, p in enumerate(points) if (len(p.items) if p.items is not None else "no") != first)
        got = len(points[odd].items) if points[odd].items is not None else "no"
        raise ValueError(
            f"{where}: curve {curve.name!r} point {odd} (step {points[odd].step}) has {got} items, "
            f"point 0 has {first}: every point scores the same items, in the same order"
        )
    for i, p in enumerate(points):
        odd_item = next((j for j, x in enumerate(p.items or ()) if not math.isfinite(x)), None)
        if odd_item is not None:
            bad = p.items[odd_item]
            raise ValueError(f"{where}: point {i} (step {p.step}): item {odd_item} is {bad}: every score is finite")
        numbers = (p.value, p.stderr, *(p.subset or ()))
        if not all(math.isfinite(x) for x in numbers) or p.stderr < 0 or (p.subset and p.subset[1] < 0):
            raise ValueError(
                f"{where}: point {i} (step {p.step}) needs a finite value and a finite stderr >= 0, "
                f"got value {p.value}, stderr {p.stderr}" + (f", subset {p.subset}" if p.subset else "")
            )

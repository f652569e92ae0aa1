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


def read_curves(path: str | Path) -> list[Curve]:
    """Curves JSONL (``{"curve", "higher_is_better", "points": [{"step", "value", "stderr"}]}``;
    optionally ``subset_fraction`` and, per point, ``subset_value`` and ``subset_stderr``, and
    ``items``: every item's score, the same items in the same order at every point).

    A stderr that is missing or 0 counts as ``DEFAULT_STDERR``, as the scheduler's
    ``default_stderr`` does in the pipeline; a value or stderr that is NaN, infinite or (stderr)
    negative is refused, naming the line and point, since every score divides by the stderr."""
    curves = []
    for lineno, row in jsonl.rows(path):
        try:
            fraction = row.get("subset_fraction")
            points = tuple(
                Point(
                    int(p["step"]),
                    float(p["value"]),
                    float(p.get("stderr") or DEFAULT_STDERR),
                    (float(p["subset_value"]), float(p["subset_stderr"])) if fraction else None,
                    tuple(float(v) for v in p["items"]) if p.get("items") is not None else None,
                )
                for p in row["points"]
            )
            higher = bool(row.get("higher_is_better", True))
            curve = Curve(str(row["curve"]), higher, points, float(fraction) if fraction else None)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: bad curve: {exc!r}") from exc
        if not points:
            raise ValueError(f"{path}:{lineno}: curve {curve.name!r} has no points")
        for i, (a, b) in enumerate(zip(points, points[1:], strict=False), start=1):
            if b.step <= a.step:
                raise ValueError(
                    f"{path}:{lineno}: point {i} (step {b.step}) must come after step {a.step}: "
                    "steps strictly increase along a curve"
                )
        sizes = {len(p.items) if p.items is not None else None for p in points}
        if len(sizes) > 1:
            first = len(points[0].items) if points[0].items is not None else "no"
            odd = next(i for i, p in enumerate(points) if (len(p.items) if p.items is not None else "no") != first)
            got = len(points[odd].items) if points[odd].items is not None else "no"
            raise ValueError(
                f"{path}:{lineno}: curve {curve.name!r} point {odd} (step {points[odd].step}) has {got} items, "
                f"point 0 has {first}: every point scores the same items, in the same order"
            )
        for i, p in enumerate(points):
            numbers = (p.value, p.stderr, *(p.subset or ()), *(p.items or ()))
            if not all(math.isfinite(x) for x in numbers) or p.stderr < 0 or (p.subset and p.subset[1] < 0):
                raise ValueError(
                    f"{path}:{lineno}: point {i} (step {p.step}) needs a finite value and a finite stderr >= 0, "
                    f"got value {p.value}, stderr {p.stderr}" + (f", subset {p.subset}" if p.subset else "")
                )
        curves.append(curve)
    if not curves:
        raise ValueError(f"{path}: no curves")
    return curves

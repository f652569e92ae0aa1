"""Typed configs from plain dicts, with errors that name the offending field.

Every component owns a nested ``Config`` dataclass; this module only turns user input
(JSON/YAML files, CLI overrides, Prefect parameters) into those dataclasses. Unknown or
ill-typed fields fail loudly with their dotted path, because a silently ignored typo in an
evaluation config wastes a whole training run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value is unknown or invalid; the message names the field."""


class FieldError(ValueError):
    """Raised by a config's ``__post_init__`` about one of its fields; ``from_dict`` prefixes the
    section, so the message names the dotted field (``train.max_steps: must be >= 1, got -5``)."""

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")


class Bounds(NamedTuple):
    """A numeric field's range; an end that is None is open."""

    low: float | None = None
    high: float | None = None
    low_excluded: bool = False
    """The value must be above ``low``, not equal to it."""
    high_excluded: bool = False
    """The value must be below ``high``, not equal to it."""

    def admits(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_excluded else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_excluded else value <= self.high)

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_excluded else '>='} {self.low:g}"
        if self.low is None:
            return f"{'<' if self.high_excluded else '<='} {self.high:g}"
        opening = "(" if self.low_excluded else "["
        closing = ")" if self.high_excluded else "]"
        return f"in {opening}{self.low:g}, {self.high:g}{closing}"


Ranges = dict[str, Bounds]
"""A config class's numeric fields' ranges, by name. Config dataclasses declare theirs as
``RANGES``: ``__post_init__`` checks them, and the flows' parameter schema
(:mod:`areal_eval.pipeline.schema`) carries them, so a Prefect server refuses an out-of-range
value when a run is submitted, not when it starts."""


def check_ranges(obj: Any, ranges: Ranges) -> None:
    """Range-check numeric fields of ``obj``. A None value passes (it means "off" or
    "default"): 0 never silently stands for "all"."""
    for name, bounds in ranges.items():
        value = getattr(obj, name)
        if value is not None and not bounds.admits(value):
            raise FieldError(name, f"must be {bounds}, got {value!r}")


AT_LEAST_1 = Bounds(1)
"""Counts: ranks, steps, batch sizes, epochs."""
NON_NEGATIVE = Bounds(0)
POSITIVE = Bounds(0, low_excluded=True)
"""Durations, rates and noise levels: strictly above zero."""
OPEN_UNIT = Bounds(0, 1, low_excluded=True, high_excluded=True)
"""Fractions that must leave something out and keep something: strictly between 0 and 1."""
RANKS = Bounds(1, 1024)
"""Processes or groups of them on one node: more than any machine has devices or cores for."""
BATCH = Bounds(1, 65536)
"""Examples in one forward pass."""
TOKENS = Bounds(1, 1 << 20)
"""Token budgets: a million tokens is past every model's positions."""


def _check_scalar(tp: Any, value: Any, where: str) -> Any:
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    if tp is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: must be a finite number, got {value!r} (1e400 reads as infinity)")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where)
            except ConfigError as exc:
                errors.append(str(exc))
        if len(errors) == 1:
            raise ConfigError(errors[0])
        each = "; or ".join(e.removeprefix(f"{where}: ") for e in errors)
        raise ConfigError(f"{where}: invalid value {value!r} ({each})")
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where}: must be one of {list(allowed)}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        return [_convert(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    return _check_scalar(tp, value, where)


def from_dict(cls: type[T], data: Any, where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise ConfigError."""
    if isinstance(data, cls):
        return data
    label = where or cls.__name__
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        path = ", ".join(f"{where}.{k}" if where else k for k in unknown)
        raise ConfigError(f"unknown config field {path} (known: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in data.items():
        factory = fields[name].default_factory
        if isinstance(value, dict) and factory is not dataclasses.MISSING:
            default = factory()  # a section given in part keeps its owner's defaults for the rest
            if dataclasses.is_dataclass(default):
                value = merge(to_dict(default), value)
        kwargs[name] = _convert(hints[name], value, f"{where}.{name}" if where else name)
    try:
        obj = cls(**kwargs)
    except ConfigError:
        raise
    except FieldError as exc:
        raise ConfigError(f"{where}.{exc.field}: {exc.message}" if where else str(exc)) from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{label}: {exc}") from exc
    return obj


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}} -> {"a.b": 1}``: the form MLflow params want."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def set_dotted(data: dict, dotted: str, value: Any) -> None:
    """Apply a ``section.field=value`` override to a nested dict."""
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
    node[leaf] = value


def parse_overrides(items: list[str]) -> dict:
    """``["train.max_steps=10", "run_name=x"]`` -> nested dict; values parsed as JSON when possible,
    a list or mapping also as YAML (``alerts.rules=[{name: a, kind: nonfinite}]``, as the config
    file writes it); any other value is the string."""
    data: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        key, raw = item.split("=", 1)
        set_dotted(data, key.strip(), override_value(key.strip(), raw))
    return data


def override_value(key: str, raw: str) -> Any:
    """An override's value: JSON where it is JSON, a list or mapping also YAML, else the string."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        if raw.lstrip()[:1] not in ("[", "{"):
            return raw
    import yaml

    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"{key}: {raw!r} is neither JSON nor a YAML list or mapping ({exc})".replace("\n", " ")
        ) from None


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def read_file(path: str | Path) -> dict:
    """Read a JSON or YAML config file; parse errors name the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc}") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    except Exception as exc:  # noqa: BLE001 - re-raised with the file name
        raise ConfigError(f"{path}: cannot parse config: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return data

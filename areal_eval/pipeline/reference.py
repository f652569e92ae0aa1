"""The pipeline config's reference page, generated from the config classes themselves: every
field with its type, default, allowed values and docstring.

    python -m areal_eval.pipeline.reference > docs/reference/config.md

A test checks that the committed page is what this prints, so the page never drifts from the code.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing

from areal_eval.pipeline.config import PipelineConfig
from areal_eval.pipeline.schema import field_docs


def _type_name(tp: typing.Any) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return re.sub(r"\b[\w.]+\.(\w+)", r"\1", str(tp)).replace("NoneType", "None")


def _field_default(f: dataclasses.Field) -> typing.Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "(required)"


def _allowed(cls: type, name: str) -> str:
    parts = []
    if name in getattr(cls, "RANGES", {}):
        parts.append(str(cls.RANGES[name]))
    if name in getattr(cls, "CHOICES", {}):
        parts.append("one of " + ", ".join(f"`{c}`" for c in cls.CHOICES[name]()))
    if name in getattr(cls, "PATTERNS", {}):
        parts.append(f"matches `{cls.PATTERNS[name]()}`")
    return "; ".join(parts)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def sections(cls: type, defaults: typing.Any, prefix: str, out: list[str]) -> None:
    """``cls``'s table under ``prefix``, then each nested section's, depth first."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        value = getattr(defaults, f.name) if defaults is not None else _field_default(f)
        item = typing.get_args(hints[f.name])[0] if typing.get_origin(hints[f.name]) is list else None
        if dataclasses.is_dataclass(item):  # a list of entries: the entry's fields have a table of their own
            nested.append((item, None, f"{prefix}{f.name}[]."))
        if dataclasses.is_dataclass(hints[f.name]):
            nested.append((hints[f.name], value, f"{prefix}{f.name}."))
            rows.append(f"| `{f.name}` | section | see `{prefix}{f.name}` | | {_cell(docs.get(f.name, ''))} |")
            continue
        default = json.dumps(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value, default=str)
        if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            default = json.dumps([dataclasses.asdict(v) for v in value])
        kind, allowed, what = (
            _cell(_type_name(hints[f.name])),
            _cell(_allowed(cls, f.name)),
            _cell(docs.get(f.name, "")),
        )
        rows.append(f"| `{f.name}` | `{kind}` | `{_cell(default)}` | {allowed} | {what} |")
    title = prefix.rstrip(".") or "top level"
    out += [f"## `{title}`", "", "| field | type | default | allowed | what |", "|---|---|---|---|---|", *rows, ""]
    for sub, value, sub_prefix in nested:
        sections(sub, value, sub_prefix, out)


def render() -> str:
    out = [
        "# Config reference",
        "",
        "Every field of the pipeline config, generated from the config classes "
        "(`python -m areal_eval.pipeline.reference > docs/reference/config.md`). Give them in a JSON/YAML file "
        "(`--config`), as `--set section.field=value`, or in a deployment run's `params`.",
        "",
    ]
    sections(PipelineConfig, PipelineConfig(), "", out)
    return "\n".join(out)


if __name__ == "__main__":
    print(render())

"""The pipeline config as a pydantic model, for orchestrators that render and validate forms.

The config stays plain dataclasses, parsed by :func:`areal_eval.config.parsing.from_dict`. This
module derives a strict pydantic model from them (a bool is not an int, an unknown field is
refused by its dotted path, a number outside its class's ``RANGES`` too), with each field's
docstring and default as its description (a form leaves it empty: only what is set is sent). A class's ``CHOICES``
(field -> a function giving the allowed names) become enums, shown as a choice in the form, and
its ``PATTERNS`` (field -> a function giving a regular expression) patterns. A Prefect flow parameter
typed with it gets a form in the UI and server-side validation; the flow then parses
``model_dump(exclude_unset=True)`` as it parses any config, so only what the user set overrides
the config file and the defaults.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import textwrap
import types
import typing

from pydantic import BaseModel, ConfigDict, Field, create_model

from areal_eval.config.parsing import Bounds
from areal_eval.pipeline.config import PipelineConfig


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls``, read from its source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _model_type(tp: typing.Any) -> typing.Any:
    """``tp`` with every config dataclass in it replaced by its model."""
    if dataclasses.is_dataclass(tp):
        return config_model(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(lambda a, b: a | b, (_model_type(a) for a in typing.get_args(tp)))
    if origin is list:
        return list[_model_type(typing.get_args(tp)[0])] if typing.get_args(tp) else list
    if origin is tuple:
        return list[_model_type(typing.get_args(tp)[0])] if typing.get_args(tp) else list
    return tp


def _plain(value: typing.Any) -> typing.Any:
    """A default as JSON shows it (dataclasses as mappings)."""
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _pydantic_bounds(bounds: Bounds) -> dict:
    """``Field`` keywords for a range (they become the JSON schema's minimum and maximum)."""
    return {
        "gt" if bounds.low_excluded else "ge": bounds.low,
        "lt" if bounds.high_excluded else "le": bounds.high,
    }


@functools.cache
def config_model(cls: type, defaults_json: str | None = None) -> type[BaseModel]:
    """A strict pydantic model of config dataclass ``cls`` (``defaults_json``: its defaults as a
    JSON object, as a section of an enclosing config has them; default: ``cls()``'s, falling
    back to the field defaults)."""
    if defaults_json is not None:
        defaults = json.loads(defaults_json)
    else:
        try:
            defaults = _plain(cls())
        except TypeError:  # required fields: no instance without them
            defaults = None
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    ranges = getattr(cls, "RANGES", {})
    choices, patterns = getattr(cls, "CHOICES", {}), getattr(cls, "PATTERNS", {})
    fields, nullable_bools = {}, set()
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        bounds = _pydantic_bounds(ranges.get(f.name, Bounds()))
        if f.name in patterns:  # e.g. comma-separated names: the form checks them as it checks a range
            bounds["pattern"] = patterns[f.name]()
        if hints[f.name] in (float, float | None):  # 1e400 reads as infinity
            bounds["allow_inf_nan"] = False
        tp = typing.Literal[tuple(choices[f.name]())] if f.name in choices else _model_type(hints[f.name])
        if defaults is not None:
            # The default goes in the description, not in the schema: a form fills in every schema
            # default and sends it back, so an unedited form would override the config file (a
            # preset's) with the pipeline's defaults. Left empty, only what the user types is sent.
            default = defaults[f.name]
            described = f"{docs.get(f.name) or ''} Default: {json.dumps(default)}.".strip()
            if dataclasses.is_dataclass(hints[f.name]):  # a section: its fields say their defaults
                tp = config_model(hints[f.name], json.dumps(default, sort_keys=True))
                spec = Field(default_factory=lambda d=default: d, description=docs.get(f.name))
            elif hints[f.name] is bool:  # a form sends every checkbox; left at "None" it sends nothing
                tp, spec = bool | None, Field(default=None, description=described)
                nullable_bools.add(f.name)
            else:
                spec = Field(default_factory=lambda d=default: d, description=described, **bounds)
        elif f.default is not dataclasses.MISSING:
            spec = Field(default=_plain(f.default), description=docs.get(f.name), **bounds)
        elif f.default_factory is not dataclasses.MISSING:
            spec = Field(default_factory=f.default_factory, description=docs.get(f.name), **bounds)
        else:
            spec = Field(description=docs.get(f.name), **bounds)
        fields[f.name] = (tp, spec)
    doc = inspect.getdoc(cls)
    model = create_model(
        cls.__name__,
        __config__=ConfigDict(extra="forbid", strict=True, protected_namespaces=()),
        __doc__=doc if doc and not doc.startswith(f"{cls.__name__}(") else None,
        **fields,
    )
    model.nullable_bools = frozenset(nullable_bools)  # None there means "not set" (set_fields)
    return model


PipelineParams = config_model(PipelineConfig)
"""The type of the flows' ``params``: the Prefect UI renders it as a form with each field's
description, and the server validates it (strict types and ranges; an unknown field is refused
by its dotted path)."""


def set_fields(params: BaseModel | dict | None) -> dict | None:
    """What the user set in ``params``, as a mapping for :func:`load_pipeline_config`."""
    if params is None or isinstance(params, dict):
        return params
    return _without_unset_bools(params, params.model_dump(exclude_unset=True))


def _without_unset_bools(model: BaseModel, data: dict) -> dict:
    for name, value in list(data.items()):
        if value is None and name in getattr(type(model), "nullable_bools", ()):
            del data[name]
        elif isinstance(value, dict) and isinstance(getattr(model, name, None), BaseModel):
            _without_unset_bools(getattr(model, name), value)
    return data

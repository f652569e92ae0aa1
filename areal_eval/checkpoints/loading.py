"""Loading a model from a checkpoint directory, safely: safetensors unless the caller opts in to
pickle, and sharded ``torch.distributed.checkpoint`` directories built from their ``config.json``.

One home for every evaluator's loading, so the refusals read the same whatever the model class.
"""

from __future__ import annotations

import json
from pathlib import Path

from areal_eval.checkpoints import dcp
from areal_eval.checkpoints.manifest import CheckpointError
from areal_eval.config.parsing import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
"""``eval.dtype`` values: ``auto`` is the checkpoint's own (``config.json``'s ``dtype``, float32
where it names none)."""


def architectures(path: str | Path) -> list[str]:
    """The ``architectures`` named in the directory's ``config.json`` ([] when it names none)."""
    config = Path(path) / "config.json"
    try:
        return list(json.loads(config.read_text()).get("architectures") or [])
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json: not a transformers checkpoint directory") from None
    except (ValueError, AttributeError) as exc:
        raise CheckpointError(f"{config}: not a valid config ({exc})") from exc


def checkpoint_dtype(config) -> str:
    """The dtype a transformers config records (``dtype``, or ``torch_dtype`` before 4.56)."""
    recorded = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return str(recorded).removeprefix("torch.")


def check_dtype_runs(dtype, device) -> None:
    """Refuse a dtype ``device`` cannot compute in (float16 or bfloat16 on an old GPU), naming
    ``eval.dtype``, before a model is loaded in it."""
    import torch

    try:
        x = torch.ones(4, 4, dtype=dtype, device=device)
        torch.nn.functional.linear(x, x).sum().item()
    except (RuntimeError, TypeError) as exc:
        name = str(dtype).removeprefix("torch.")
        raise ConfigError(f"eval.dtype: {name} cannot run on {device}: {exc}") from None


def resolve_dtype(name: str, config, device):
    """The torch dtype ``eval.dtype`` ``name`` means for a checkpoint with this ``config``, checked
    to run on ``device``."""
    import torch

    if name not in DTYPES:
        raise ConfigError(f"eval.dtype: {name!r} is not one of {', '.join(DTYPES)}")
    dtype = getattr(torch, checkpoint_dtype(config) if name == "auto" else name)
    check_dtype_runs(dtype, device)
    return dtype


def load_pretrained(
    auto_class, path: str | Path, *, allow_pickle: bool = False, dtype: str = "float32", device=None, **config_kwargs
):
    """``auto_class`` (e.g. ``AutoModelForCausalLM``) from a local directory: a ``save_pretrained``
    one, or DCP shards beside their ``config.json``, in ``dtype`` (an ``eval.dtype`` value) on
    ``device`` (default: the CPU). Pickle weights are refused unless ``allow_pickle``: loading
    them can run code."""
    from transformers import AutoConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path), **config_kwargs)
    torch_dtype = resolve_dtype(dtype, config, device or "cpu")
    if dcp.dcp_format(path):
        model = auto_class.from_config(config, dtype=torch_dtype)
        dcp.load_into(model, path, allow_pickle=allow_pickle)
        return model.to(device or "cpu")
    if not allow_pickle and not any(path.glob("*.safetensors")):
        raise CheckpointError(
            f"{path}: refused: no *.safetensors weights, and loading pickle weights "
            "can run code (opt in with eval.allow_pickle: true if you trust the checkpoint)"
        )
    model = auto_class.from_pretrained(str(path), config=config, use_safetensors=not allow_pickle, dtype=torch_dtype)
    return model.to(device or "cpu")

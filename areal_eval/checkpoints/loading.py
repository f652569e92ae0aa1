"""Loading a model from a checkpoint directory, safely: safetensors unless the caller opts in to
pickle, and sharded ``torch.distributed.checkpoint`` directories built from their ``config.json``.

One home for every evaluator's loading, so the refusals read the same whatever the model class.
"""

from __future__ import annotations

import json
from pathlib import Path

from areal_eval.checkpoints import dcp
from areal_eval.checkpoints.manifest import CheckpointError


def architectures(path: str | Path) -> list[str]:
    """The ``architectures`` named in the directory's ``config.json`` ([] when it names none)."""
    config = Path(path) / "config.json"
    try:
        return list(json.loads(config.read_text()).get("architectures") or [])
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json: not a transformers checkpoint directory") from None
    except (ValueError, AttributeError) as exc:
        raise CheckpointError(f"{config}: not a valid config ({exc})") from exc


def load_pretrained(auto_class, path: str | Path, allow_pickle: bool = False, **config_kwargs):
    """``auto_class`` (e.g. ``AutoModelForCausalLM``) from a local directory: a ``save_pretrained``
    one, or DCP shards beside their ``config.json``. Pickle weights are refused unless
    ``allow_pickle``: loading them can run code."""
    from transformers import AutoConfig

    path = Path(path)
    if dcp.dcp_format(path):
        model = auto_class.from_config(AutoConfig.from_pretrained(str(path), **config_kwargs))
        dcp.load_into(model, path, allow_pickle=allow_pickle)
        return model
    if not allow_pickle and not any(path.glob("*.safetensors")):
        raise CheckpointError(
            f"{path}: refused: no *.safetensors weights, and loading pickle weights "
            "can run code (opt in with eval.allow_pickle: true if you trust the checkpoint)"
        )
    return auto_class.from_pretrained(str(path), use_safetensors=not allow_pickle, **config_kwargs)

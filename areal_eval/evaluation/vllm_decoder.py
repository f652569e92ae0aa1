"""The ``vllm`` generation backend: one vLLM engine per data-parallel rank.

Runs where vLLM is installed, usually an environment of its own (``bash scripts/setup.sh
--vllm`` makes ``.venv-vllm``; point ``eval.python`` at its interpreter). The engine decodes the
same prompt tokens the transformers backend would, greedy or sampled with each answer's own
seed, and answers are cut and counted by the same rules (:func:`decoders.completion_from`).
In warm workers the engine stays up: the next checkpoint of the same model is loaded into it in
place (``reload_weights``, and its prefix cache dropped); another model starts a new engine.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from areal_eval.config.parsing import ConfigError

_engines: dict = {}
"""The engine this rank keeps, by (checkpoint directory, settings): one at a time."""


def engine_shape(checkpoint_dir: Path) -> str:
    """What an engine is built from besides the weights: the model's config and tokenizer."""
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        path = Path(checkpoint_dir) / name
        digest.update(name.encode() + (path.read_bytes() if path.exists() else b""))
    return digest.hexdigest()


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VLLMDecoder:
    """``complete`` as :class:`decoders.TransformersDecoder`'s, on a vLLM engine."""

    def __init__(self, checkpoint_dir: Path, tokenizer, cfg, dtype: str = "auto"):
        if not vllm_available():
            raise ConfigError(
                "eval.generation.backend: vllm is not installed in this interpreter; run the workers in an "
                "environment that has it (bash scripts/setup.sh --vllm, then eval.python: .venv-vllm/bin/python)"
            )
        self.tokenizer, self.cfg = tokenizer, cfg
        key = (engine_shape(checkpoint_dir), dtype, cfg.vllm_kv_cache_gb)
        engine = _engines.get(key)
        if engine is None:  # another architecture or tokenizer: a new engine
            for old in list(_engines):
                _engines.pop(old)[0].llm_engine.engine_core.shutdown()
            started = time.monotonic()
            engine = _engines[key] = [self._start(checkpoint_dir, dtype), str(checkpoint_dir)]
            print(f"vllm engine started in {time.monotonic() - started:.1f} s ({checkpoint_dir})", flush=True)
        elif engine[1] != str(checkpoint_dir):  # the same model's next checkpoint: new weights, same engine
            started = time.monotonic()
            engine[0].collective_rpc("reload_weights", kwargs={"weights_path": str(checkpoint_dir)})
            engine[0].reset_prefix_cache()  # cached prefixes were computed with the old weights
            engine[1] = str(checkpoint_dir)
            print(f"vllm weights reloaded in {time.monotonic() - started:.1f} s ({checkpoint_dir})", flush=True)
        self.llm = engine[0]

    def _start(self, checkpoint_dir: Path, dtype: str):
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # its start-up would fill the job's log
        from vllm import LLM

        from areal_eval import distributed

        memory = {}
        if self.cfg.vllm_kv_cache_gb is not None or not distributed.device().type == "cuda":
            memory["kv_cache_memory_bytes"] = int((self.cfg.vllm_kv_cache_gb or 1.0) * (1 << 30))
        return LLM(
            model=str(checkpoint_dir),
            tokenizer=str(checkpoint_dir),
            dtype=dtype,
            seed=0,
            enforce_eager=True,
            tensor_parallel_size=1,
            disable_log_stats=True,
            **memory,
        )

    def complete(self, prompt_ids: list[list[int]], seeds: list[int | None]):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from areal_eval.evaluation.decoders import completion_from

        cfg = self.cfg
        params = [
            SamplingParams(
                temperature=0.0 if seed is None else cfg.temperature,
                top_p=1.0 if seed is None else cfg.top_p,
                seed=seed,
                max_tokens=cfg.max_new_tokens,
                stop=cfg.stop or None,
                skip_special_tokens=True,
            )
            for seed in seeds
        ]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [completion_from(self.tokenizer, cfg, list(out.outputs[0].token_ids)) for out in outputs]

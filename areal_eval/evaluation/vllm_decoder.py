"""The ``vllm`` generation backend: one vLLM engine per data-parallel rank.

With ``eval.mp_size`` N > 1 each model-parallel group of N ranks runs one engine with vLLM's
tensor parallelism over N: the group's head starts it on the group's devices (its GPUs through
``CUDA_VISIBLE_DEVICES``, or its cores through ``VLLM_CPU_OMP_THREADS_BIND``) and decodes; the
other ranks of the group hold no engine and wait for the head's results.

Runs where vLLM is installed, usually an environment of its own (``bash scripts/setup.sh
--vllm`` makes ``.venv-vllm``; point ``eval.python`` at its interpreter). The engine decodes the
same prompt tokens the transformers backend would, greedy or sampled with each answer's own
seed, and answers are cut and counted by the same rules (:func:`decoders.completion_from`).
In warm workers the engine stays up: the next checkpoint of the same model is loaded into it in
place (``reload_weights``, and its prefix cache dropped); another model starts a new engine.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from pathlib import Path

from areal_eval.config.parsing import ConfigError
from areal_eval.evaluation.decoders import completion_from, end_token_ids

_engines: dict = {}
"""The engine this rank keeps, by (checkpoint directory, settings): one at a time."""


def engine_shape(checkpoint_dir: Path) -> str:
    """What an engine is built from besides the weights: the model's config and tokenizer."""
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        path = Path(checkpoint_dir) / name
        digest.update(name.encode() + (path.read_bytes() if path.exists() else b""))
    return digest.hexdigest()


def engine_dtype(checkpoint_dir: Path, dtype: str) -> str:
    """The dtype an engine runs ``eval.dtype`` ``dtype`` in, as the transformers backend does:
    ``auto`` is the checkpoint's own. vLLM's own ``auto`` would turn a float32 checkpoint into
    bfloat16 or float16, so the two backends would answer in different precisions."""
    from transformers import AutoConfig

    from areal_eval import distributed
    from areal_eval.checkpoints.loading import resolve_dtype

    config = AutoConfig.from_pretrained(str(checkpoint_dir))
    return str(resolve_dtype(dtype, config, distributed.device())).removeprefix("torch.")


def checkpoint_generation_config(checkpoint_dir: Path):
    """The checkpoint's generation config, as ``from_pretrained`` gives a model: its
    ``generation_config.json``, else one made from its ``config.json``."""
    from transformers import AutoConfig, GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(checkpoint_dir))
    except OSError:
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(checkpoint_dir)))


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def shutdown_engines() -> None:
    """Stop the engine this rank keeps, if any (its device memory is freed)."""
    for old in list(_engines):
        _engines.pop(old)[0].llm_engine.engine_core.shutdown()


def group_devices(mp_size: int, on_gpu: bool) -> dict[str, str]:
    """The environment that puts an engine's tensor-parallel workers on the devices of this
    rank's model-parallel group (this rank, its head, and the ``mp_size - 1`` after it): their
    GPUs, or on CPUs a share each of the cores the job may run on, one share per rank. A
    setting the user made (``VLLM_CPU_OMP_THREADS_BIND``) is kept."""
    from areal_eval import distributed

    local = distributed.local_rank()
    if on_gpu:
        import torch

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        names = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        return {"CUDA_VISIBLE_DEVICES": ",".join(names[local : local + mp_size])}
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", distributed.world_size()))
    shares = [core_share(cores, ranks, r) for r in range(local, local + mp_size)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, share)) for share in shares)}


def core_share(cores: list[int], ranks: int, rank: int) -> list[int]:
    """Rank ``rank``'s cores of ``cores`` dealt to ``ranks`` ranks: a contiguous share each, or
    one core each in turn when there are fewer cores than ranks."""
    if len(cores) < ranks:
        return [cores[rank % len(cores)]]
    per, extra = divmod(len(cores), ranks)
    start = rank * per + min(rank, extra)
    return cores[start : start + per + (rank < extra)]


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class VLLMDecoder:
    """``complete`` as :class:`decoders.TransformersDecoder`'s, on a vLLM engine."""

    def __init__(self, checkpoint_dir: Path, tokenizer, cfg, dtype: str = "auto", mp_size: int = 1):
        from areal_eval import distributed

        if not vllm_available():
            raise ConfigError(
                "eval.generation.backend: vllm is not installed in this interpreter; run the workers in an "
                "environment that has it (bash scripts/setup.sh --vllm, then eval.python: .venv-vllm/bin/python)"
            )
        self.tokenizer, self.cfg = tokenizer, cfg
        self.ends = end_token_ids(tokenizer, checkpoint_generation_config(checkpoint_dir))
        self.llm = None
        dtype = engine_dtype(checkpoint_dir, dtype)
        if distributed.rank() % mp_size:  # the group's head runs the engine on this rank's devices too
            shutdown_engines()
            return
        key = (engine_shape(checkpoint_dir), dtype, cfg.vllm_kv_cache_gb, mp_size)
        engine = _engines.get(key)
        if engine is None:  # another architecture, tokenizer or group size: a new engine
            shutdown_engines()
            started = time.monotonic()
            engine = _engines[key] = [self._start(checkpoint_dir, dtype, mp_size), str(checkpoint_dir)]
            runs_in = str(engine[0].model_config.dtype).removeprefix("torch.")
            print(
                f"vllm engine started in {time.monotonic() - started:.1f} s "
                f"(tensor parallel {mp_size}, {runs_in}, {checkpoint_dir})",
                flush=True,
            )
        elif engine[1] != str(checkpoint_dir):  # the same model's next checkpoint: new weights, same engine
            started = time.monotonic()
            engine[0].collective_rpc("reload_weights", kwargs={"weights_path": str(checkpoint_dir)})
            engine[0].reset_prefix_cache()  # cached prefixes were computed with the old weights
            engine[1] = str(checkpoint_dir)
            print(f"vllm weights reloaded in {time.monotonic() - started:.1f} s ({checkpoint_dir})", flush=True)
        self.llm = engine[0]

    def _start(self, checkpoint_dir: Path, dtype: str, mp_size: int):
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # its start-up would fill the job's log
        from vllm import LLM

        from areal_eval import distributed

        memory = {}
        on_gpu = distributed.device().type == "cuda"
        if self.cfg.vllm_kv_cache_gb is not None or not on_gpu:
            memory["kv_cache_memory_bytes"] = int((self.cfg.vllm_kv_cache_gb or 1.0) * (1 << 30))
        with _environment(group_devices(mp_size, on_gpu)):  # what the engine's processes inherit
            return LLM(
                model=str(checkpoint_dir),
                tokenizer=str(checkpoint_dir),
                dtype=dtype,
                seed=0,
                enforce_eager=True,
                tensor_parallel_size=mp_size,
                disable_log_stats=True,
                **memory,
            )

    def complete(self, prompt_ids: list[list[int]], seeds: list[int | None]):
        if self.llm is None:
            return None
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        cfg = self.cfg
        params = [
            SamplingParams(
                temperature=0.0 if seed is None else cfg.temperature,
                top_p=1.0 if seed is None else cfg.top_p,
                seed=seed,
                max_tokens=cfg.max_new_tokens,
                stop=cfg.stop or None,
                stop_token_ids=list(self.ends),
                skip_special_tokens=True,
            )
            for seed in seeds
        ]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [completion_from(self.tokenizer, cfg, list(out.outputs[0].token_ids), self.ends) for out in outputs]

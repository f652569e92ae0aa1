"""Generation backends: each decodes prompt tokens into answers by the same rules.

``transformers`` runs batched ``generate`` on the evaluator's model; ``vllm``
(:mod:`areal_eval.evaluation.vllm_decoder`) runs an engine per rank. Both return
:class:`Completion` values cut and counted by :func:`completion_from`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class Decoding(Protocol):
    """The settings a decoder reads (``eval.generation`` holds them)."""

    temperature: float
    top_p: float
    max_new_tokens: int
    stop: list[str]
    vllm_kv_cache_gb: float | None


class SeededSampler:
    """A logits processor that draws each row's next token from that row's own generator (with
    temperature and top-p) and leaves only it possible, so greedy search takes it. Rows whose
    seed is None stay greedy.

    It samples on the device the scores are on, with generators made there at the first token:
    on a GPU no batch x vocabulary copy and sort go through the CPU at every token (285 ms a token
    on a CPU core for 32 rows of a 152k vocabulary with top-p). A seed draws the same answer at
    every world size on one kind of device; a GPU's generator draws other ones than a CPU's."""

    def __init__(self, seeds: list[int | None], temperature: float, top_p: float):
        self.seeds, self.generators = seeds, None
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import torch

        if self.generators is None:
            self.generators = [
                None if s is None else torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds
            ]
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= self.top_p  # always keeps the top token
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
        rows = zip(probs, self.generators, strict=True)
        chosen = torch.stack(
            [p.argmax(-1, keepdim=True) if g is None else torch.multinomial(p, 1, generator=g) for p, g in rows]
        )
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter(-1, chosen, 0.0)


@dataclasses.dataclass
class Completion:
    token_ids: list[int]
    text: str
    truncated: bool


class TransformersDecoder:
    """Batched ``model.generate``: left-padded prompts, KV cache, greedy or seeded sampling."""

    def __init__(self, model, tokenizer, cfg: Decoding):
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg

    def complete(self, prompt_ids: list[list[int]], seeds: list[int | None]) -> list[Completion]:
        """One answer per prompt row: greedy where its seed is None, else sampled from that seed."""
        import torch
        from transformers import GenerationConfig as HFGenerationConfig
        from transformers import LogitsProcessorList

        from areal_eval import distributed

        tok, cfg = self.tokenizer, self.cfg
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompt_ids):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        device = distributed.device()
        ends = end_token_ids(tok, self.model.generation_config)
        settings = HFGenerationConfig(
            max_new_tokens=cfg.max_new_tokens,
            do_sample=False,
            num_beams=1,
            pad_token_id=tok.pad_token_id,
            eos_token_id=list(ends),
            stop_strings=cfg.stop or None,
        )
        processors = LogitsProcessorList()
        if any(s is not None for s in seeds):
            processors.append(SeededSampler(seeds, cfg.temperature, cfg.top_p))
        checkpoints_own, self.model.generation_config = self.model.generation_config, HFGenerationConfig()
        try:  # the evaluation's settings alone decide, as on vLLM: none of the checkpoint's (a repetition penalty)
            out = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                generation_config=settings,
                logits_processor=processors,
                tokenizer=tok if cfg.stop else None,
            )
        finally:
            self.model.generation_config = checkpoints_own
        return [completion_from(tok, cfg, row[width:].tolist(), ends) for row in out.cpu()]


def end_token_ids(tok, generation_config) -> tuple[int, ...]:
    """The tokens that end an answer: the tokenizer's end-of-sequence token, then those the
    checkpoint's generation config names (Llama 3 and Qwen chat models name more than one), as
    ``generate`` and vLLM each stop on by default."""
    named = getattr(generation_config, "eos_token_id", None)
    named = [named] if isinstance(named, int) else list(named or [])
    ends = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return tuple(ends + [i for i in named if i not in ends])


def completion_from(tok, cfg: Decoding, generated: list[int], ends: tuple[int, ...] | None = None) -> Completion:
    """An answer from the tokens a decoder generated, by the same rules on every backend: it ends
    at the first of the ``ends`` tokens (default: the tokenizer's end-of-sequence token) or a stop
    string, and one that ended neither way is truncated."""
    ends = set(ends if ends is not None else (tok.eos_token_id,))
    at = next((i for i, t in enumerate(generated) if t in ends), None)
    ended = at is not None
    if ended:
        generated = generated[:at]
    while generated and generated[-1] == tok.pad_token_id:  # rows that stopped early are padded
        generated = generated[:-1]
        ended = True
    text = tok.decode(generated, skip_special_tokens=True)
    cuts = [text.index(s) for s in cfg.stop if s in text]
    if cuts:
        text, ended = text[: min(cuts)], True
    return Completion(generated, text, truncated=not ended)

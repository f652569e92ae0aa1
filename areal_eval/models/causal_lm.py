"""The policy model: a transformers causal LM (``AutoModelForCausalLM``).

Loaded with ``from_pretrained`` from any local path (a saved checkpoint or a downloaded model),
or built fresh from a small local config for the demo.
"""

from __future__ import annotations

from pathlib import Path

from areal_eval.checkpoints import loading
from areal_eval.checkpoints.manifest import CheckpointError
from areal_eval.config.parsing import ConfigError
from areal_eval.data.preference_data import DataError


def load_model(path: str | Path, allow_pickle: bool = False, dtype: str = "float32", device=None):
    """A causal LM from a local directory, in ``dtype`` (an ``eval.dtype`` value) on ``device``.
    A checkpoint whose config names a sequence classifier (a reward model) is refused: it has
    no language-modelling head to generate or score with."""
    from transformers import AutoModelForCausalLM

    heads = [
        a for a in loading.architectures(path) if a.endswith(("ForSequenceClassification", "ForTokenClassification"))
    ]
    if heads:
        raise CheckpointError(
            f"{path}: refused: its config.json names {heads[0]}, a classifier (a reward model?), not a causal LM; "
            "generation and lm_loss need a model AutoModelForCausalLM loads (use eval.evaluator: reward_model "
            "for reward models)"
        )
    return loading.load_pretrained(AutoModelForCausalLM, path, allow_pickle=allow_pickle, dtype=dtype, device=device)


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer, padding on the left (generation continues each row's end)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_shared(path: str | Path, allow_pickle: bool = False, models: dict | None = None, dtype: str = "auto"):
    """(model, tokenizer) of the checkpoint on this rank's device in ``dtype``, in eval mode;
    loaded once per job when evaluators share ``models``."""
    from areal_eval import distributed

    key = (str(path), allow_pickle, dtype)
    if models is not None and key in models:
        return models[key]
    model = load_model(path, allow_pickle, dtype, distributed.device()).eval()
    loaded = (model, load_tokenizer(path))
    if models is not None:
        models[key] = loaded
    return loaded


def encode_prompt(tok, prompt: str, *, chat_template: bool, where: str, setting: str) -> list[int]:
    """A prompt's token ids, whole: as a user turn in the tokenizer's chat template (ending where
    the assistant's answer starts) with ``chat_template``, else as plain text. ``setting`` names
    the field that asked for the template, for the error when the tokenizer has none."""
    if chat_template:
        if not tok.chat_template:
            raise ConfigError(f"{setting}: the tokenizer has no chat template")
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    ids = tok(prompt, add_special_tokens=not chat_template)["input_ids"]
    if not ids:
        raise DataError(f"{where}: the prompt has no tokens for this tokenizer")
    return ids


def encode_answer(tok, answer: str, chat_template: bool) -> list[int]:
    """An answer's token ids: in a chat template it is the assistant's turn, which starts on a
    fresh line, so the space that joins a plain prompt and answer is dropped."""
    if chat_template:
        return tok(answer.lstrip(), add_special_tokens=False)["input_ids"]
    return tok(answer)["input_ids"]


def train_tokenizer(texts: list[str], out_dir: str | Path, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer locally (digits split one by one, so any number has
    tokens) and save it as a transformers fast tokenizer; decoding gives the text back exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["[PAD]", "[BOS]", "[EOS]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # it printed blank lines on stdout, where scripts print their JSON
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]")
    fast.padding_side = "left"
    fast.save_pretrained(str(out_dir))
    return fast


def build_model(tokenizer, *, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4, max_length: int = 128):
    """A fresh small Llama-style causal LM."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_length,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config)

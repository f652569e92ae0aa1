"""The lm_loss evaluator, in this process, against a brute-force sum over tokens."""

import json
import math
from pathlib import Path

import pytest
import torch

from areal_eval.config.parsing import ConfigError
from areal_eval.data.preference_data import DataError
from areal_eval.evaluation.lm_loss import LMLossConfig
from areal_eval.models import causal_lm
from tests.helpers import causal_metrics


def brute_force_nll(checkpoint, rows):
    """Sum of -log p(token) over the scored tokens, one unpadded forward pass per row."""
    model, tok = causal_lm.load_model(checkpoint).eval(), causal_lm.load_tokenizer(checkpoint)
    total, tokens = 0.0, 0
    for prompt, completion in rows:
        context = tok(prompt)["input_ids"] if prompt else [tok.bos_token_id]
        scored = tok(completion, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([context + scored])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
        for pos in range(len(context), len(context) + len(scored)):
            total -= logprobs[pos - 1, ids[0, pos]].item()
        tokens += len(scored)
    return total, tokens


def test_loss_counts_completion_tokens_only_and_equals_brute_force(causal_checkpoint, tmp_path):
    checkpoint, prompts = causal_checkpoint
    rows = [json.loads(line) for line in prompts.read_text().splitlines()][:9]
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["answer"]}) + "\n" for r in rows))
    m = causal_metrics(checkpoint, data, "lm_loss", batch_size=4)
    nll, tokens = brute_force_nll(checkpoint, [(r["prompt"], r["answer"]) for r in rows])
    assert m["n_texts"] == 9 and m["n_tokens"] == tokens
    assert m["loss"] == pytest.approx(nll / tokens, rel=1e-6)
    assert m["perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-6)
    scored_bytes = sum(len(r["answer"].encode()) for r in rows)
    assert m["bits_per_byte"] == pytest.approx(nll / math.log(2) / scored_bytes, rel=1e-6)
    assert 0 < m["loss_stderr"] < m["loss"]
    answers = causal_metrics(checkpoint, prompts, "lm_loss", lm_loss=LMLossConfig(completion_field="answer"))
    assert answers["n_texts"] == 41


def test_text_rows_score_every_token_from_bos_and_bits_per_byte_counts_the_texts_bytes(causal_checkpoint, tmp_path):
    checkpoint, prompts = causal_checkpoint
    texts = [r["prompt"] + r["answer"] for r in map(json.loads, prompts.read_text().splitlines())][:5]
    texts.append("é½ 7 + 5 = 12 ünïcode ✓")  # multi-byte characters, the first at the text's start
    data = tmp_path / "texts.jsonl"
    rows = [{"text": t} for t in texts] + [{"prompt": "", "completion": "Q"}]  # an empty prompt: a whole text too
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = causal_metrics(checkpoint, data, "lm_loss", batch_size=2)
    nll, tokens = brute_force_nll(checkpoint, [("", t) for t in [*texts, "Q"]])
    assert m["n_tokens"] == tokens and m["loss"] == pytest.approx(nll / tokens, rel=1e-6)
    text_bytes = sum(len(t.encode("utf-8")) for t in [*texts, "Q"])
    assert m["bits_per_byte"] == pytest.approx(nll / math.log(2) / text_bytes, rel=1e-6)
    assert causal_metrics(checkpoint, data, "lm_loss", batch_size=5) == pytest.approx(m, rel=1e-6)
    assert m["truncated_texts"] == 0


def test_rows_cut_to_max_length_are_counted_and_warned_about(causal_checkpoint, tmp_path):
    from areal_eval.evaluation.lm_loss import LMLossEvaluator

    checkpoint, _ = causal_checkpoint
    data = tmp_path / "texts.jsonl"
    data.write_text(json.dumps({"text": "1 + 1 = 2 " * 40}) + "\n" + json.dumps({"text": "3 + 4 = 7"}) + "\n")
    cfg = LMLossConfig(max_length=16)
    m = causal_metrics(checkpoint, data, "lm_loss", lm_loss=cfg)
    short = len(causal_lm.load_tokenizer(checkpoint)("3 + 4 = 7", add_special_tokens=False)["input_ids"])
    assert m["truncated_texts"] == 1 and m["n_tokens"] == 15 + short  # BOS and 15 scored tokens: max_length 16
    evaluator = LMLossEvaluator(cfg)
    assert evaluator.warnings({"truncated_texts": 1.0, "n_texts": 2.0}) == [
        "1 of 2 texts were longer than max_length (16 tokens) and kept the start of their completion "
        "(metric truncated_texts)"
    ]


def test_a_row_without_text_names_file_and_line(causal_checkpoint, tmp_path):
    checkpoint, _ = causal_checkpoint
    data = tmp_path / "texts.jsonl"
    data.write_text(json.dumps({"text": "Q: 1 + 1"}) + "\n" + json.dumps({"prompt": "Q:"}) + "\n")
    with pytest.raises(DataError, match=rf"{data}:2: expected 'text', or 'prompt' and 'completion'"):
        causal_metrics(checkpoint, data, "lm_loss")


def test_generation_and_lm_loss_share_one_job_and_name_their_metrics(causal_checkpoint):
    checkpoint, prompts = causal_checkpoint
    both = causal_metrics(checkpoint, prompts, "generation,lm_loss", lm_loss=LMLossConfig(completion_field="answer"))
    alone = causal_metrics(checkpoint, prompts, "lm_loss", lm_loss=LMLossConfig(completion_field="answer"))
    assert both["lm_loss/loss"] == pytest.approx(alone["loss"], rel=1e-9)
    assert both["generation/accuracy"] == causal_metrics(checkpoint, prompts)["accuracy"]
    assert {k.split("/")[0] for k in both} == {"generation", "lm_loss"}


def test_with_the_chat_template_the_completion_is_the_assistants_turn_as_sft_trains_it(causal_checkpoint):
    from areal_eval.evaluation.lm_loss import encode_row
    from areal_eval.models.causal_lm import encode_answer, encode_prompt, load_tokenizer

    tok = load_tokenizer(causal_checkpoint[0])
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}|{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    row = {"prompt": "Q: 2 and 3?\nA:", "completion": " 2 + 3 = 5 #### 5", "line": 7}
    encoded = encode_row(tok, row, LMLossConfig(chat_template=True), Path("d.jsonl"))
    prompt = encode_prompt(
        tok, row["prompt"], chat_template=True, where="d.jsonl:7", setting="eval.lm_loss.chat_template"
    )
    assert encoded["ids"] == prompt + encode_answer(tok, row["completion"], True)
    assert encoded["context"] == len(prompt) and tok.decode(prompt) == "Q: 2 and 3?\nA:|>"
    assert encoded["bytes"] == len("2 + 3 = 5 #### 5")
    tok.chat_template = None
    with pytest.raises(ConfigError, match="eval.lm_loss.chat_template: the tokenizer has no chat template"):
        encode_row(tok, row, LMLossConfig(chat_template=True), Path("d.jsonl"))


def test_token_logprobs_row_by_row_equal_the_whole_batchs_log_softmax():
    from areal_eval.evaluation.lm_loss import token_logprobs

    torch.manual_seed(0)
    logits, targets = torch.randn(5, 7, 300, dtype=torch.bfloat16), torch.randint(0, 300, (5, 7))
    whole = torch.log_softmax(logits.double(), dim=-1).gather(-1, targets[:, :, None]).squeeze(-1)
    rows = token_logprobs(logits, targets)
    assert rows.dtype == torch.float64 and torch.equal(rows, whole)

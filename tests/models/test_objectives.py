"""What each objective trains on: the SFT objective's plain and chat-template encodings."""

import pytest

from areal_eval.config.parsing import ConfigError, FieldError
from areal_eval.models import causal_lm
from areal_eval.models.objectives import ModelConfig, SFTObjective

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}[EOS]\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROWS = [{"prompt": "Q: Ann has 3 coins and gets 4 more.\nA:", "answer": " 3 + 4 = 7 #### 7", "line": 1}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    texts = [r["prompt"] + r["answer"] for r in ROWS] + ["<|user|>\n<|assistant|>\n"]
    return causal_lm.train_tokenizer(texts * 20, tmp_path_factory.mktemp("tok"), 300)


def test_plain_sft_scores_the_answer_and_eos_after_the_prompt_as_before(tokenizer):
    [item] = SFTObjective.encode(tokenizer, ROWS, ModelConfig(objective="sft", max_length=64))
    prompt, answer = tokenizer(ROWS[0]["prompt"])["input_ids"], tokenizer(ROWS[0]["answer"])["input_ids"]
    assert item == {"ids": prompt + answer + [tokenizer.eos_token_id], "context": len(prompt)}


def test_chat_sft_trains_the_answer_as_the_assistants_turn_of_the_prompts_user_turn(tokenizer):
    tokenizer.chat_template = TEMPLATE
    try:
        [item] = SFTObjective.encode(tokenizer, ROWS, ModelConfig(objective="sft", max_length=64, chat_template=True))
    finally:
        tokenizer.chat_template = None
    prompt = tokenizer.decode(item["ids"][: item["context"]])
    assert prompt == f"<|user|>\n{ROWS[0]['prompt']}[EOS]\n<|assistant|>\n"
    assert tokenizer.decode(item["ids"][item["context"] :]) == "3 + 4 = 7 #### 7[EOS]"  # no joining space
    batch = SFTObjective.collate([item], tokenizer)
    assert (batch["labels"][0] != -100).sum() == len(item["ids"]) - item["context"]


def test_chat_sft_without_a_template_and_chat_for_a_reward_model_are_refused_by_field(tokenizer):
    with pytest.raises(ConfigError, match="model.chat_template: the tokenizer has no chat template"):
        SFTObjective.encode(tokenizer, ROWS, ModelConfig(objective="sft", chat_template=True))
    with pytest.raises(FieldError, match="chat_template.*sft only"):
        ModelConfig(objective="reward_model", chat_template=True)


def test_a_long_chat_prompt_keeps_its_end_and_the_whole_answer(tokenizer):
    tokenizer.chat_template = TEMPLATE
    try:
        cfg = ModelConfig(objective="sft", max_length=16, chat_template=True)
        [item] = SFTObjective.encode(tokenizer, ROWS, cfg)
    finally:
        tokenizer.chat_template = None
    assert len(item["ids"]) == 16
    assert tokenizer.decode(item["ids"][item["context"] :]) == "3 + 4 = 7 #### 7[EOS]"

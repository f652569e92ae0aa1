"""The generation evaluator, in this process: metrics against brute force, seeds, bad input."""

import itertools
import json
import re
from math import comb

import pytest

from areal_eval.checkpoints.manifest import CheckpointError
from areal_eval.data.preference_data import DataError
from areal_eval.evaluation import generation
from areal_eval.evaluation.generation import GenerationConfig, majority_reward, pass_at_k, sample_seed
from areal_eval.evaluation.lm_loss import LMLossConfig
from tests.helpers import causal_metrics

SAMPLING = GenerationConfig(n_samples=4, temperature=1.0, top_p=0.95, k=[1, 2, 4], max_new_tokens=16)


@pytest.mark.parametrize("n,k", [(4, 1), (4, 2), (4, 4), (5, 3)])
def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_pass(n, k):
    for correct in range(n + 1):
        passes = [i < correct for i in range(n)]
        subsets = list(itertools.combinations(passes, k))
        assert pass_at_k(n, correct, k) == pytest.approx(sum(any(s) for s in subsets) / comb(n, k))


def test_majority_vote_takes_the_most_frequent_answer_first_seen_on_ties_and_ignores_empty_ones():
    assert majority_reward(["7", "8", "8", "7"], [1.0, 0.0, 0.0, 1.0]) == 1.0  # tie: 7 came first
    assert majority_reward(["", "", "8"], [0.0, 0.0, 1.0]) == 1.0
    assert majority_reward(["", ""], [1.0, 1.0]) == 0.0


def test_each_sample_has_its_own_seed_from_seed_prompt_and_index():
    seeds = {sample_seed(s, p, j) for s in (0, 1) for p in range(20) for j in range(4)}
    assert len(seeds) == 160 and sample_seed(0, 3, 1) == sample_seed(0, 3, 1)


def test_greedy_metrics_count_every_prompt_once(causal_checkpoint):
    checkpoint, prompts = causal_checkpoint
    m = causal_metrics(checkpoint, prompts)
    assert m["n_prompts"] == m["n_answers"] == 41
    assert 0.05 < m["accuracy"] < 0.95  # half-trained: the test sees both outcomes
    assert m["accuracy"] * 41 == pytest.approx(round(m["accuracy"] * 41))
    # The sample variance (n - 1), as lm-evaluation-harness: of 0/1 values, p(1 - p) n / (n - 1).
    assert m["accuracy_stderr"] == pytest.approx((m["accuracy"] * (1 - m["accuracy"]) / 40) ** 0.5, rel=1e-12)
    assert m["truncated_prompts"] == 0 and m["reward_errors"] == 0
    assert m["truncation_rate"] == 0.0 and 5 < m["response_length"] < 16


def test_sampled_metrics_do_not_depend_on_the_batch(causal_checkpoint):
    checkpoint, prompts = causal_checkpoint
    by_batch = [causal_metrics(checkpoint, prompts, batch_size=b, generation=SAMPLING) for b in (5, 41 * 5)]
    assert by_batch[0] == pytest.approx(by_batch[1], abs=1e-9)
    m = by_batch[0]
    assert m["n_answers"] == 41 * 5  # a greedy answer and 4 samples per prompt
    assert m["pass_at_1"] == pytest.approx(m["mean_reward"])  # pass@1 is the mean sample reward
    assert m["pass_at_1"] <= m["pass_at_2"] <= m["pass_at_4"]
    assert m["pass_at_4"] > m["accuracy"] * 0.9
    greedy = causal_metrics(checkpoint, prompts, generation=GenerationConfig(max_new_tokens=16))
    assert m["accuracy"] == greedy["accuracy"]  # greedy rows beside sampled ones decode alike
    other_seed = causal_metrics(checkpoint, prompts, generation=GenerationConfig(**{**vars(SAMPLING), "seed": 1}))
    # Another seed draws other answers: their lengths and rewards move (not every count need).
    assert (other_seed["response_length"], other_seed["mean_reward"]) != (m["response_length"], m["mean_reward"])


def test_an_answer_that_reaches_max_new_tokens_is_truncated(causal_checkpoint):
    checkpoint, prompts = causal_checkpoint
    m = causal_metrics(checkpoint, prompts, generation=GenerationConfig(max_new_tokens=3))
    assert m["truncation_rate"] == 1.0 and m["response_length"] == 3.0
    stopped = causal_metrics(checkpoint, prompts, generation=GenerationConfig(stop=["="], reward="exact_match"))
    assert stopped["truncation_rate"] == 0.0 and stopped["accuracy"] == 0.0  # cut before the answer


def failing_reward(prompt, completions, prompt_ids, completion_ids, answer, **kwargs):
    if "1" in completions:
        raise RuntimeError("verifier crashed")
    return 1.0


def test_a_reward_that_raises_scores_zero_is_counted_and_its_first_error_is_told(causal_checkpoint, capfd):
    from areal_eval import distributed
    from areal_eval.evaluation.worker import compute_sums, evaluation_notes

    checkpoint, prompts = causal_checkpoint
    cfg = GenerationConfig(reward=f"{__name__}.failing_reward")
    evaluator = generation.GenerationEvaluator(cfg)
    evaluator.load(checkpoint, prompts)
    sums = compute_sums(evaluator, distributed.ParallelLayout(1, 0, 1), 7)
    m = evaluator.metrics(sums)
    assert 0 < m["reward_errors"] < 41
    assert m["accuracy"] == pytest.approx((41 - m["reward_errors"]) / 41)
    [note] = evaluation_notes(evaluator, sums)
    assert re.fullmatch(
        rf"first error: reward '{__name__}.failing_reward' raised on prompt \d+ \({prompts}:\d+\): "
        "RuntimeError: verifier crashed",
        note,
    )
    log = capfd.readouterr().err  # the job's log: the traceback, once
    assert log.count("Traceback (most recent call last)") == 1 and 'raise RuntimeError("verifier crashed")' in log


def test_prompts_cut_to_max_prompt_tokens_are_counted_and_a_budget_over_the_models_positions_is_refused(
    causal_checkpoint,
):
    from areal_eval.config.parsing import ConfigError

    checkpoint, prompts = causal_checkpoint
    m = causal_metrics(checkpoint, prompts, generation=GenerationConfig(max_prompt_tokens=6, max_new_tokens=4))
    assert m["truncated_prompts"] == 41  # every prompt is longer than 6 tokens
    evaluator = generation.GenerationEvaluator(GenerationConfig(max_prompt_tokens=6, max_new_tokens=4))
    evaluator.load(checkpoint, prompts)
    assert evaluator.warnings({"truncated_prompts": 41.0, "n_prompts": 41.0}) == [
        "41 of 41 prompts were longer than max_prompt_tokens (6 tokens) and kept their end (metric truncated_prompts)"
    ]
    fitted = generation.GenerationEvaluator(GenerationConfig(max_new_tokens=24))
    fitted.load(checkpoint, prompts)
    assert fitted.max_prompt_tokens == 128 - 24  # unset: what the model's 128 positions leave
    over = generation.GenerationEvaluator(GenerationConfig(max_prompt_tokens=256, max_new_tokens=24))
    with pytest.raises(
        ConfigError, match=r"max_prompt_tokens \(256\) \+ max_new_tokens \(24\) = 280 exceed the model's 128"
    ):
        over.load(checkpoint, prompts)


def test_a_reward_that_does_not_import_names_its_dotted_path_before_anything_starts():
    from areal_eval.config.parsing import ConfigError
    from areal_eval.pipeline.config import load_pipeline_config

    with pytest.raises(ValueError, match="'no_such_module.reward' cannot be imported"):
        generation.GenerationEvaluator(GenerationConfig(reward="no_such_module.reward"))
    overrides = ["eval.evaluator=generation", "eval.generation.reward=no_such_module.reward"]
    with pytest.raises(ConfigError, match="^eval.generation.reward: reward function 'no_such_module.reward'"):
        load_pipeline_config(overrides=overrides)


def test_a_prompt_without_an_answer_names_file_and_line(causal_checkpoint, tmp_path):
    checkpoint, _ = causal_checkpoint
    bad = tmp_path / "prompts.jsonl"
    bad.write_text(json.dumps({"prompt": "Q: 1 + 1?\nA:", "answer": "2"}) + "\n\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(DataError, match=rf"{bad}:3: no 'answer'"):
        causal_metrics(checkpoint, bad)


def test_gsm8k_rows_are_read_as_prompts(causal_checkpoint, tmp_path):
    checkpoint, _ = causal_checkpoint
    rows = tmp_path / "gsm8k.jsonl"
    rows.write_text(json.dumps({"question": "Q: Ann has 2 coins and gets 3 more. How many?\nA:", "answer": "#### 5"}))
    assert causal_metrics(checkpoint, rows)["n_prompts"] == 1


def test_a_reward_model_checkpoint_is_refused_with_the_reason(trained_run_free_reward_model):
    with pytest.raises(CheckpointError, match="ForSequenceClassification, a classifier"):
        causal_metrics(*trained_run_free_reward_model)


@pytest.fixture
def trained_run_free_reward_model(tmp_path):
    """A fresh reward model saved as a checkpoint, with one prompt to evaluate."""
    from areal_eval.models import reward_model
    from areal_eval.models.objectives import ModelConfig

    tokenizer = reward_model.train_tokenizer(["a b c d"], tmp_path / "tok", vocab_size=32)
    model = reward_model.build_model(ModelConfig(hidden_size=16, num_layers=1, num_heads=2), tokenizer)
    model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b", "answer": "c"}) + "\n")
    return tmp_path / "rm", prompts


def test_settings_that_cannot_work_are_refused_by_field():
    from areal_eval.config.parsing import FieldError

    with pytest.raises(FieldError, match="n_samples.*temperature"):
        GenerationConfig(n_samples=4)
    with pytest.raises(FieldError, match="k.*n_samples"):
        GenerationConfig(n_samples=2, temperature=1.0, k=[4])
    with pytest.raises(FieldError, match="top_p"):
        GenerationConfig(top_p=0.0)


def test_the_chat_template_wraps_each_prompt(causal_checkpoint, tmp_path):
    """A tokenizer whose template adds the demo's "Q: ...\\nA:" frame: bare questions under it score
    as the framed prompts do without it."""
    import shutil

    from areal_eval.models import causal_lm

    checkpoint, prompts = causal_checkpoint
    templated = tmp_path / "templated"
    shutil.copytree(checkpoint, templated)
    tokenizer = causal_lm.load_tokenizer(templated)
    tokenizer.chat_template = "{% for m in messages %}Q: {{ m['content'] }}\nA:{% endfor %}"
    tokenizer.save_pretrained(templated)
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps({**r, "prompt": r["prompt"][3:-3]}) + "\n" for r in rows))
    assert rows[0]["prompt"].startswith("Q: ") and rows[0]["prompt"].endswith("\nA:")
    framed = causal_metrics(checkpoint, prompts)
    assert causal_metrics(templated, bare, generation=GenerationConfig(chat_template=True)) == framed
    with pytest.raises(ValueError, match="has no chat template"):
        causal_metrics(checkpoint, bare, generation=GenerationConfig(chat_template=True))


def test_evaluators_in_one_job_load_the_model_once(causal_checkpoint, monkeypatch):
    from areal_eval.models import causal_lm

    checkpoint, prompts = causal_checkpoint
    loads = []
    load_model = causal_lm.load_model
    monkeypatch.setattr(causal_lm, "load_model", lambda *a, **k: loads.append(a) or load_model(*a, **k))
    causal_metrics(checkpoint, prompts, "generation,lm_loss", lm_loss=LMLossConfig(completion_field="answer"))
    assert len(loads) == 1


def test_a_probe_subset_and_the_rest_add_up_to_the_whole_set_sampled_answers_included(causal_checkpoint):
    """With probes a full evaluation scores the probe subset and the rest apart: a prompt keeps
    its index (its sampling seeds), so the two add up to the whole set's metrics."""
    from pathlib import Path

    from areal_eval import distributed
    from areal_eval.evaluation.evaluators import make_evaluator
    from areal_eval.evaluation.job_spec import EvaluatorSettings
    from areal_eval.evaluation.worker import compute_metrics, compute_with_probe

    checkpoint, prompts = causal_checkpoint
    settings = EvaluatorSettings(generation=SAMPLING, lm_loss=LMLossConfig(completion_field="answer"))
    evaluator = make_evaluator("generation,lm_loss", settings)
    evaluator.load(Path(checkpoint), Path(prompts))
    layout = distributed.ParallelLayout(1, 0, 1)
    whole = compute_metrics(evaluator, layout, 7)
    metrics, probe = compute_with_probe(evaluator, layout, 7, fraction=0.25, probe_only=False)
    generated = {k: v for k, v in whole.items() if k.startswith("generation/")}
    assert {k: v for k, v in metrics.items() if k.startswith("generation/")} == pytest.approx(generated, rel=1e-12)
    # Losses come from forward passes over other batches: equal to float32's last bits.
    assert metrics == pytest.approx(whole, rel=1e-6)
    assert probe["generation/n_prompts"] == probe["lm_loss/n_texts"] == 10  # a quarter of 41 prompts
    assert compute_with_probe(evaluator, layout, 7, fraction=0.25, probe_only=True) == ({}, probe)


def copy_with_generation_config(checkpoint, target, **settings):
    import shutil

    copy = shutil.copytree(checkpoint, target)
    (copy / "generation_config.json").write_text(json.dumps(settings))
    return copy


def test_the_checkpoints_own_generation_settings_do_not_change_the_answers(causal_checkpoint, tmp_path):
    """A chat model's generation_config.json carries its sampling preferences (Qwen's a repetition
    penalty); the evaluation's settings alone decide, on both backends."""
    checkpoint, prompts = causal_checkpoint
    own = copy_with_generation_config(
        checkpoint, tmp_path / "own", repetition_penalty=10.0, no_repeat_ngram_size=1, do_sample=True, top_k=1
    )
    greedy = GenerationConfig(max_new_tokens=16)
    for decoding in (greedy, SAMPLING):
        expected, expected_items = causal_metrics(checkpoint, prompts, items=True, generation=decoding)
        got, got_items = causal_metrics(own, prompts, items=True, generation=decoding)
        assert got == expected and got_items == expected_items


def test_an_answer_ends_at_any_end_token_the_generation_config_names(causal_checkpoint, tmp_path):
    """Llama 3 and Qwen chat models name more than one end token there; generate and vLLM stop on
    each of them, and the answer ends there, not truncated."""
    from collections import Counter

    from areal_eval.evaluation.decoders import completion_from, end_token_ids
    from areal_eval.models import causal_lm

    checkpoint, prompts = causal_checkpoint
    tok = causal_lm.load_tokenizer(checkpoint)
    greedy = GenerationConfig(max_new_tokens=16)
    plain, rows = causal_metrics(checkpoint, prompts, items=True, generation=greedy)
    answers = [r["answer"] for r in rows["generation"] if r["greedy"]]
    [(common, _)] = Counter(t for a in answers for t in tok(a, add_special_tokens=False)["input_ids"]).most_common(1)
    ended = copy_with_generation_config(checkpoint, tmp_path / "ended", eos_token_id=[tok.eos_token_id, common])
    cut, _ = causal_metrics(ended, prompts, items=True, generation=greedy)
    assert cut["truncation_rate"] == plain["truncation_rate"] == 0.0
    assert cut["response_length"] < plain["response_length"] and cut["n_answers"] == plain["n_answers"]
    ends = end_token_ids(tok, causal_lm.load_model(ended).generation_config)
    assert ends == (tok.eos_token_id, common)
    answer = completion_from(tok, greedy, [5, common, 7, tok.eos_token_id], ends)
    assert answer.token_ids == [5] and not answer.truncated

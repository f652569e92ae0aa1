"""Reward functions: the built-ins and loading by dotted path."""

import pytest

from areal_eval.evaluation import rewards


def test_math_reward_checks_the_answer_with_math_verify():
    assert rewards.math("q", " 3 + 4 = 7 #### 7", [], [], " 3 + 4 = 7 #### 7") == 1.0
    assert rewards.math("q", "so the answer is 1/2", [], [], "#### 0.5") == 1.0
    assert rewards.math("q", " 3 + 4 = 8 #### 8", [], [], "#### 7") == 0.0
    assert rewards.math("q", "no number here", [], [], "#### 7") == 0.0


def test_exact_match_compares_the_normalised_final_answer():
    assert rewards.exact_match("q", "It is #### 1,234.", [], [], "#### 1234") == 1.0
    assert rewards.exact_match("q", "Paris ", [], [], "paris") == 1.0
    assert rewards.exact_match("q", "#### 12", [], [], "#### 1234") == 0.0


def test_rewards_load_by_name_or_dotted_path_with_areal_signature():
    assert rewards.load_reward("math")[0] is rewards.math
    fn, key = rewards.load_reward("areal_eval.evaluation.rewards.exact_match")
    assert fn is rewards.exact_match and key("x #### 5") == "5"
    assert rewards.load_reward("areal_eval.evaluation.rewards:exact_match")[0] is rewards.exact_match
    with pytest.raises(ValueError, match="'areal_eval.evaluation.rewards.nope' cannot be imported"):
        rewards.load_reward("areal_eval.evaluation.rewards.nope")
    with pytest.raises(ValueError, match="'nope' cannot be imported"):
        rewards.load_reward("nope")

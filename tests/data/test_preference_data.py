import json
import re

import pytest

from areal_eval.data.preference_data import DataError, SyntheticPreferences, read_pairs

GOOD = "helpful clear accurate kind polite precise thorough honest safe correct".split()
BAD = "rude wrong vague harmful lazy false sloppy unsafe careless mean".split()


def net(text):
    words = text.split("Assistant:")[1].split()
    return sum(w in GOOD for w in words) - sum(w in BAD for w in words)


def test_malformed_row_names_file_and_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"chosen": "a", "rejected": "b"}\n\n{"chosen": "a", "rejected": \n')
    with pytest.raises(DataError, match=re.escape(f"{path}:3")):
        read_pairs(path)


def test_missing_field_names_file_line_and_field(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"chosen": "a", "rejected": "b"}\n{"chosen": "a"}\n')
    with pytest.raises(DataError, match=re.escape(f"{path}:2: field 'rejected'")):
        read_pairs(path)


def test_empty_file_is_an_error(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n")
    with pytest.raises(DataError, match="no preference pairs"):
        read_pairs(path)


def test_synthetic_set_is_learnable_but_noisy(tmp_path):
    cfg = SyntheticPreferences.Config(train_pairs=2000, valid_pairs=11, label_noise=0.15, seed=3)
    train, valid = SyntheticPreferences(cfg).generate(tmp_path)
    pairs = read_pairs(train)
    assert len(pairs) == 2000 and len(read_pairs(valid)) == 11
    # The rule (more net good words wins) explains the labels up to the label noise.
    agree = sum(net(p["chosen"]) > net(p["rejected"]) for p in pairs) / len(pairs)
    assert 0.80 < agree < 0.90
    assert all(p["chosen"].startswith("\n\nHuman:") and "\n\nAssistant:" in p["rejected"] for p in pairs)


def test_generator_is_deterministic(tmp_path):
    cfg = SyntheticPreferences.Config(train_pairs=20, valid_pairs=5, seed=7)
    a = SyntheticPreferences(cfg).generate(tmp_path / "a")[0].read_text()
    b = SyntheticPreferences(cfg).generate(tmp_path / "b")[0].read_text()
    assert a == b and json.loads(a.splitlines()[0])

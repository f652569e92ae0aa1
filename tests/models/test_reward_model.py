import math

import pytest
import torch

from areal_eval.checkpoints.manifest import CheckpointError
from areal_eval.data.preference_data import SyntheticPreferences, read_pairs
from areal_eval.models import causal_lm, reward_model
from areal_eval.models.objectives import ModelConfig


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    corpus = ["\n\nHuman: hello there\n\nAssistant: kind words here", "rude wrong answer"] * 5
    reward_model.train_tokenizer(corpus, out, vocab_size=64)
    return reward_model.load_tokenizer(out)


def test_model_is_a_one_label_sequence_classifier(tokenizer):
    model = reward_model.build_model(ModelConfig(hidden_size=16, num_layers=1, num_heads=2), tokenizer)
    assert model.config.num_labels == 1
    items = reward_model.tokenize_pairs(tokenizer, [{"chosen": "kind words", "rejected": "rude wrong answer here"}], 64)
    batch = reward_model.collate_pairs(items, tokenizer.pad_token_id)
    assert batch["input_ids"].shape[0] == 2
    chosen, rejected = reward_model.pair_scores(model, batch)
    assert chosen.shape == rejected.shape == (1,)


def test_right_padding_does_not_change_scores(tokenizer):
    model = reward_model.build_model(ModelConfig(hidden_size=16, num_layers=1, num_heads=2), tokenizer).eval()
    short = {"chosen": "kind words", "rejected": "rude"}
    long = {"chosen": "kind words here there hello", "rejected": "rude wrong answer here there"}
    alone = reward_model.pair_scores(
        model, reward_model.collate_pairs(reward_model.tokenize_pairs(tokenizer, [short], 64), 0)
    )
    padded = reward_model.pair_scores(
        model, reward_model.collate_pairs(reward_model.tokenize_pairs(tokenizer, [short, long], 64), 0)
    )
    assert torch.allclose(alone[0], padded[0][:1], atol=1e-5)


def test_trimmed_scoring_matches_plain_scoring(tokenizer):
    model = reward_model.build_model(ModelConfig(hidden_size=16, num_layers=1, num_heads=2), tokenizer).eval()
    pairs = [{"chosen": "kind " * n, "rejected": "rude wrong " * (7 - n)} for n in range(1, 7)]
    batch = reward_model.collate_pairs(reward_model.tokenize_pairs(tokenizer, pairs, 64), tokenizer.pad_token_id)
    with torch.inference_mode():
        plain = reward_model.pair_scores(model, batch)
        trimmed = reward_model.pair_scores_trimmed(model, batch, chunks=3)
    assert trimmed[0].dtype == torch.float64  # scores leave the model as float64, whatever its dtype
    assert torch.allclose(plain[0].double(), trimmed[0], atol=1e-5)
    assert torch.allclose(plain[1].double(), trimmed[1], atol=1e-5)


def test_bradley_terry_loss():
    loss = reward_model.bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0]))
    expected = (math.log1p(math.exp(-2.0)) + math.log(2)) / 2
    assert loss.item() == pytest.approx(expected)


def test_save_and_load_from_a_local_path(tokenizer, tmp_path):
    model = reward_model.build_model(ModelConfig(hidden_size=16, num_layers=1, num_heads=2), tokenizer)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = reward_model.load_model(tmp_path)
    assert torch.equal(loaded.score.weight, model.score.weight)
    assert reward_model.load_tokenizer(tmp_path).pad_token_id == tokenizer.pad_token_id


def test_pickle_checkpoints_are_refused_unless_allowed(tokenizer, tmp_path):
    model = reward_model.build_model(ModelConfig(hidden_size=16, num_layers=1, num_heads=2), tokenizer)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")  # a pickle checkpoint
    with pytest.raises(CheckpointError, match="allow_pickle"):
        reward_model.load_model(tmp_path)
    loaded = reward_model.load_model(tmp_path, allow_pickle=True)
    assert torch.equal(loaded.score.weight, model.score.weight)


def test_tokenizer_trained_locally_covers_the_synthetic_vocabulary(tmp_path):
    SyntheticPreferences(SyntheticPreferences.Config(train_pairs=50, valid_pairs=3)).generate(tmp_path)
    from areal_eval.data.preference_data import read_pairs

    tok = reward_model.train_tokenizer(
        SyntheticPreferences.corpus(read_pairs(tmp_path / "train.jsonl")), tmp_path / "tok"
    )
    ids = tok("tell me about the garden please", add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids


def test_a_text_with_no_tokens_is_refused_naming_its_line(tmp_path):
    import json

    from areal_eval.data.preference_data import DataError

    tokenizer = reward_model.train_tokenizer(["kind words rude"], tmp_path / "tok", 32)
    source = tmp_path / "pairs.jsonl"
    pairs = [{"chosen": "kind", "rejected": "rude"}, {"chosen": "kind", "rejected": " "}]
    source.write_text("\n" + "".join(json.dumps(p) + "\n" for p in pairs))  # a blank first line
    with pytest.raises(DataError, match=rf"{source}:3: field 'rejected' has no tokens"):
        reward_model.tokenize_pairs(tokenizer, pairs, 64, source)


def test_in_bf16_the_score_head_stays_float32_and_close_scores_keep_their_order(tmp_path):
    """A few training steps put every score near 4.8, where bf16 has a step of 0.03, while pairs
    differ by hundredths: computed in bf16, 0.31 of the pairs came out right against 0.78 in
    float32. With the head in float32 the two agree."""
    import random

    train, valid = SyntheticPreferences(SyntheticPreferences.Config(200, 64)).generate(tmp_path / "data")
    pairs = read_pairs(train)
    causal_lm.train_tokenizer([t for p in pairs for t in (p["chosen"], p["rejected"])], tmp_path / "tok", 512)
    tok = reward_model.load_tokenizer(tmp_path / "tok")
    torch.manual_seed(0)
    model = reward_model.build_model(ModelConfig(hidden_size=256, num_layers=4, num_heads=4), tok)
    encoded, rng = reward_model.tokenize_pairs(tok, pairs, 64), random.Random(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for _ in range(4):
        batch = reward_model.collate_pairs(rng.sample(encoded, 32), tok.pad_token_id)
        reward_model.bradley_terry_loss(*reward_model.pair_scores(model, batch)).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(tmp_path / "ckpt")

    batch = reward_model.collate_pairs(reward_model.tokenize_pairs(tok, read_pairs(valid), 64), tok.pad_token_id)
    margins, chosen = {}, {}
    for dtype in ("float32", "bfloat16"):
        loaded = reward_model.load_model(tmp_path / "ckpt", dtype=dtype).eval()
        with torch.inference_mode():
            chosen[dtype], rejected = reward_model.pair_scores_trimmed(loaded, batch)
        margins[dtype] = chosen[dtype] - rejected
    assert 4 < float(chosen["float32"].mean()) < 6  # the offset bf16 cannot resolve
    # The hidden states' own bf16 rounding moves a margin by up to 0.004 here (how far depends on
    # the CPU's bf16 kernels); bf16 scores step by 0.031.
    assert torch.allclose(margins["bfloat16"], margins["float32"], atol=0.008)
    alike = (margins["bfloat16"] > 0) == (margins["float32"] > 0)
    assert float(alike.float().mean()) >= 0.95  # a bf16 head ranked 0.31 of the pairs right
    clear = margins["float32"].abs() > 0.008  # beyond what that rounding can move: ranked alike, all
    assert bool(alike[clear].all())
    assert loaded.score.weight.dtype == torch.float32 and loaded.model.embed_tokens.weight.dtype == torch.bfloat16

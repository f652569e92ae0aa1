import json

import pytest
import torch

from areal_eval.checkpoint import CheckpointWriter
from areal_eval.checkpoint_files import describe_files, verify_checkpoint
from areal_eval.manifest import CheckpointError, CheckpointEvent, Manifest


class TinyModel(torch.nn.Module):
    """Stands in for a transformers model: has save_pretrained with state_dict=."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))

    def save_pretrained(self, path, state_dict, safe_serialization=True):
        from safetensors.torch import save_file

        save_file(state_dict, f"{path}/model.safetensors")


class NoTokenizer:
    def save_pretrained(self, path):
        (__import__("pathlib").Path(path) / "tokenizer.json").write_text("{}")


def test_writer_announces_only_durable_checkpoints(tmp_path):
    manifest = Manifest(tmp_path / "manifest.jsonl")
    seen = []

    def on_durable(event):
        # When announced, the directory is complete and matches the recorded hashes.
        verify_checkpoint(event.uri, event.files)
        seen.append(event.global_step)

    model = TinyModel()
    writer = CheckpointWriter(model, NoTokenizer(), tmp_path / "ckpt", manifest, "run-1", on_durable)
    writer.save(0, 0, 0, {})
    with torch.no_grad():
        model.w.add_(1.0)  # the snapshot was taken: later updates do not leak into step 0
    writer.save(0, 5, 5, {"loss": 0.5}, final=True)
    writer.close()
    events = manifest.events()
    assert [e.global_step for e in events] == seen == [0, 5]
    assert events[1].final and events[1].train_metrics == {"loss": 0.5}
    from safetensors.torch import load_file

    assert torch.equal(load_file(f"{events[0].uri}/model.safetensors")["w"], torch.ones(4))
    assert {f.name for f in events[0].files} == {"model.safetensors", "tokenizer.json"}
    assert not list((tmp_path / "ckpt").glob(".*partial"))


def test_verify_detects_missing_truncated_and_corrupt(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"x" * 100)
    files = describe_files(d)
    verify_checkpoint(d, files)
    (d / "model.safetensors").write_bytes(b"x" * 99)
    with pytest.raises(CheckpointError, match="model.safetensors: size 99 != recorded 100"):
        verify_checkpoint(d, files)
    (d / "model.safetensors").write_bytes(b"y" * 100)
    with pytest.raises(CheckpointError, match="model.safetensors: sha256 differs"):
        verify_checkpoint(d, files)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        verify_checkpoint(d, files)
    with pytest.raises(CheckpointError, match="directory is missing"):
        verify_checkpoint(tmp_path / "nope", files)


def test_manifest_follower_skips_a_torn_last_line(tmp_path):
    m = Manifest(tmp_path / "m.jsonl")
    ev = CheckpointEvent("r", "/x", 0, 0, 3, 1.0, {})
    m.append(ev)
    line = ev.to_json()
    with m.path.open("a") as fh:
        fh.write(line[:10])  # a writer mid-line
    events, offset = m.read_from(0)
    assert events == [ev]
    with m.path.open("a") as fh:
        fh.write(line[10:] + "\n")
    more, _ = m.read_from(offset)
    assert len(more) == 1


def test_bad_manifest_line_is_a_clear_error(tmp_path):
    m = Manifest(tmp_path / "m.jsonl")
    m.path.write_text("not json\n")
    with pytest.raises(CheckpointError, match="m.jsonl"):
        m.events()


def test_event_payload_round_trip():
    ev = CheckpointEvent("r", "/x", 1, 2, 3, 4.0, {"loss": 1.0}, final=True)
    assert CheckpointEvent.from_dict(json.loads(ev.to_json())) == ev
    assert ev.payload()["global_step"] == 3 and "files" not in ev.payload()

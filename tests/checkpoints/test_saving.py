import json

import pytest
import torch

from areal_eval.checkpoints.manifest import (
    CheckpointError,
    CheckpointEvent,
    Manifest,
    describe_files,
    verify_checkpoint,
)
from areal_eval.checkpoints.saving import CheckpointWriter
from tests.helpers import NoTokenizer, TinyModel


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


def test_a_bad_step_or_metric_is_refused_in_save_not_later_in_the_writer_thread(tmp_path):
    import pytest

    manifest = Manifest(tmp_path / "manifest.jsonl")
    writer = CheckpointWriter(TinyModel(), NoTokenizer(), tmp_path / "ckpt", manifest, "run-1")
    with pytest.raises(ValueError, match="global_step: a non-negative integer, got 2.5"):
        writer.save(0, 0, 2.5, {})
    with pytest.raises(ValueError, match=r"train_metrics\['loss'\]"):
        writer.save(0, 3, 3, {"loss": torch.ones(2)})
    writer.save(0, 4, 4, {"loss": torch.tensor(0.5)})
    writer.close()  # nothing failed in the thread: the refused saves were never queued
    assert [(e.global_step, e.train_metrics) for e in manifest.events()] == [(4, {"loss": 0.5})]


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
    chunk = m.read(0)
    assert chunk.events == [ev] and not chunk.problems
    with m.path.open("a") as fh:
        fh.write(line[10:] + "\n")
    assert len(m.read(chunk.offset, chunk.line).events) == 1


def test_a_line_torn_by_a_crashed_writer_is_skipped_and_later_entries_read(tmp_path):
    m = Manifest(tmp_path / "m.jsonl")
    events = [CheckpointEvent("r", f"/x/{s}", 0, s, s, 1.0, {}) for s in (0, 25, 50, 75)]
    for ev in events[:3]:
        m.append(ev)
    with m.path.open("a") as fh:
        fh.write(events[3].to_json()[:40])  # the writer died here
    m.append(events[3])  # the restarted writer starts a fresh line: nothing glued on
    chunk = m.read()
    assert chunk.events == events
    assert chunk.problems == [f"{m.path}:4: " + chunk.problems[0].split(":4: ", 1)[1]]
    assert "torn or corrupt" in chunk.problems[0]
    assert m.events() == events


def test_entries_of_another_run_are_rejected_and_reported(tmp_path):
    from areal_eval.lifecycle.followers import ManifestFollower

    m = Manifest(tmp_path / "m.jsonl")
    m.append(CheckpointEvent("mine", "/x/0", 0, 0, 0, 1.0, {}))
    m.append(CheckpointEvent("other", "/y/12", 0, 12, 12, 1.0, {}, final=True))
    follower = ManifestFollower(m, run_id="mine")
    assert [e.global_step for e in follower.poll()] == [0]
    [problem] = follower.take_problems()
    assert problem.startswith(f"{m.path}:2: entry for run 'other'") and follower.take_problems() == []


def test_missing_manifest_says_so(tmp_path):
    with pytest.raises(CheckpointError, match="no such manifest file"):
        Manifest(tmp_path / "nope.jsonl").find(100)


def test_event_payload_round_trip():
    ev = CheckpointEvent("r", "/x", 1, 2, 3, 4.0, {"loss": 1.0}, final=True)
    assert CheckpointEvent.from_dict(json.loads(ev.to_json())) == ev
    assert ev.payload()["global_step"] == 3 and "files" not in ev.payload()

"""Following the manifest and the training log as they grow."""

import threading

from areal_eval.checkpoints.manifest import CheckpointEvent, Manifest
from areal_eval.lifecycle.followers import JsonlFollower, ManifestFollower


def ev(step):
    return CheckpointEvent("r", f"/c/{step}", 0, step, step, 0.0, {})


def test_jsonl_follower_reads_only_complete_lines(tmp_path):
    path = tmp_path / "log.jsonl"
    f = JsonlFollower(path)
    assert f.poll() == []
    path.write_text('{"step": 1}\n{"step": 2')
    assert f.poll() == [{"step": 1}]
    with path.open("a") as fh:
        fh.write("}\n")
    assert f.poll() == [{"step": 2}]


def test_manifest_follower_wakes_when_the_manifest_grows(tmp_path):
    manifest = Manifest(tmp_path / "m.jsonl")
    follower = ManifestFollower(manifest)
    follower.wait(0.01)  # no file yet: returns after the timeout
    threading.Timer(0.05, manifest.append, args=(ev(7),)).start()
    follower.wait(30)  # returns once the line is there, long before 30 s
    assert [e.global_step for e in follower.poll()] == [7]

"""Job specs: one typed JSON file per job, parsed strictly on the worker's side."""

import json

import pytest

from areal_eval.checkpoints.manifest import FileEntry
from areal_eval.checkpoints.store import S3Config
from areal_eval.config.parsing import ConfigError
from areal_eval.evaluation.job_spec import EvalJobSpec, read_spec, write_spec


def test_a_spec_round_trips_with_its_nested_types(tmp_path):
    spec = EvalJobSpec(
        checkpoint="s3://b/run/global_step_00000004",
        data="valid.jsonl",
        out="r.json",
        files=[FileEntry("model.safetensors", 10, "ab" * 32)],
        s3=S3Config(endpoint_url="http://x"),
    )
    path = write_spec(tmp_path / "job.json", spec)
    assert read_spec(EvalJobSpec, path) == spec


def test_a_bad_field_is_named_with_the_file(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"checkpoint": "/c", "data": "d", "out": "o", "files": [], "mp_size": "two"}))
    with pytest.raises(ConfigError, match=rf"{path}: mp_size: expected int"):
        read_spec(EvalJobSpec, path)
    with pytest.raises(ConfigError, match="no such job spec file"):
        read_spec(EvalJobSpec, tmp_path / "missing.json")


def test_the_worker_records_a_bad_spec_in_the_result_before_joining_any_group(tmp_path):
    from areal_eval.evaluation import worker

    out = tmp_path / "result.json"
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"checkpoint": "/c", "data": "d", "out": str(out), "files": [], "batch_size": "big"}))
    assert worker.main(["--spec", str(spec)]) == 1
    assert "batch_size: expected int" in json.loads(out.read_text())["error"]
    with pytest.raises(SystemExit):  # one mode: a spec, --follow or --serve
        worker.main([])

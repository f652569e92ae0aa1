"""Sharded torch.distributed.checkpoint checkpoints from a real 2-rank FSDP2 job (gloo), published
and evaluated: ``examples/dcp_loop.py`` started under torchrun, as a user would start it."""

import subprocess
import sys
from pathlib import Path

import pytest

from areal_eval.checkpoints import dcp
from areal_eval.checkpoints.manifest import CheckpointError, Manifest
from areal_eval.evaluation.jobs import CorruptCheckpoint, EvalConfig, run_evaluation_job
from tests.helpers import single_process_metrics

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


@pytest.fixture(scope="module")
def fsdp_runs(trained_run, tmp_path_factory):
    """Two FSDP2 runs from the trained run's final checkpoint, same seed: one saving DCP's
    safetensors shards (steps 2 and 4), one DCP's default format (step 2)."""
    _, run = trained_run
    init = Manifest(run.manifest).events()[-1].uri
    work = tmp_path_factory.mktemp("fsdp")
    runs = {}
    for fmt, steps in (("hf", 4), ("distcp", 2)):
        runs[fmt] = work / f"fsdp-{fmt}"
        command = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "examples.dcp_loop", "--init", init]
        command += ["--data", str(run.train_data), "--run-dir", str(runs[fmt]), "--steps", str(steps)]
        command += ["--save-every", "2", "--format", fmt]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    return run, runs


def test_fsdp2_shards_are_published_and_two_ranks_evaluate_them_as_one_process_does(fsdp_runs, tmp_path):
    trained, runs = fsdp_runs
    events = Manifest(runs["hf"] / "manifest.jsonl").events()
    assert [(e.global_step, e.final) for e in events] == [(2, False), (4, True)]
    names = {f.name for f in events[-1].files}
    assert {"config.json", "tokenizer.json"} <= names and len([n for n in names if n.startswith("shard-")]) == 2
    assert dcp.dcp_format(events[-1].uri) == dcp.HF_SHARDS
    result = run_evaluation_job(events[-1], trained.valid_data, EvalConfig(nproc=2, batch_size=16), tmp_path)
    reference = single_process_metrics(events[-1], trained.valid_data)
    assert result.metrics == pytest.approx(reference, abs=1e-6) and result.metrics["n_pairs"] == 101
    before = single_process_metrics(Manifest(trained.manifest).events()[-1], trained.valid_data)
    assert reference["loss"] != pytest.approx(before["loss"], abs=1e-6)  # the shards hold the trained weights


def test_dcps_pickled_metadata_is_refused_unless_opted_in_and_then_loads_the_same_weights(fsdp_runs, tmp_path):
    trained, runs = fsdp_runs
    [pickled] = Manifest(runs["distcp"] / "manifest.jsonl").events()
    assert dcp.dcp_format(pickled.uri) == dcp.DISTCP and ".metadata" in {f.name for f in pickled.files}
    with pytest.raises(CorruptCheckpoint, match=r"refused: torch.distributed.checkpoint's .metadata file is a pickle"):
        run_evaluation_job(pickled, trained.valid_data, EvalConfig(nproc=1), tmp_path / "refused")
    opted_in = run_evaluation_job(pickled, trained.valid_data, EvalConfig(nproc=1, allow_pickle=True), tmp_path / "ok")
    same_step = Manifest(runs["hf"] / "manifest.jsonl").find(2)
    assert opted_in.metrics == pytest.approx(single_process_metrics(same_step, trained.valid_data), abs=1e-6)


def test_a_sharded_state_that_does_not_fit_the_model_names_the_checkpoint(fsdp_runs, tmp_path):
    import shutil

    _, runs = fsdp_runs
    broken = tmp_path / "broken"
    shutil.copytree(Manifest(runs["hf"] / "manifest.jsonl").find(4).uri, broken)
    config = (broken / "config.json").read_text()
    (broken / "config.json").write_text(config.replace('"num_hidden_layers": 1', '"num_hidden_layers": 2'))
    from areal_eval.models import reward_model

    with pytest.raises(CheckpointError, match=f"{broken}: cannot load the sharded state"):
        reward_model.load_model(broken)

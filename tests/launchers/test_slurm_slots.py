"""``eval.launcher: slurm`` on a real Slurm cluster (a controller and 2 nodes on 127.0.0.1)."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest

from areal_eval.checkpoints.manifest import checkpoint_name
from areal_eval.config.parsing import ConfigError
from areal_eval.evaluation.jobs import EvalConfig, EvaluationFailed, run_evaluation_job
from areal_eval.failures import is_permanent
from areal_eval.launchers.slurm_queue import run_jobs
from areal_eval.launchers.slurm_slots import SlurmConfig, SlurmSlots
from tests.launchers.conftest import evaluate_on, read_items

pytestmark = pytest.mark.integration

ONE_GPU = SlurmConfig(gpus_per_node=1, time_limit="10:00")


def slurm_eval(**changes) -> EvalConfig:
    return EvalConfig(**{"nproc": 1, "batch_size": 16, "launcher": "slurm", "slurm": ONE_GPU, **changes})


def test_one_node_two_nodes_a_job_per_evaluation_and_local_give_the_same_metrics_and_items(
    slurm_cluster, final_checkpoint, tmp_path
):
    run, event = final_checkpoint
    local = run_evaluation_job(event, run.valid_data, EvalConfig(nproc=2, batch_size=16), tmp_path / "local")
    cases = {"1 node": slurm_eval(nproc=2), "2 nodes": slurm_eval(nodes=2)}
    cases["a job per evaluation"] = slurm_eval(nodes=2, slurm=dataclasses.replace(ONE_GPU, keep_jobs=False))
    for name, cfg in cases.items():
        work = tmp_path / name.replace(" ", "-")
        with SlurmSlots(cfg, work, run_name="same") as slots:
            result, slot = evaluate_on(slots, event, run, work)
            again, _ = evaluate_on(slots, event, run, work)
            # One of a node's 2 GPUs each: which one is Slurm's choice (a job just cancelled may
            # still hold GPU 0 while it completes).
            assert len(slot.nodes) == cfg.nodes, (name, slot.nodes)
            assert all(n["devices"] in ("0", "1") for n in slot.nodes), (name, slot.nodes)
            recorded = json.loads((work / f"{checkpoint_name(event.global_step)}.json").read_text())
            assert recorded["devices"] == slot.nodes[0]["devices"], name  # rank 0 saw the GPU Slurm gave its node
            jobs_seen = {line.split()[0] for line in slurm_cluster.jobs()}
        assert again.metrics == result.metrics
        assert result.metrics == pytest.approx(local.metrics, abs=1e-9), name
        assert read_items(result) == read_items(local), name
        assert run_jobs("same") == [], (name, jobs_seen)  # the run's end cancelled its jobs
    assert result.metrics["n_pairs"] == 101


def test_two_slots_run_while_a_third_pends_and_a_cancelled_job_is_retried(slurm_cluster, final_checkpoint, tmp_path):
    """Each node has 2 CPUs and a slot's job asks for both: two jobs run, the third pends (and
    its evaluation waits); then a slot's job is cancelled (its nodes lost): the
    evaluation fails transient and the slot is submitted again."""
    run, event = final_checkpoint
    said: list[str] = []
    cfg = slurm_eval(slots=3, slurm=dataclasses.replace(ONE_GPU, cpus_per_node=2))
    results, errors = [], []
    with SlurmSlots(cfg, tmp_path, run_name="third", report=said.append, report_s=1.0) as slots:

        def evaluate(i):
            try:
                results.append(evaluate_on(slots, event, run, tmp_path / f"e{i}"))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=evaluate, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        states = [line.split()[2] for line in slurm_cluster.jobs()]
        assert sorted(states) == ["PENDING", "RUNNING", "RUNNING"], states

        with slots.lease() as slot:
            job = slot.job
            slurm_cluster.run("scancel", job)  # its nodes are lost between two evaluations
            with pytest.raises(EvaluationFailed, match=rf"job {job} is (CANCELLED|COMPLETING|GONE)") as info:
                run_evaluation_job(event, run.valid_data, cfg, tmp_path / "lost", workers=slot)
        assert not is_permanent(info.value)
        again, slot = evaluate_on(slots, event, run, tmp_path / "again")
        assert slot.job != job
    assert errors == [] and len(results) == 3
    assert len({r.metrics["accuracy"] for r, _ in results} | {again.metrics["accuracy"]}) == 1
    assert any("is pending; its evaluation waits for nodes" in line for line in said), said
    assert run_jobs("third") == []


def test_a_live_flow_of_the_run_keeps_its_jobs_when_another_flow_of_the_run_starts(slurm_cluster, tmp_path):
    """Two flows of one run at once (the sweep beside the service, two trigger flow runs): the
    second cancels only what a dead flow left (``test_flows_on_clusters.py``), not the first's."""
    said: list[str] = []
    with SlurmSlots(slurm_eval(), tmp_path / "first", run_name="two") as first:
        with first.lease() as slot:
            job = slot.job
        with SlurmSlots(slurm_eval(), tmp_path / "second", run_name="two", report=said.append) as second:
            with second.lease() as other:
                assert other.job != job and job in {j for j, _ in run_jobs("two")}
    assert not any("cancelled" in line for line in said), said
    assert run_jobs("two") == []


@pytest.mark.parametrize(
    ("slurm", "refusal"),
    [
        (SlurmConfig(partition="nowhere"), r"eval.slurm.partition: 'nowhere': .*(Invalid|not found|no such)"),
        (SlurmConfig(gpus_per_node=4), r"eval.slurm.gpus_per_node: 4 GPUs per node, but the largest node has 2"),
    ],
)
def test_settings_no_job_could_get_are_refused_in_one_line(slurm_cluster, tmp_path, slurm, refusal):
    with pytest.raises(ConfigError, match=refusal) as info:
        SlurmSlots(slurm_eval(slurm=slurm), tmp_path, run_name="bad")
    assert "\n" not in str(info.value)


def test_a_job_sbatch_refuses_fails_each_evaluation_permanently_in_one_line(slurm_cluster, final_checkpoint, tmp_path):
    run, event = final_checkpoint
    cfg = slurm_eval(slurm=dataclasses.replace(ONE_GPU, sbatch_args=["--constraint=no-such-feature"]))
    with SlurmSlots(cfg, tmp_path, run_name="refused") as slots:
        with pytest.raises(ConfigError, match=r"^eval.slurm: sbatch refused the slot's job: .*[Ff]eature") as info:
            evaluate_on(slots, event, run, tmp_path)
    assert is_permanent(info.value) and "\n" not in str(info.value)

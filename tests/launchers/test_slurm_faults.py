"""``eval.launcher: slurm`` left unattended: faults injected on a real Slurm cluster (a controller
and 2 nodes on 127.0.0.1) while an evaluation is in flight."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from areal_eval.config.parsing import ConfigError
from areal_eval.evaluation.jobs import EvaluationFailed, run_evaluation_job
from areal_eval.failures import is_permanent
from areal_eval.launchers.slurm_node import job_dir
from areal_eval.launchers.slurm_queue import run_jobs
from areal_eval.launchers.slurm_slots import SlurmSlots
from tests.helpers import wait_for
from tests.launchers.conftest import HERE, evaluate_on
from tests.launchers.test_slurm_slots import ONE_GPU, slurm_eval

pytestmark = pytest.mark.integration

ROOT = HERE.parents[1]
PROBE = "tests.custom_evaluator:SlowProbe"


def slowed(seconds_per_batch: float, **changes):
    """An evaluation of 7 batches, each ``seconds_per_batch`` long: faults land mid-evaluation."""
    return slurm_eval(evaluator=PROBE, env={"AREAL_TEST_SLOW_S": str(seconds_per_batch)}, **changes)


def in_flight(slot) -> bool:
    return any(job_dir(slot.dir, slot.job).glob("inbox/*.json"))


@pytest.mark.parametrize("outage", ["stopped", "down"])
def test_a_controller_away_90_s_mid_evaluation_keeps_the_job_and_every_evaluation_lands_once(
    slurm_cluster, final_checkpoint, tmp_path, outage
):
    """``stopped``: slurmctld frozen (SIGSTOP, a hung controller); ``down``: SIGTERM, started again
    90 s later (a restart, a failover). Meanwhile an evaluation runs on the kept job, another
    waits for it, and a third needs a new job (sbatch cannot reach the controller)."""
    run, event = final_checkpoint
    said: list[str] = []
    per_job = slowed(0.2, slurm=dataclasses.replace(ONE_GPU, keep_jobs=False))
    results: dict[str, object] = {}
    errors: list[BaseException] = []

    def evaluate(slots, name):
        try:
            results[name] = evaluate_on(slots, event, run, tmp_path / name)[0]
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    with (
        SlurmSlots(slowed(1.0), tmp_path / "kept", run_name=f"away-{outage}", report=said.append) as kept,
        SlurmSlots(per_job, tmp_path / "new", run_name=f"away-new-{outage}", report=said.append) as new,
    ):
        with kept.lease() as slot:
            job = slot.job
        threads = [threading.Thread(target=evaluate, args=(kept, "during"))]
        threads[0].start()
        wait_for(lambda: slot.job and in_flight(slot), 120, "the evaluation in flight")
        if outage == "stopped":
            slurm_cluster.controller.send_signal(signal.SIGSTOP)
        else:
            slurm_cluster.stop_controller()
        try:
            threads += [
                threading.Thread(target=evaluate, args=(kept, "during, queued")),
                threading.Thread(target=evaluate, args=(new, "on a new job")),
            ]
            for thread in threads[1:]:
                thread.start()
            time.sleep(90)  # the outage itself
        finally:
            if outage == "stopped":
                slurm_cluster.controller.send_signal(signal.SIGCONT)
            else:
                slurm_cluster.start_controller()
        for thread in threads:
            thread.join(600)
        evaluate(kept, "after")
        with kept.lease() as slot:
            assert slot.job == job  # the healthy job was never cancelled
    assert errors == []
    assert sorted(results) == ["after", "during", "during, queued", "on a new job"]
    assert len({r.metrics["accuracy"] for r in results.values()}) == 1
    assert any("sbatch could not submit yet" in line for line in said), said
    assert run_jobs(f"away-{outage}") == [] and run_jobs(f"away-new-{outage}") == []


def test_a_time_limit_mid_evaluation_names_timeout_and_the_agents_clean_up(slurm_cluster, final_checkpoint, tmp_path):
    """Slurm ends a job at its time limit (SIGTERM, then SIGKILL): the lost evaluation says
    TIMEOUT, not that the job is gone, and the agents remove their node-local files."""
    run, event = final_checkpoint
    cfg = slowed(20.0, job_timeout_s=600, slurm=dataclasses.replace(ONE_GPU, time_limit="1:00"))
    local = tmp_path / "node-local"
    os.environ["TMPDIR"] = str(local)  # the jobs' (sbatch hands them this environment)
    try:
        with SlurmSlots(cfg, tmp_path, run_name="limit") as slots:
            with slots.lease() as slot:
                job = slot.job
                assert list(local.glob(f"areal-eval-slurm/{job}-*/node-0"))
                with pytest.raises(EvaluationFailed, match=rf"its job {job} is TIMEOUT") as info:
                    run_evaluation_job(event, run.valid_data, cfg, tmp_path / "cut", workers=slot)
            assert not is_permanent(info.value)
            assert list(local.glob(f"areal-eval-slurm/{job}-*/node-0")) == []
    finally:
        del os.environ["TMPDIR"]


def test_a_kept_job_near_its_time_limit_is_renewed_before_it_serves_again(slurm_cluster, final_checkpoint, tmp_path):
    """A 2-minute job, evaluations bounded at 30 s (and 60 s more for the reply): once less than
    90 s are left, the job is renewed before it serves, and no evaluation is cut."""
    run, event = final_checkpoint
    said: list[str] = []
    cfg = slurm_eval(job_timeout_s=30, slurm=dataclasses.replace(ONE_GPU, time_limit="2:00"))
    with SlurmSlots(cfg, tmp_path, run_name="renew", report=said.append) as slots:
        first, slot = evaluate_on(slots, event, run, tmp_path / "first")
        job, results = slot.job, []
        while slot.job == job and len(results) < 200:  # the job would reach its limit at 120
            time.sleep(1.0)  # a checkpoint a second
            results.append(evaluate_on(slots, event, run, tmp_path / f"again-{len(results)}")[0])
        assert slot.job != job
    assert all(r.metrics == first.metrics for r in results)
    assert any("renewed before its time limit" in line for line in said), said
    assert run_jobs("renew") == []


@pytest.mark.parametrize(
    ("changes", "refusal"),
    [
        (  # the partition's MaxTime is a minute
            {"slurm": dataclasses.replace(ONE_GPU, partition="short", time_limit="10:00")},
            r"^eval.slurm.time_limit: job \d+ can never start \(PartitionTimeLimit\)$",
        ),
        (  # the system's: no areal_eval, no torch
            {"python": "/usr/bin/python3"},
            r"^eval.slurm: node n\d: eval.python '/usr/bin/python3' cannot import .*torch",
        ),
    ],
    ids=["partition-time-limit", "node-python"],
)
def test_a_slot_no_job_could_serve_is_refused_in_one_line_and_its_job_cancelled(
    slurm_cluster, tmp_path, changes, refusal
):
    with SlurmSlots(slurm_eval(**changes), tmp_path, run_name="refused") as slots:
        with pytest.raises(ConfigError, match=refusal):
            with slots.lease():
                pass
    assert run_jobs("refused") == []


def test_the_flows_environment_reaches_the_ranks(slurm_cluster, final_checkpoint, tmp_path, monkeypatch):
    run, event = final_checkpoint
    monkeypatch.setenv("AREAL_TEST_MARKER", "7")
    cfg = slurm_eval(evaluator=PROBE, nodes=2, pass_env=["AREAL_TEST_*"])
    with SlurmSlots(cfg, tmp_path, run_name="env") as slots:
        result, _ = evaluate_on(slots, event, run, tmp_path)
    assert result.metrics["env_marker"] == 7


def test_a_flow_gone_on_another_host_is_noticed_by_its_jobs_agents_which_end(slurm_cluster, tmp_path):
    """The flow is killed (``kill -9``) and never resumed here: its job's agents see no heartbeat
    for ``orphan_after_s`` and end the job, well before its time limit."""
    flow = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from areal_eval.launchers.slurm_slots import SlurmSlots\n"
            "from tests.launchers.test_slurm_faults import ONE_GPU, slurm_eval\n"
            "import dataclasses\n"
            "cfg = slurm_eval(slurm=dataclasses.replace(ONE_GPU, orphan_after_s=30))\n"
            "with SlurmSlots(cfg, sys.argv[1], run_name='orphan') as slots, slots.lease() as slot:\n"
            "    print(slot.job, flush=True)\n"
            "    time.sleep(600)\n",
            str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        job = flow.stdout.readline().strip()
        assert job and [j for j, _ in run_jobs("orphan")] == [job]
    finally:
        flow.kill()
        flow.wait(10)
    wait_for(lambda: run_jobs("orphan") == [], 120, "the orphaned job's agents to end it")
    assert "it is gone; ending" in (tmp_path / "slurm-slots" / "slot-0" / f"job-{job}.out").read_text()


def test_a_follower_lost_mid_evaluation_fails_it_at_once_and_the_retry_lands_on_a_new_job(
    slurm_cluster, final_checkpoint, tmp_path
):
    """The follower's agent killed in the middle of a 2-node evaluation: srun ends the job, so
    the evaluation fails on the job's state, long before node 0's collective timeout (an hour)."""
    run, event = final_checkpoint
    cfg = slowed(2.0, nodes=2, collective_timeout_s=3600, job_timeout_s=3600)
    with SlurmSlots(cfg, tmp_path, run_name="follower") as slots:
        with slots.lease() as slot:
            job, follower = slot.job, slot.nodes[1]["pid"]
            timer = threading.Timer(8.0, os.kill, (follower, signal.SIGKILL))
            timer.start()
            with pytest.raises(EvaluationFailed, match=rf"its job {job} is (FAILED|CANCELLED)") as info:
                run_evaluation_job(event, run.valid_data, cfg, tmp_path / "lost", workers=slot)
        assert not is_permanent(info.value)
        result, slot = evaluate_on(slots, event, run, tmp_path / "again")
        assert slot.job != job and result.metrics["n_pairs"] == 101
    assert run_jobs("follower") == []


def test_a_follower_node_lost_mid_evaluation_fails_it_and_the_retry_waits_for_the_nodes(
    slurm_cluster, final_checkpoint, tmp_path
):
    """The follower's whole node dies in the middle of a 2-node evaluation (its slurmd, job step
    and ranks killed). The evaluation fails transient long before node 0's collective timeout (an
    hour): node 0's ranks lose their peer, or the controller marks the node down after
    ``SlurmdTimeout`` (30 s here) and ends the job, whichever comes first. The slot is rebuilt;
    its new job waits for nodes (a wait, not a refusal) and lands once the node is back."""
    run, event = final_checkpoint
    cfg = slowed(2.0, nodes=2, collective_timeout_s=3600, job_timeout_s=3600)
    try:
        with SlurmSlots(cfg, tmp_path, run_name="lost-node") as slots:
            with slots.lease() as slot:
                job, lost = slot.job, psutil.Process(slot.nodes[1]["pid"]).environ()["SLURMD_NODENAME"]
                timer = threading.Timer(8.0, slurm_cluster.kill_node, (lost,))
                timer.start()
                cause = rf"its job {job} is NODE_FAIL|node\(s\) 1 gone mid-evaluation, and node 0 failed"
                with pytest.raises(EvaluationFailed, match=cause) as info:
                    run_evaluation_job(event, run.valid_data, cfg, tmp_path / "lost", workers=slot)
                timer.join()
            assert not is_permanent(info.value)
            threading.Timer(15.0, slurm_cluster.start_node, (lost,)).start()
            result, slot = evaluate_on(slots, event, run, tmp_path / "again")  # no job can start before then
            assert slot.job != job and result.metrics["n_pairs"] == 101
            [waited] = slot.wait_note()  # what the result's notes say, with Slurm's reason
            assert waited.startswith("waited") and ": " in waited, waited
        assert run_jobs("lost-node") == []
    finally:
        slurm_cluster.restore_nodes()  # for the tests after this one, whatever happened here


def test_kill_9_of_a_flow_whose_slot_job_pends_cancels_that_job_before_it_ever_starts(
    slurm_cluster, final_checkpoint, tmp_path
):
    """Both nodes busy, the flow's slot job pends; the flow is killed (``kill -9``). The pending
    job outlives it (nothing on a node could notice: no agent runs yet); the run's next flow
    cancels it before the nodes free, and evaluates on a job of its own."""
    run, event = final_checkpoint
    blocker = slurm_cluster.run(
        "sbatch",
        "--parsable",
        "--nodes=2",
        "--gres=gpu:2",
        "--job-name=blocker",
        f"--output={tmp_path}/blocker-%j.out",  # not slurm-<job>.out in the directory the tests run from
        "--wrap=sleep 600",
    ).stdout.strip()
    try:
        wait_for(lambda: f"{blocker} blocker RUNNING" in slurm_cluster.jobs(), 60, "the blocker to run")
        flow = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys\n"
                "from areal_eval.launchers.slurm_slots import SlurmSlots\n"
                "from tests.launchers.test_slurm_faults import slurm_eval\n"
                "with SlurmSlots(slurm_eval(), sys.argv[1], run_name='pending') as slots, slots.lease():\n"
                "    pass\n",
                str(tmp_path),
            ],
            cwd=ROOT,
        )
        try:
            wait_for(lambda: any(j.endswith("PENDING") and ":pending:" in j for j in slurm_cluster.jobs()), 60, "a job")
        finally:
            flow.kill()
            flow.wait(10)
        [(pending, _)] = run_jobs("pending")  # a batch job outlives its submitter
        with SlurmSlots(slurm_eval(), tmp_path, run_name="pending") as slots:
            assert pending not in [j for j, _ in run_jobs("pending")]  # cancelled while the nodes were busy
            slurm_cluster.run("scancel", blocker)
            result, slot = evaluate_on(slots, event, run, tmp_path / "evals")
        assert slot.job != pending and result.metrics["n_pairs"] == 101
        assert not list(job_dir(tmp_path / "slurm-slots" / "slot-0", pending).glob("node-*.json"))  # never started
    finally:
        slurm_cluster.run("scancel", blocker, check=False)
    assert run_jobs("pending") == []


def test_a_requeue_of_a_slots_job_is_refused_and_nothing_runs_twice(slurm_cluster, final_checkpoint, tmp_path):
    run, event = final_checkpoint
    with SlurmSlots(slurm_eval(), tmp_path, run_name="requeue") as slots:
        first, slot = evaluate_on(slots, event, run, tmp_path / "first")
        requeued = slurm_cluster.run("scontrol", "requeue", slot.job, check=False)
        assert requeued.returncode != 0  # submitted --no-requeue
        again, other = evaluate_on(slots, event, run, tmp_path / "again")
        assert other.job == slot.job and again.metrics == first.metrics

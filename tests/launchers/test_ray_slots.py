"""``eval.launcher: ray`` on a real Ray cluster (a head and 2 nodes with fake GPUs, on loopback)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

from areal_eval.checkpoints.manifest import checkpoint_name
from areal_eval.config.parsing import ConfigError
from areal_eval.evaluation.jobs import EvalConfig, EvaluationFailed, run_evaluation_job
from areal_eval.failures import is_permanent
from areal_eval.launchers.ray_slots import RayConfig, RaySlots, connect
from tests.flows.test_train_and_evaluate_resume import wait_for
from tests.launchers.conftest import (
    NODE_GPUS,
    evaluate_on,
    placement_groups_left,
    read_items,
    require,
    slot_actors_alive,
)

pytestmark = pytest.mark.integration

ON_EVAL_NODES = RayConfig(address="auto", gpus_per_node=1, resources={"eval_node": 1})


def ray_eval(**changes) -> EvalConfig:
    return EvalConfig(**{"nproc": 1, "batch_size": 16, "launcher": "ray", "ray": ON_EVAL_NODES, **changes})


def test_one_node_two_nodes_and_the_local_launcher_give_the_same_metrics_and_items(
    ray_cluster, final_checkpoint, tmp_path
):
    run, event = final_checkpoint
    local = run_evaluation_job(event, run.valid_data, EvalConfig(nproc=2, batch_size=16), tmp_path / "local")
    results = {}
    for nodes, nproc in ((1, 2), (2, 1)):
        cfg = ray_eval(nodes=nodes, nproc=nproc)
        with RaySlots(cfg, tmp_path / f"ray-{nodes}", run_name="same") as slots:
            results[nodes], slot = evaluate_on(slots, event, run, tmp_path / f"ray-{nodes}")
            again, _ = evaluate_on(slots, event, run, tmp_path / f"ray-{nodes}")  # the warm agents serve again
            agents = {n["pid"] for n in slot.nodes}
            assert len(agents) == nodes and {n["devices"] for n in slot.nodes} <= {"0", "1"}
            recorded = json.loads(
                (tmp_path / f"ray-{nodes}" / f"{checkpoint_name(event.global_step)}.json").read_text()
            )
            assert recorded["devices"] == slot.nodes[0]["devices"]  # rank 0 ran on its bundle's GPU
        assert again.metrics == results[nodes].metrics
        assert results[nodes].metrics == pytest.approx(local.metrics, abs=1e-9), nodes
        assert read_items(results[nodes]) == read_items(local)
        assert str(tmp_path / f"ray-{nodes}") in next(iter(results[nodes].items.values()))
    assert results[1].metrics["n_pairs"] == 101
    assert slot_actors_alive("areal-eval-same") == [] and placement_groups_left("areal-eval-same") == []


def test_two_slots_run_while_a_third_waits_for_nodes_and_then_serves(ray_cluster, final_checkpoint, tmp_path):
    """Each node has one ``eval_node``: two slots fit, the third's placement group waits (and
    says so) until the pool is closed; three evaluations at once all finish on the two."""
    run, event = final_checkpoint
    said: list[str] = []
    cfg = ray_eval(slots=3)
    results, errors, leased, ended = [], [], [], []
    with RaySlots(cfg, tmp_path, run_name="third", report=said.append, report_s=1.0) as slots:

        def evaluate(i):
            try:
                with slots.lease() as slot:
                    leased.append(time.monotonic())
                    results.append(
                        (run_evaluation_job(event, run.valid_data, cfg, tmp_path / f"e{i}", workers=slot), slot)
                    )
                    ended.append(time.monotonic())
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=evaluate, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        states = [slot.describe() for slot in slots.slots]
    assert errors == []
    assert len(results) == 3 and len({r.metrics["accuracy"] for r, _ in results}) == 1
    assert {slot.index for _, slot in results} <= {0, 1, 2} and len({s.index for _, s in results}) == 2
    assert sum("waiting for 1 x" in state for state in states) == 1, states
    assert any("waiting" in line and "for a free evaluation slot" in line for line in said), said
    assert sorted(leased)[2] >= min(ended), (leased, ended)  # the third lease waited for an evaluation to end

    assert slot_actors_alive("areal-eval-third") == [] and placement_groups_left("areal-eval-third") == []


def test_a_lost_node_agent_or_node_is_transient_and_its_slot_is_rebuilt(ray_cluster, final_checkpoint, tmp_path):
    run, event = final_checkpoint
    with RaySlots(ray_eval(), tmp_path, run_name="lost") as slots:
        with slots.lease() as slot:
            pid = slot.nodes[0]["pid"]
            timer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
            timer.start()
            with pytest.raises(EvaluationFailed, match="a node agent was lost") as info:
                run_evaluation_job(event, run.valid_data, slots.cfg, tmp_path, workers=slot)
        assert not is_permanent(info.value)
        result, slot = evaluate_on(slots, event, run, tmp_path)  # the retry gets a rebuilt slot
        assert slot.nodes[0]["pid"] != pid and result.metrics["n_pairs"] == 101

        # Its node's raylet killed (the machine lost): the same, on the other node.
        cluster, _ = ray_cluster
        [node] = [n for n in cluster.list_all_nodes() if n.node_id == slot.nodes[0]["node_id"]]
        cluster.remove_node(node, allow_graceful=False)
        import ray

        try:
            wait_for(
                lambda: not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == node.node_id),
                60,
                "the node seen dead",
            )
            with pytest.raises(EvaluationFailed, match="a node agent was lost") as info:
                evaluate_on(slots, event, run, tmp_path)
            assert not is_permanent(info.value)
            result, slot = evaluate_on(slots, event, run, tmp_path)
            assert slot.nodes[0]["node_id"] != node.node_id and result.metrics["n_pairs"] == 101
        finally:
            cluster.add_node(num_cpus=2, num_gpus=NODE_GPUS, resources={"eval_node": 1})  # for the next tests
            cluster.wait_for_nodes()
    assert slot_actors_alive("areal-eval-lost") == []


def test_a_corrupt_checkpoint_on_a_ray_slot_is_permanent_and_named_and_the_slot_serves_on(
    ray_cluster, final_checkpoint, tmp_path
):
    from areal_eval.evaluation.jobs import CorruptCheckpoint

    run, event = final_checkpoint
    copy = tmp_path / "ckpt"
    shutil.copytree(event.uri, copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10:] = b"\x00" * 10  # the same size: only the workers' hashes see it
    weights.write_bytes(bytes(data))
    with RaySlots(ray_eval(), tmp_path, run_name="corrupt") as slots:
        with pytest.raises(CorruptCheckpoint, match="model.safetensors: sha256 differs") as info:
            evaluate_on(slots, dataclasses.replace(event, uri=str(copy)), run, tmp_path / "bad")
        assert is_permanent(info.value) and "sha256 differs" in (tmp_path / "ray-slot-0.log").read_text()
        result, _ = evaluate_on(slots, event, run, tmp_path / "good")  # the slot's ranks start again
    assert result.metrics["n_pairs"] == 101


@pytest.mark.parametrize(
    ("ray", "refusal"),
    [
        (
            RayConfig(address="auto", gpus_per_node=3),
            r"eval.ray.gpus_per_node: 3 GPU per node, but the largest Ray node has 2",
        ),
        (
            RayConfig(address="auto", resources={"tpu_pod": 1}),
            r"eval.ray.resources.tpu_pod: 1 tpu_pod per node, but the largest Ray node has 0",
        ),
    ],
)
def test_a_bundle_no_node_can_hold_is_refused_in_one_line(ray_cluster, tmp_path, ray, refusal):
    with pytest.raises(ConfigError, match=refusal):
        RaySlots(ray_eval(ray=ray), tmp_path, run_name="bad")


def test_a_ray_address_that_does_not_answer_is_refused_in_one_line(tmp_path):
    from tests.helpers import free_port

    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError, match=rf"eval.ray.address: '{address}': no Ray head answers there"):
        connect(dataclasses.replace(ON_EVAL_NODES, address=address))


def test_the_vllm_backend_runs_in_a_ray_slot_in_its_own_environment_and_keeps_its_engine(
    ray_cluster, causal_checkpoint, tmp_path
):
    from tests.evaluation.test_vllm_decoder import GREEDY, VLLM_PYTHON, checkpoint_event
    from tests.helpers import causal_metrics

    require(VLLM_PYTHON.exists(), "no .venv-vllm: bash scripts/setup.sh --vllm")
    checkpoint, prompts = causal_checkpoint
    reference = causal_metrics(checkpoint, prompts, generation=GREEDY)
    cfg = ray_eval(
        evaluator="generation", python=str(VLLM_PYTHON), generation=dataclasses.replace(GREEDY, backend="vllm")
    )
    event = checkpoint_event(checkpoint)
    with RaySlots(cfg, tmp_path, run_name="vllm") as slots:
        with slots.lease() as slot:
            first = run_evaluation_job(event, prompts, cfg, tmp_path / "first", workers=slot).metrics
            again = run_evaluation_job(event, prompts, cfg, tmp_path / "again", workers=slot).metrics
    log = (tmp_path / "ray-slot-0.log").read_text()  # node 0's log, brought back by the agent
    assert log.count("vllm engine started in") == 1  # the slot's warm rank kept its engine
    counts = ("n_prompts", "n_answers", "truncated_prompts", "reward_errors")
    assert {c: first[c] for c in counts} == {c: reference[c] for c in counts}
    assert abs(first["accuracy"] - reference["accuracy"]) <= 0.05 and again == first


def test_a_long_wait_for_a_slot_is_noted_on_the_result_and_a_short_one_is_not(tmp_path):
    from areal_eval.launchers.slot_pool import WAIT_NOTED_S, ClusterSlot

    slot = ClusterSlot(0, tmp_path / "slot.log")
    slot.waited_s = WAIT_NOTED_S - 0.1
    assert slot.wait_note() == []
    slot.waited_s = 42.4
    assert slot.wait_note() == ["waited 42 s for a free evaluation slot"]


def test_with_no_address_a_run_starts_a_ray_instance_of_its_own_and_stops_it(ray_cluster, final_checkpoint, tmp_path):
    """What ``bash scripts/demo.sh --set eval.launcher=ray`` does on a fresh machine: a process
    with no Ray of its own starts one for its slots and leaves no Ray process behind."""
    import subprocess
    import sys

    import psutil

    run, event = final_checkpoint
    script = f"""
import dataclasses, json
from areal_eval.checkpoints.manifest import Manifest
from areal_eval.launchers.ray_slots import RaySlots
from areal_eval.evaluation.jobs import EvalConfig, run_evaluation_job
event = Manifest({str(run.manifest)!r}).events()[-1]
cfg = EvalConfig(nproc=1, batch_size=16, launcher="ray")
with RaySlots(cfg, {str(tmp_path)!r}, run_name="own") as slots, slots.lease() as slot:
    result = run_evaluation_job(event, {str(run.valid_data)!r}, cfg, {str(tmp_path)!r}, workers=slot)
    print(json.dumps({{"started_ray": slots.started_ray, "accuracy": result.metrics["accuracy"]}}))
"""
    mark = f"own-ray-{os.getpid()}-{time.time_ns()}"  # every process the run starts inherits it
    env = {**os.environ, "AREAL_EVAL_TEST_MARK": mark}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    reply = json.loads(done.stdout.strip().splitlines()[-1])
    assert reply["started_ray"] is True
    assert (
        reply["accuracy"]
        == run_evaluation_job(
            event, run.valid_data, ray_eval(launcher="local", ray=RayConfig()), tmp_path / "local"
        ).metrics["accuracy"]
    )

    def ray_processes_left():
        left = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if proc.environ().get("AREAL_EVAL_TEST_MARK") == mark:
                    left.append(" ".join(proc.info["cmdline"] or ())[:100])
            except psutil.Error:
                continue
        return left

    wait_for(lambda: not ray_processes_left(), 60, "the run's own Ray processes to end")


PROBE = "tests.custom_evaluator:SlowProbe"
ROOT = str(Path(__file__).resolve().parents[2])
"""The ranks import ``tests.custom_evaluator`` from here (``eval.env``: Ray starts them elsewhere)."""


def test_agents_whose_python_cannot_run_the_ranks_are_refused_in_one_line_and_leave_nothing(ray_cluster, tmp_path):
    cfg = ray_eval(python="/usr/bin/python3")  # the system's: no areal_eval, no torch
    with RaySlots(cfg, tmp_path, run_name="no-python") as slots:
        with pytest.raises(ConfigError, match=r"^eval.python: node \S+: eval.python '/usr/bin/python3' cannot import"):
            with slots.lease():
                pass
        assert placement_groups_left("areal-eval-no-python") == []
        assert slot_actors_alive("areal-eval-no-python") == []


def test_more_nodes_per_slot_than_nodes_that_can_hold_a_bundle_is_refused_in_one_line(ray_cluster, tmp_path):
    with pytest.raises(ConfigError, match=r"^eval.nodes: 3 nodes per slot, but only 2 Ray node\(s\) can hold a bundle"):
        RaySlots(ray_eval(nodes=3), tmp_path, run_name="three")
    autoscaled = ray_eval(nodes=3, ray=dataclasses.replace(ON_EVAL_NODES, autoscaling=True))
    with RaySlots(autoscaled, tmp_path, run_name="three") as slots:  # it waits for nodes instead
        wait_for(lambda: "waiting for 3 x" in slots.slots[0].describe(), 60, "the slot to wait for 3 nodes")


def test_the_flows_environment_reaches_every_nodes_ranks(ray_cluster, final_checkpoint, tmp_path, monkeypatch):
    run, event = final_checkpoint
    monkeypatch.setenv("AREAL_TEST_MARKER", "7")
    cfg = ray_eval(nodes=2, evaluator=PROBE, pass_env=["AREAL_TEST_*"], env={"PYTHONPATH": ROOT})
    with RaySlots(cfg, tmp_path, run_name="env") as slots:
        result, _ = evaluate_on(slots, event, run, tmp_path)
    assert result.metrics["env_marker"] == 7  # the mean over both nodes' ranks


def test_a_frozen_follower_node_fails_the_evaluation_once_ray_sees_it_dead_and_the_slot_is_placed_again(
    ray_cluster, final_checkpoint, tmp_path
):
    """The follower's whole node frozen (SIGSTOP: a hung machine) mid-evaluation. Node 0's ranks
    would wait in a collective for ``collective_timeout_s`` (here far longer than the test); the
    slot sees the follower lost as soon as Ray marks its node dead, keeps node 0's log lines,
    and is placed again on a live node."""
    import psutil
    import ray

    run, event = final_checkpoint
    cluster, _ = ray_cluster
    env = {"PYTHONPATH": ROOT, "AREAL_TEST_SLOW_S": "2"}
    cfg = ray_eval(nodes=2, evaluator=PROBE, env=env, collective_timeout_s=3600, job_timeout_s=3600)
    with RaySlots(cfg, tmp_path, run_name="frozen") as slots:
        try:
            with slots.lease() as slot:
                [node] = [n for n in cluster.list_all_nodes() if n.node_id == slot.nodes[1]["node_id"]]
                raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
                frozen = [raylet, *raylet.children(recursive=True)]
                assert slot.nodes[1]["pid"] in {p.pid for p in frozen}
                node0_log = Path(tempfile.gettempdir()) / "areal-eval-ray" / slot.name / "node-0" / "job.log"

                def freeze_mid_evaluation():  # once node 0's ranks have said a batch: the node's ranks too
                    wait_for(lambda: node0_log.exists() and "probe: a batch" in node0_log.read_text(), 120, "a batch")
                    frozen[1:] = raylet.children(recursive=True)
                    for proc in frozen:
                        proc.send_signal(signal.SIGSTOP)

                threading.Thread(target=freeze_mid_evaluation, daemon=True).start()
                with pytest.raises(EvaluationFailed, match="a node agent was lost") as info:
                    run_evaluation_job(event, run.valid_data, cfg, tmp_path / "lost", workers=slot)
            assert not is_permanent(info.value)
            assert "probe: a batch" in (tmp_path / "ray-slot-0.log").read_text()  # node 0's lines of the failed try
            assert not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == node.node_id)
        finally:
            for proc in frozen:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            cluster.remove_node(node, allow_graceful=False)
            cluster.add_node(num_cpus=2, num_gpus=NODE_GPUS, resources={"eval_node": 1})  # for the next tests
            cluster.wait_for_nodes()
        result, slot = evaluate_on(slots, event, run, tmp_path / "again")
        assert node.node_id not in {n["node_id"] for n in slot.nodes}
    assert result.metrics["n_pairs"] == 101
    assert placement_groups_left("areal-eval-frozen") == [] and slot_actors_alive("areal-eval-frozen") == []


def test_a_bundle_holds_what_is_asked_of_each_node():
    assert RayConfig(gpus_per_node=1, cpus_per_node=2, resources={"eval_node": 1}).bundle() == {
        "CPU": 2.0,
        "GPU": 1.0,
        "eval_node": 1.0,
    }
    assert RayConfig(cpus_per_node=0).bundle() == {}

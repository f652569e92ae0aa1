import time

from areal_eval.checkpoints.manifest import CheckpointEvent, Manifest
from areal_eval.lifecycle.decision_thread import DecisionThread
from areal_eval.lifecycle.followers import ManifestFollower
from areal_eval.lifecycle.planner import EvaluationPlanner
from areal_eval.runs.ledger import Ledger
from areal_eval.scheduling.policy import SchedulerConfig

CFG = SchedulerConfig(min_interval_steps=0, max_interval_steps=None, max_interval_growth=None, queue_capacity=2)


def ev(step):
    return CheckpointEvent("r", f"/ckpt/{step}", 0, step, step, 0.0, {})


def test_decision_thread_decides_as_the_manifest_grows(tmp_path):
    manifest = Manifest(tmp_path / "manifest.jsonl")
    planner = EvaluationPlanner(CFG, Ledger(tmp_path / "ledger.jsonl"))

    def eventually(condition, timeout_s=10.0):
        deadline = time.monotonic() + timeout_s
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.01)
        return condition()

    with DecisionThread(planner, ManifestFollower(manifest), idle_wait_s=0.05) as decisions:
        assert decisions.drain() == [] and eventually(decisions.idle)
        for step in (0, 5):
            manifest.append(ev(step))
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            got += decisions.drain(timeout_s=0.5)
        assert [(e.global_step, d.evaluate) for e, d in got] == [(0, True), (5, True)]
        assert planner.ledger.status(0) == "scheduled" and eventually(decisions.idle)
        assert [planner.next().global_step, planner.next().global_step] == [0, 5]
    (tmp_path / "manifest.jsonl").write_text("not json\n")  # a bad line is reported, the thread goes on
    follower = ManifestFollower(Manifest(tmp_path / "manifest.jsonl"))
    with DecisionThread(planner, follower, idle_wait_s=0.05) as decisions:
        problems = []
        assert eventually(lambda: problems.extend(follower.take_problems()) or problems)
        assert problems[0].startswith(f"{tmp_path / 'manifest.jsonl'}:1: not a manifest entry")
        Manifest(tmp_path / "manifest.jsonl").append(ev(10))
        got = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got += decisions.drain(timeout_s=0.5)
        assert [e.global_step for e, _ in got] == [10]

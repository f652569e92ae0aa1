"""AReaL drop-ins: a loop written the way AReaL's trainers call them fires on the steps AReaL's
semantics give (worked out by hand below), and the fixed defects stay fixed."""

import dataclasses
import time

import pytest
import torch

from areal_eval.checkpoints.manifest import Manifest
from areal_eval.integrations.areal import (
    EpochStepTimeFreqCtl,
    Evaluator,
    EvaluatorConfig,
    FinetuneSpec,
    FrequencyControl,
    PublishCheckpoint,
)

AREAL_STATE_KEYS = {
    "frequence_seconds",  # sic
    "frequency_steps",
    "start_time",
    "steps",
    "last_time",
    "last_steps",
    "interval_steps",
    "interval_seconds",
    "initial_value",
}


class Clock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def areal_loop(evaluator: Evaluator, ft_spec: FinetuneSpec, clock: Clock | None = None, step_s: float = 0.0):
    """AReaL's trainer loop: evaluate after every step, with (epoch, step in epoch, global step)."""
    fired = []
    global_step = 0
    for epoch in range(ft_spec.total_train_epochs):
        for step in range(ft_spec.steps_per_epoch):
            if clock is not None:
                clock.now += step_s
            evaluator.evaluate(lambda g=global_step: fired.append(g), epoch, step, global_step)
            global_step += 1
    return fired


def test_frequency_control_takes_areals_arguments_in_order_and_needs_steps_and_time():
    clock = Clock()
    ctl = FrequencyControl(10, 3, False, None, clock=clock)  # frequency_seconds, frequency_steps, ...
    assert (ctl.frequency_seconds, ctl.frequency_steps) == (10, 3)
    fired = []
    for t in (1, 2, 3, 11, 12, 13, 15, 22):
        clock.now = t
        fired.append(ctl.check())
    # 3 steps by t=3 but only 3 s: no. t=11: 4 steps and 11 s: yes. t=15: 3 steps, 4 s: no. t=22: yes.
    assert fired == [False, False, False, True, False, False, False, True]
    assert ctl.total_steps == 8 and ctl.interval_steps == 4 and ctl.interval_seconds == 11


def test_a_time_condition_works_without_torch_distributed():
    assert not torch.distributed.is_initialized()  # AReaL raises UnboundLocalError here
    clock = Clock()
    ctl = FrequencyControl(frequency_seconds=5, clock=clock)
    clock.now = 4
    assert not ctl.check()
    clock.now = 5
    assert ctl.check()


def test_neither_frequency_fires_only_for_the_initial_value():
    ctl = FrequencyControl(initial_value=True)
    assert [ctl.check() for _ in range(4)] == [True, False, False, False]


def test_epoch_step_time_controls_are_ored_with_areals_field_names_and_order():
    ctl = EpochStepTimeFreqCtl(1, 4, None, True)
    assert (ctl.freq_epoch, ctl.freq_step, ctl.freq_sec, ctl.initial_epoch_value) == (1, 4, None, True)
    ft_spec = FinetuneSpec(total_train_epochs=3, dataset_size=40, train_batch_size=8)  # 5 steps an epoch
    config = EvaluatorConfig(freq_epochs=1, freq_steps=4, eval_before_train=True)
    # The initial value fires at the first call (0); the step control every 4th call (3, 7, 11);
    # the epoch control at each epoch's last step (4, 9, 14). Neighbours both fire (3 and 4).
    assert areal_loop(Evaluator(config, ft_spec), ft_spec) == [0, 3, 4, 7, 9, 11, 14]


def test_time_trigger_in_the_loop():
    clock = Clock()
    ft_spec = FinetuneSpec(total_train_epochs=2, dataset_size=30, train_batch_size=5)  # 6 steps an epoch
    evaluator = Evaluator(EvaluatorConfig(freq_secs=10), ft_spec)
    evaluator.freq_ctl = EpochStepTimeFreqCtl(None, None, 10, clock=clock)
    # 4 s a step: 12 s have passed at global steps 2, 5, 8, 11.
    assert areal_loop(evaluator, ft_spec, clock, step_s=4) == [2, 5, 8, 11]


def test_state_saved_mid_run_resumes_without_counting_downtime():
    clock = Clock(1000.0)
    ctl = EpochStepTimeFreqCtl(None, 50, 100, clock=clock)
    for _ in range(20):
        clock.now += 3
        assert not ctl.check(0, 1)
    state = ctl.state_dict()
    assert AREAL_STATE_KEYS <= set(state["time"]) and AREAL_STATE_KEYS <= set(state["step"])

    resumed_clock = Clock(5.0)  # another process, hours later: its monotonic clock starts elsewhere
    resumed = EpochStepTimeFreqCtl(None, 50, 100, clock=resumed_clock)
    resumed.load_state_dict(state)
    resumed_clock.now += 39
    assert not resumed.check(0, 1)  # 60 + 39 s of training, 21 steps
    resumed_clock.now += 2
    assert resumed.check(0, 1)  # 101 s


def test_a_state_saved_by_areal_loads_from_its_timestamps():
    areal_state = {
        "frequence_seconds": 100,
        "frequency_steps": None,
        "start_time": time.time() - 500,
        "steps": 7,
        "last_time": time.time() - 30,
        "last_steps": 5,
        "interval_steps": 2,
        "interval_seconds": 12.0,
        "initial_value": False,
    }
    clock = Clock(0.0)
    ctl = FrequencyControl(clock=clock)
    ctl.load_state_dict(areal_state)
    assert ctl.total_steps == 7 and ctl.frequency_seconds == 100
    assert 29 < ctl.state_dict()["elapsed_seconds"] < 40
    clock.now = 65
    assert not ctl.check()
    clock.now = 75
    assert ctl.check()


def test_evaluator_state_dict_round_trips():
    ft_spec = FinetuneSpec(1, 40, 8)
    evaluator = Evaluator(EvaluatorConfig(freq_steps=3), ft_spec)
    for step in range(2):
        evaluator.evaluate(None, 0, step, step)
    other = Evaluator(EvaluatorConfig(freq_steps=3), ft_spec)
    other.load_state_dict(evaluator.state_dict())
    fired = []
    other.evaluate(lambda: fired.append(2), 0, 2, 2)
    assert fired == [2]


def test_publishing_evaluator_saves_and_publishes_instead_of_evaluating(tmp_path):
    from safetensors.torch import save_file

    def save(directory):
        directory.mkdir(parents=True)
        save_file({"w": torch.ones(2)}, str(directory / "model.safetensors"))
        (directory / "config.json").write_text("{}")

    publish = PublishCheckpoint(save, tmp_path / "checkpoints", tmp_path / "manifest.jsonl", run_id="areal-run")
    ft_spec = FinetuneSpec(total_train_epochs=2, dataset_size=32, train_batch_size=8)  # 4 steps an epoch
    evaluator = Evaluator(EvaluatorConfig(freq_steps=3, eval_before_train=True), ft_spec, publish=publish)
    evaluator.before_train()  # the untouched weights, as step 0
    assert areal_loop(evaluator, ft_spec) == []  # nothing evaluated inline
    events = Manifest(tmp_path / "manifest.jsonl").events()
    # before_train took the initial value: the step control fires at 2 and 5; the last step is final.
    assert [(e.global_step, e.final) for e in events] == [(0, False), (2, False), (5, False), (7, True)]
    assert evaluator.published == [0, 2, 5, 7]
    assert {f.name for f in events[-1].files} == {"model.safetensors", "config.json"}
    assert events[1].uri == str((tmp_path / "checkpoints" / "global_step_00000002").resolve())


def test_unknown_fields_are_refused_by_the_dataclasses():
    with pytest.raises(TypeError):
        EpochStepTimeFreqCtl(freq_epochs=1, freq_step=None, freq_sec=None)  # AReaL's name is freq_epoch


def test_the_areal_hook_hands_directives_to_act_answers_them_and_a_stop_publishes_the_final_step(tmp_path):
    from safetensors.torch import save_file

    from areal_eval.feedback import Directive
    from areal_eval.runs.directives import Directives

    def save(directory):
        directory.mkdir(parents=True)
        save_file({"w": torch.ones(2)}, str(directory / "model.safetensors"))
        (directory / "config.json").write_text("{}")

    box, asked = Directives(tmp_path), []
    box.issue([Directive("lr_scale@0", "lr_scale", (0,), "flat", {}, "act", {"factor": 0.5})])

    def act(directive):
        asked.append(directive.id)
        if directive.id == "lr_scale@0":  # as the rollout weights would change too: the next asks to stop
            box.issue([Directive("stop@0", "stop", (0,), "target reached", {}, "act")])
            return None
        return None if directive.action == "stop" else "cannot"

    publish = PublishCheckpoint(save, tmp_path / "checkpoints", tmp_path / "manifest.jsonl", run_id="areal-run")
    ft_spec = FinetuneSpec(total_train_epochs=2, dataset_size=32, train_batch_size=8)
    evaluator = Evaluator(EvaluatorConfig(freq_steps=3), ft_spec, publish=publish, act=act)
    global_step = 0
    for step in range(ft_spec.total_train_steps):
        evaluator.evaluate(None, 0, step, global_step)
        global_step += 1
        if evaluator.stopped:
            break
    assert asked == ["lr_scale@0", "stop@0"] and evaluator.stopped == "stop@0 (act): target reached"
    assert [(a.id, a.step, a.applied) for a in box.answers()] == [("lr_scale@0", 0, True), ("stop@0", 1, True)]
    assert [(e.global_step, e.final) for e in Manifest(tmp_path / "manifest.jsonl").events()] == [(1, True)]
    # No act= given: an act-mode directive is refused, with the reason on record.
    other = tmp_path / "other"
    Directives(other).issue([Directive("stop@0", "stop", (0,), "r", {}, "act")])
    plain = Evaluator(
        EvaluatorConfig(freq_steps=3), ft_spec, publish=dataclasses.replace(publish, manifest=other / "manifest.jsonl")
    )
    plain.evaluate(None, 0, 0, 0)
    [refused] = Directives(other).answers()
    assert not refused.applied and refused.reason == "the trainer passed no act= to Evaluator" and not plain.stopped


def test_a_rollback_act_accepts_is_published_at_once_and_the_abandoned_policies_rollouts_are_named(tmp_path):
    from safetensors.torch import save_file

    from areal_eval.feedback import Directive
    from areal_eval.runs.directives import Directives

    weights = {"w": torch.ones(2)}

    def save(directory):
        directory.mkdir(parents=True)
        save_file(weights, str(directory / "model.safetensors"))
        (directory / "config.json").write_text("{}")

    def act(directive):  # a trainer's own: restore step 3's weights (and push them to the rollout engines)
        weights["w"] = torch.full((2,), float(directive.args["to_step"]))
        return None

    box = Directives(tmp_path)
    publish = PublishCheckpoint(save, tmp_path / "checkpoints", tmp_path / "manifest.jsonl", run_id="areal-run")
    ft_spec = FinetuneSpec(total_train_epochs=1, dataset_size=80, train_batch_size=8)
    evaluator = Evaluator(EvaluatorConfig(freq_steps=4), ft_spec, publish=publish, act=act)
    for global_step in range(ft_spec.total_train_steps):
        if global_step == 5:  # as the pipeline would, once results after step 3 came in worse
            box.issue([Directive("rollback@5", "rollback", (3, 5), "worse", {}, "act", {"to_step": 3})])
        evaluator.evaluate(None, 0, global_step, global_step)
    [answer] = box.answers()
    assert answer.applied and answer.step == 5 and evaluator.rollbacks == [(3, 5)]
    events = {e.global_step: e for e in Manifest(tmp_path / "manifest.jsonl").events()}
    assert sorted(events) == [3, 5, 7, 9] and events[5].train_metrics == {"weights_from_step": 3}
    assert [v for v in range(10) if evaluator.abandoned(v)] == [4, 5]  # rollouts of versions 4 and 5: dropped
    resumed = Evaluator(EvaluatorConfig(freq_steps=4), ft_spec, publish=publish, act=act, resumed_at=7)
    resumed.load_state_dict(evaluator.state_dict())
    assert resumed.rollbacks == [(3, 5)] and resumed.abandoned(4)

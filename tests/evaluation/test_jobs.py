"""``eval`` settings (``EvalConfig``): the launcher and the cluster launchers' sections; each refusal
is one line naming its field."""

from __future__ import annotations

import importlib.util

import pytest

from areal_eval.config.parsing import ConfigError
from areal_eval.pipeline.config import load_pipeline_config


def refusal(**eval_section) -> str:
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(params={"eval": eval_section})
    assert "\n" not in str(info.value)
    return str(info.value)


def test_an_unknown_launcher_is_refused_naming_the_choices():
    assert "eval.launcher" in refusal(launcher="k8s") and "local, ray, slurm" in refusal(launcher="k8s")


def test_several_nodes_per_slot_need_a_cluster_launcher():
    assert refusal(nodes=2).startswith("eval.nodes: 2 nodes per slot need launcher ray or slurm")


def test_devices_come_from_the_cluster_on_a_cluster_launcher():
    assert refusal(launcher="slurm", devices=[0, 1]).startswith("eval.devices: [0, 1]: with launcher slurm")


def test_ray_chosen_without_the_package_says_how_to_install_it(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    assert refusal(launcher="ray") == (
        "eval.launcher: ray needs the ray package, not installed here: pip install 'areal-eval[ray]'"
    )


def test_bad_amounts_are_refused_by_their_field():
    assert refusal(launcher="local", ray={"gpus_per_node": -1}).startswith("eval.ray.gpus_per_node")
    assert refusal(launcher="local", ray={"resources": {"eval_node": 0}}).startswith("eval.ray.resources.eval_node")
    assert refusal(launcher="local", slurm={"cpus_per_node": 0}).startswith("eval.slurm.cpus_per_node")

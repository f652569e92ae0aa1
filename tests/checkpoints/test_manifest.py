"""What a manifest entry holds: the announcement's arguments checked before anything is written,
and metrics straight from a training loop (tensors, numpy scalars) recorded as numbers."""

import json

import numpy as np
import pytest
import torch

from areal_eval.checkpoints.manifest import CheckpointEvent, announcement, checkpoint_name, step_of_name


def test_metrics_straight_from_the_training_loop_are_recorded_as_numbers():
    metrics = {
        "loss": torch.tensor(0.5),
        "loss_bf16": torch.tensor(0.25, dtype=torch.bfloat16),
        "grad_norm": torch.tensor([2.0]),
        "lr": np.float64(1e-4),
        "tokens": np.int64(4096),
        "accuracy": np.array([0.75], dtype=np.float32),
        "nan": float("nan"),  # a diverged loss is still a loss
        "stopped": "alert accuracy-regression",  # not a number: kept in the manifest, not in MLflow
    }
    step, epoch, epoch_step, recorded = announcement(
        "run", np.int64(40), epoch=torch.tensor(1), epoch_step=15, train_metrics=metrics
    )
    assert (step, epoch, epoch_step) == (40, 1, 15) and all(type(x) is int for x in (step, epoch, epoch_step))
    assert {k: v for k, v in recorded.items() if k != "nan"} == {
        "loss": 0.5, "loss_bf16": 0.25, "grad_norm": 2.0, "lr": 1e-4, "tokens": 4096, "accuracy": 0.75,
        "stopped": "alert accuracy-regression",
    }  # fmt: skip
    assert all(type(v) in (int, float, str) for v in recorded.values())
    event = CheckpointEvent("run", "/ckpt", epoch, epoch_step, step, 0.0, recorded)
    assert CheckpointEvent.from_dict(json.loads(event.to_json())).train_metrics["tokens"] == 4096


@pytest.mark.parametrize(
    "args, named",
    [
        (("", 1, 0, 0, {}), r"run_id: a non-empty string names the run, got ''"),
        (("run", "10", 0, 0, {}), r"global_step: a non-negative integer, got '10'"),
        (("run", 1.5, 0, 0, {}), r"global_step: a non-negative integer, got 1.5"),
        (("run", True, 0, 0, {}), r"global_step: a non-negative integer, got True"),
        (("run", -1, 0, 0, {}), r"global_step: a non-negative integer, got -1"),
        (("run", 1, -1, 0, {}), r"epoch: a non-negative integer, got -1"),
        (("run", 1, 0, None, {}), r"epoch_step: a non-negative integer, got None"),
        (
            ("run", 1, 0, 0, {"loss": torch.tensor([0.5, 0.2])}),
            r"train_metrics\['loss'\]: a tensor or array of 2 elements",
        ),
        (("run", 1, 0, 0, {"w": np.zeros((2, 3))}), r"train_metrics\['w'\]: a tensor or array of 6 elements"),
        (("run", 1, 0, 0, {"seen": {1, 2}}), r"train_metrics\['seen'\]: a metric is a number, .* got set"),
        (("run", 1, 0, 0, {3: 0.5}), r"train_metrics: metric names are strings, got 3"),
    ],
    ids=str,
)
def test_an_announcement_that_no_follower_could_read_is_refused_naming_the_argument(args, named):
    with pytest.raises(ValueError, match=named):
        run_id, step, epoch, epoch_step, metrics = args
        announcement(run_id, step, epoch=epoch, epoch_step=epoch_step, train_metrics=metrics)


def test_a_checkpoint_name_reads_back_as_its_step_and_nothing_else_does():
    assert [step_of_name(checkpoint_name(s)) for s in (0, 25, 123456789)] == [0, 25, 123456789]
    assert [step_of_name(n) for n in ("global_step_", "global_step_-1", "step_25", "global_step_1.5")] == [None] * 4

"""The outbox's held acknowledgements: written when the sink made its points durable, forgotten
when it failed first."""

from __future__ import annotations

from areal_eval.sinks.outbox import SinkOutbox


def test_held_acknowledgements_are_written_on_commit_and_forgotten_on_drop(tmp_path):
    box = SinkOutbox(tmp_path)
    with box.turn():
        box.ack("wandb", "eval/4", held=True)
        box.ack_through("wandb", 40, held=True)
        assert box.has("wandb", "eval/4") and box.through("wandb") == 40  # not delivered twice meanwhile
    with SinkOutbox(tmp_path).turn() as other:  # another process sees nothing yet
        assert not other.has("wandb", "eval/4") and other.through("wandb") == -1
    with box.turn():
        box.commit("wandb")
    with SinkOutbox(tmp_path).turn() as other:
        assert other.has("wandb", "eval/4") and other.through("wandb") == 40

    with box.turn():
        box.ack("wandb", "eval/8", held=True)
        box.ack_through("wandb", 80, held=True)
        box.drop("wandb")  # the sink failed before its points were durable
    with box.turn():
        assert not box.has("wandb", "eval/8") and box.through("wandb") == 40
        assert box.has("wandb", "eval/4")

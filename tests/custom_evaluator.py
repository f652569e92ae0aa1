"""A user-defined evaluator, loaded by the workers as ``tests.custom_evaluator:MarginOver``."""

from areal_eval.evaluation.reward_model_evaluator import RewardModelEvaluator


class MarginOver(RewardModelEvaluator):
    """Share of pairs whose reward margin exceeds 0.1: a user metric on top of the built-in one."""

    name = "margin_over"

    def batch_sums(self, batch):
        from areal_eval.models import reward_model

        chosen, rejected = reward_model.pair_scores(self.model, batch)
        return {"n": float(chosen.numel()), "over": float(((chosen - rejected) > 0.1).sum())}

    def metrics(self, sums):
        return {"margin_over_0.1": sums["over"] / sums["n"], "n_pairs": sums["n"]}


class SlowProbe(RewardModelEvaluator):
    """The reward model's metrics, each batch slowed by ``$AREAL_TEST_SLOW_S`` seconds (a fault
    then lands mid-evaluation), and ``env_marker``: ``$AREAL_TEST_MARKER`` as the ranks saw it
    (-1 where it did not reach them). Each batch is said in the rank's log."""

    def batch_sums(self, batch):
        import os
        import time

        time.sleep(float(os.environ.get("AREAL_TEST_SLOW_S", "0")))
        print("probe: a batch", flush=True)  # the rank's log shows its progress
        marker = float(os.environ.get("AREAL_TEST_MARKER", "-1"))
        return {**super().batch_sums(batch), "marker": marker, "batches": 1.0}

    def metrics(self, sums):
        return {**super().metrics(sums), "env_marker": sums["marker"] / sums["batches"]}

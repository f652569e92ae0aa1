import dataclasses
import random
from dataclasses import dataclass

import pytest

from areal_eval.scheduling.decision_history import DecisionHistory
from areal_eval.scheduling.policy import HistoryEntry, SchedulerConfig, decide, look_back


@dataclass
class Ev:
    global_step: int
    final: bool = False


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("higher_is_better", [True, False])
def test_decision_history_decides_and_looks_back_as_the_full_history(seed, higher_is_better):
    # Random runs with uneven spacing, ties, NaNs, pending, superseded and re-evaluated entries:
    # the index's few entries give the decision and the look-back the whole history gives, at
    # every checkpoint.
    rng = random.Random(seed)
    cfg = dataclasses.replace(SchedulerConfig(max_interval_checkpoints=3.0), higher_is_better=higher_is_better)
    index, full, offered, step = DecisionHistory(higher_is_better), {}, [], 0
    for i in range(300):
        step += rng.choice([1, 1, 5, 10, 50])
        event = Ev(step, final=i == 299)
        expected = decide(event, sorted(full.values(), key=lambda h: h.step), cfg, offered)
        assert decide(event, index.view(), cfg, index.offered_before(step)) == expected
        offered.append(step)
        index.offer(step)
        for target in [step] + rng.sample(offered, min(2, len(offered))):
            roll = rng.random()
            metric = rng.choice([0.5, 0.6, 0.6, rng.random(), float("nan")])
            entry = (
                HistoryEntry(target, float(target), metric, rng.choice([None, 0.01, 0.02]))
                if roll < 0.5
                else HistoryEntry(target, float(target), None)
                if roll < 0.7
                else None
            )
            if entry is None:
                full.pop(target, None)
            else:
                full[target] = entry
            index.set(target, entry)
        # What a result looks back at, read from the index as the planner reads it.
        history = sorted(full.values(), key=lambda h: h.step)
        skipped = [s for s in offered if s not in full]
        for result in {h.step for h in history if h.metric is not None} & {step, *offered[-3:]}:
            assert look_back(index.view(), result, skipped, cfg) == look_back(history, result, skipped, cfg)

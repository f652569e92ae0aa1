"""Fixtures of the evaluation tests."""

from pathlib import Path

import pytest

from areal_eval.evaluation.lm_eval_tasks import LMEvalConfig

TASK_DATA = Path(__file__).resolve().parents[2] / "configs" / "lm_eval" / "arith_mc.jsonl"


@pytest.fixture(scope="session")
def arith_task(tmp_path_factory):
    """A local multiple-choice task (YAML + local JSONL): nothing comes from a hub."""
    directory = tmp_path_factory.mktemp("tasks")
    (directory / "arith_mc.yaml").write_text(
        f"""task: arith_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {TASK_DATA}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
    )
    return LMEvalConfig(tasks=["arith_mc"], include_path=str(directory), batch_size=8)

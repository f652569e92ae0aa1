"""Reading squeue, and which sbatch refusals pass: the words Slurm 22.05 prints."""

from __future__ import annotations

import pytest

from areal_eval.launchers.slurm_queue import (
    GONE,
    UNKNOWN,
    Job,
    JobState,
    is_transient,
    parse_queue,
    seconds_left,
    slurm,
)


@pytest.mark.parametrize(
    ("shown", "seconds"),
    [("0:45", 45), ("9:59", 599), ("1:00:00", 3600), ("1-00:00:00", 86400), ("2-03:04:05", 183845)],
)
def test_squeue_times_read_as_seconds(shown, seconds):
    assert seconds_left(shown) == seconds


@pytest.mark.parametrize("shown", ["UNLIMITED", "NOT_SET", "INVALID", ""])
def test_no_time_limit_reads_as_none(shown):
    assert seconds_left(shown) is None


def test_a_queue_listing_gives_each_job_its_state_reason_and_times():
    jobs = parse_queue(
        "12|RUNNING|None|9:30|10:00\n13|PENDING|PartitionTimeLimit|10:00|10:00\n14|TIMEOUT|TimeLimit|0:00|1:00\n"
    )
    assert jobs["12"] == Job("RUNNING", "", 570, 600) and jobs["12"].kind is JobState.RUNNING
    assert jobs["13"].kind is JobState.PENDING and jobs["13"].reason == "PartitionTimeLimit"
    assert jobs["14"].kind is JobState.ENDED
    assert Job("COMPLETING").kind is JobState.ENDING
    assert GONE.kind is JobState.GONE and UNKNOWN.kind is JobState.UNKNOWN


@pytest.mark.parametrize(
    "refusal",
    [
        "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)",
        "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation",
        "sbatch: error: QOSMaxSubmitJobPerUserLimit",
        "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy"
        " (job submit limit, user's size and/or time limits)",
        "sbatch: error: Batch job submission failed: Resource temporarily unavailable",
    ],
)
def test_refusals_that_pass_are_transient(refusal):
    assert is_transient(refusal)


@pytest.mark.parametrize(
    "refusal",
    [
        "sbatch: error: Batch job submission failed: Invalid feature specification",
        "sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified",
        "sbatch: error: invalid partition specified: gpu2",
        "sbatch: error: Batch job submission failed: Requested node configuration is not available",
    ],
)
def test_refusals_no_retry_changes_are_not(refusal):
    assert not is_transient(refusal)


@pytest.mark.integration
def test_a_command_that_hangs_reads_as_a_controller_that_did_not_answer():
    done = slurm("sleep", "5", timeout_s=0.2)
    assert done.returncode == 124 and "timed out" in done.stderr

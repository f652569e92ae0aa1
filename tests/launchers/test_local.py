import pytest

from areal_eval.launchers.local import failure_summary


def test_ranks_are_forked_from_a_warmed_up_agent_unless_turned_off(monkeypatch):
    from areal_eval.launchers.local import FORK_RANKS_ENV, torchrun_command

    monkeypatch.delenv(FORK_RANKS_ENV, raising=False)
    command = torchrun_command("areal_eval.train", ["--config", "c.json"], 2)
    assert command[1:3] == ["-m", "areal_eval.launchers.forked_ranks"]
    assert command[-4:] == ["-m", "areal_eval.train", "--config", "c.json"]  # torchrun's own arguments
    monkeypatch.setenv(FORK_RANKS_ENV, "0")
    assert torchrun_command("areal_eval.train", [], 2)[1:3] == ["-m", "torch.distributed.run"]


def test_failure_summary_names_every_failed_rank(tmp_path):
    log = tmp_path / "job.log"
    log.write_text(
        "rank 1 leaves the group with 0 DDP model(s) alive\n"  # a rank's own line, not the report's
        "[rank 0] evaluation failed: RuntimeError: Connection closed by peer\n"
        "Failures:\n[1]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : 17 (pid: 11)\n"
        "Root Cause (first observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 10)\n"
    )
    summary = failure_summary(log)
    assert "evaluation failed: RuntimeError" in summary  # nothing else was said: the teardown's line stays
    assert "rank 1 (local_rank: 1) exit code 17 (pid: 11)" in summary
    assert "rank 0 (local_rank: 0) exit code 1 (pid: 10)" in summary
    assert failure_summary(tmp_path / "missing.log") == ""


def test_failure_summary_leads_with_the_first_real_error_without_the_teardown_noise(tmp_path):
    log = tmp_path / "job.log"
    log.write_text(
        "[rank 0] evaluation failed: RuntimeError: [pair.cc:534] Connection closed by peer [127.0.0.1]:4711\n"
        "[rank 1] evaluation failed: CheckpointError: /ckpt/model.safetensors: sha256 differs from the manifest\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "Failures:\n[1]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : 1 (pid: 11)\n"
    )
    summary = failure_summary(log).splitlines()
    assert summary == [
        "evaluation failed: CheckpointError: /ckpt/model.safetensors: sha256 differs from the manifest",
        "rank 1 (local_rank: 1) exit code 1 (pid: 11)",
    ]


def test_node_layout_from_the_pool_environment(monkeypatch):
    from areal_eval.launchers.local import NodeLayout, torchrun_command

    assert NodeLayout.from_env() == NodeLayout() and "--standalone" in torchrun_command("m", [], 2)
    for key, value in {
        "NNODES": "4",
        "NODE_RANK": "2",
        "MASTER_ADDR": "job-0.areal-eval-rdzv",
        "MASTER_PORT": "29400",
    }.items():
        monkeypatch.setenv(f"AREAL_EVAL_{key}", value)
    command = torchrun_command("areal_eval.evaluation.worker", ["--follow"], 8, nodes=NodeLayout.from_env())
    assert "--standalone" not in command
    assert {
        "--nnodes=4",
        "--node-rank=2",
        "--master-addr=job-0.areal-eval-rdzv",
        "--master-port=29400",
        "--nproc-per-node=8",
    } <= set(command)


@pytest.mark.integration
def test_jobs_get_the_heap_settings_unless_the_caller_set_them(tmp_path, monkeypatch):
    from areal_eval.launchers.local import HEAP_SETTINGS, TorchrunJob

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "12345")
    show = "import os; print('heap', os.environ['MALLOC_MMAP_THRESHOLD_'], os.environ['MALLOC_TRIM_THRESHOLD_'])"
    job = TorchrunJob("timeit", ["-n", "1", "-r", "1", show], 1, tmp_path / "job.log")
    log = tmp_path / "job.log"
    assert job.wait(120) == 0, log.read_text()
    assert f"heap {HEAP_SETTINGS['MALLOC_MMAP_THRESHOLD_']} 12345" in log.read_text()


@pytest.mark.integration
def test_a_jobs_last_error_is_known_when_its_log_cannot_be_written():
    """/dev/full refuses every write with ENOSPC, as a full disk does: the job's output is kept
    in memory, and its failure names the error and says the log was not written."""
    from areal_eval.launchers.local import TorchrunJob, WorkerError

    crash = "raise RuntimeError('the checkpoint write failed')"
    job = TorchrunJob("timeit", ["-n", "1", "-r", "1", crash], 1, "/dev/full")
    assert job.wait(120) != 0
    with pytest.raises(WorkerError, match=r"(?s)training failed.*RuntimeError: the checkpoint write failed"):
        job.raise_for_status("training")
    assert job.tail().startswith("(its log could not be written: No space left on device; its last output:)")

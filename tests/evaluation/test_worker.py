"""Evaluation workers as real torchrun process groups (gloo)."""

import dataclasses
import shutil
from pathlib import Path

import pytest

from areal_eval.checkpoints.manifest import CheckpointEvent, describe_files
from areal_eval.evaluation.generation import GenerationConfig
from areal_eval.evaluation.items import read_items
from areal_eval.evaluation.jobs import CorruptCheckpoint, EvalConfig, EvaluationFailed, run_evaluation_job
from areal_eval.evaluation.lm_loss import LMLossConfig
from areal_eval.evaluation.worker_pool import WarmEvalWorkers
from tests.helpers import (
    assert_same_items,
    causal_metrics,
    harness_reference,
    live_processes,
    single_process_metrics,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def warm_ranks(tmp_path_factory):
    """Warm torchrun jobs by world size, each started once for the module: the exactness tests
    evaluate through them, as the flows do, instead of paying a start-up per evaluation."""
    pools: dict[int, WarmEvalWorkers] = {}

    def ranks(world: int) -> WarmEvalWorkers:
        if world not in pools:
            pools[world] = WarmEvalWorkers(world, tmp_path_factory.mktemp(f"warm-{world}"))
        return pools[world]

    yield ranks
    for pool in pools.values():
        pool.close()
    assert not [p for pool in pools.values() for p in live_processes(str(pool.work_dir))]


@pytest.mark.parametrize("world,mp", [(1, 1), (2, 1), (3, 1), (4, 2)])
def test_distributed_equals_single_process(final_checkpoint, warm_ranks, tmp_path, world, mp):
    run, event = final_checkpoint
    assert sum(1 for _ in run.valid_data.open()) % 2 == 1  # an odd number of pairs
    reference, items = single_process_metrics(event, run.valid_data, items=True)
    cfg = EvalConfig(nproc=world, mp_size=mp, batch_size=16)
    result = run_evaluation_job(event, run.valid_data, cfg, tmp_path, workers=warm_ranks(world))
    assert_same_items(result.items, items)
    correct = [r["correct"] for r in read_items(result.items["reward_model"])]
    assert sum(correct) / 101 == pytest.approx(result.metrics["accuracy"], abs=1e-9)
    assert result.metrics["n_pairs"] == reference["n_pairs"] == 101  # each pair exactly once
    assert (
        set(result.metrics)
        == set(reference)
        >= {"accuracy", "loss", "chosen_score", "rejected_score", "margin", "n_pairs"}
    )
    for key, value in reference.items():
        assert result.metrics[key] == pytest.approx(value, abs=1e-6), key


def test_with_probes_the_whole_set_is_the_subset_and_the_rest_exactly(final_checkpoint, warm_ranks, tmp_path):
    """A full evaluation with probes sums the probe subset and the rest apart: its metrics equal
    an evaluation without probes, and its subset part equals a probe of the same checkpoint."""
    from areal_eval import distributed
    from areal_eval.evaluation.reward_model_evaluator import RewardModelEvaluator
    from areal_eval.evaluation.worker import compute_metrics
    from areal_eval.scheduling.probes import probe_items

    run, event = final_checkpoint
    reference = single_process_metrics(event, run.valid_data)
    cfg, ranks = EvalConfig(nproc=2, batch_size=16), warm_ranks(2)
    full = run_evaluation_job(event, run.valid_data, cfg, tmp_path / "full", workers=ranks, probe_fraction=0.3)
    probe = run_evaluation_job(
        event, run.valid_data, cfg, tmp_path / "probe", workers=ranks, probe_fraction=0.3, probe_only=True
    )
    assert set(full.metrics) == set(reference)
    for key, value in reference.items():
        assert full.metrics[key] == pytest.approx(value, abs=1e-6), key
    assert probe.metrics == {} and full.probe_metrics["n_pairs"] == probe.probe_metrics["n_pairs"] == 30
    assert [r["item"] for r in read_items(full.items["reward_model"])] == list(range(101))
    assert [r["item"] for r in read_items(probe.items["reward_model"])] == probe_items(101, 0.3)
    subset = RewardModelEvaluator(max_length=64)
    subset.load(Path(event.uri), run.valid_data)
    subset.select(lambda n: probe_items(n, 0.3))
    alone = compute_metrics(subset, distributed.ParallelLayout(1, 0, 1), 7)
    for key, value in alone.items():
        assert probe.probe_metrics[key] == pytest.approx(value, abs=1e-6) == full.probe_metrics[key], key


@pytest.fixture(scope="module")
def awkward_pairs(trained_run, tmp_path_factory):
    """An odd number of pairs: identical pairs (ties), texts far past max_length (truncated),
    and the trained run's own pairs."""
    import json

    from areal_eval.data.preference_data import read_pairs

    _, run = trained_run
    pairs = read_pairs(run.valid_data)[:30]
    long_text = " ".join(pairs[0]["chosen"].split() * 40)
    pairs += [{"chosen": p["chosen"], "rejected": p["chosen"]} for p in pairs[:5]]  # chosen == rejected
    pairs += [
        {"chosen": long_text, "rejected": pairs[1]["rejected"]},
        {"chosen": pairs[2]["chosen"], "rejected": long_text},
    ]
    path = tmp_path_factory.mktemp("awkward") / "valid.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    assert len(pairs) % 2 == 1
    return path


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ties_and_truncated_pairs_count_the_same_at_every_world_and_batch_size(
    final_checkpoint, awkward_pairs, warm_ranks, tmp_path, world
):
    run, event = final_checkpoint
    reference = single_process_metrics(event, awkward_pairs, batch_size=37)
    for batch_size in (1, 4):
        assert single_process_metrics(event, awkward_pairs, batch_size=batch_size) == pytest.approx(reference, abs=1e-6)
    cfg = EvalConfig(nproc=world, batch_size=3)
    result = run_evaluation_job(event, awkward_pairs, cfg, tmp_path, workers=warm_ranks(world))
    assert result.metrics["n_pairs"] == 37
    for key, value in reference.items():
        assert result.metrics[key] == pytest.approx(value, abs=1e-6), key
    correct = reference["accuracy"] * 37
    assert abs(correct - round(correct)) == pytest.approx(0.5)  # 5 ties, each half correct


def test_dead_rank_fails_clearly_and_leaves_no_process(final_checkpoint, tmp_path, monkeypatch):
    run, event = final_checkpoint
    monkeypatch.setenv("AREAL_EVAL_INJECT_FAULT", "1:exit")
    with pytest.raises(EvaluationFailed, match=r"(?s)step 12.*rank 1 \(local_rank: 1\) exit code 17"):
        run_evaluation_job(event, run.valid_data, EvalConfig(nproc=2, batch_size=16, collective_timeout_s=20), tmp_path)
    assert live_processes(str(tmp_path)) == []


def test_hung_rank_times_out_instead_of_hanging(final_checkpoint, tmp_path, monkeypatch):
    run, event = final_checkpoint
    monkeypatch.setenv("AREAL_EVAL_INJECT_FAULT", "1:hang")
    cfg = EvalConfig(nproc=2, batch_size=16, collective_timeout_s=5, job_timeout_s=90)
    with pytest.raises(EvaluationFailed, match="(?i)timed? ?out|timeout"):
        run_evaluation_job(event, run.valid_data, cfg, tmp_path)
    assert live_processes(str(tmp_path)) == []


def test_corrupt_checkpoint_is_a_clear_error(final_checkpoint, tmp_path):
    run, event = final_checkpoint
    copy = tmp_path / "ckpt"
    shutil.copytree(event.uri, copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10:] = b"\x00" * 10
    weights.write_bytes(bytes(data))
    bad = dataclasses.replace(event, uri=str(copy))
    with pytest.raises(EvaluationFailed, match="model.safetensors: sha256 differs"):
        run_evaluation_job(bad, run.valid_data, EvalConfig(nproc=2), tmp_path / "out")
    # What can be seen without reading the weights is refused before torchrun starts, in one line.
    missing = dataclasses.replace(event, uri=str(tmp_path / "gone"))
    with pytest.raises(CorruptCheckpoint) as refused:
        run_evaluation_job(missing, run.valid_data, EvalConfig(nproc=1), tmp_path / "before")
    assert (
        str(refused.value)
        == f"checkpoint step {event.global_step}: {tmp_path / 'gone'}: checkpoint directory is missing"
    )
    (copy / "config.json").unlink()
    with pytest.raises(CorruptCheckpoint) as refused:
        run_evaluation_job(bad, run.valid_data, EvalConfig(nproc=1), tmp_path / "before")
    assert str(refused.value) == (
        f"checkpoint step {event.global_step}: {copy}/config.json: file recorded in the manifest is missing"
    )
    assert not list((tmp_path / "before").glob("*.log"))  # no torchrun job was started


def test_s3_checkpoint_is_fetched_once_per_node_and_matches_local(final_checkpoint, s3_server, s3_bucket, tmp_path):
    from areal_eval.checkpoints.store import S3Config, S3Store
    from tests.s3_servers import FaultProxy

    run, event = final_checkpoint
    staged = tmp_path / "staged" / Path(event.uri).name
    shutil.copytree(event.uri, staged)
    proxy = FaultProxy(s3_server.url, limit=0)  # counts requests, injects nothing
    s3 = S3Config(endpoint_url=proxy.url)
    uri = S3Store(f"s3://{s3_bucket}/run", s3, keep_local_copy=False).publish(staged, event.files)
    remote = dataclasses.replace(event, uri=uri)
    result = run_evaluation_job(
        remote,
        run.valid_data,
        EvalConfig(nproc=2, batch_size=16),
        tmp_path / "out",
        s3=s3,
        cache_dir=tmp_path / "cache",
    )
    assert result.metrics == pytest.approx(single_process_metrics(event, run.valid_data), abs=1e-6)
    weight_gets = [p for m, p in proxy.requests if m == "GET" and p.split("?")[0].endswith("model.safetensors")]
    assert len(weight_gets) == 1  # local rank 0 downloaded; rank 1 waited and read the same copy
    assert len(list((tmp_path / "cache").iterdir())) == 1
    proxy.stop()


def test_pickle_checkpoint_on_s3_is_refused_without_opt_in(final_checkpoint, s3_server, s3_bucket, tmp_path):
    import torch

    from areal_eval.checkpoints.manifest import describe_files
    from areal_eval.checkpoints.store import S3Config, S3Store
    from areal_eval.evaluation.jobs import CorruptCheckpoint
    from areal_eval.models import reward_model

    run, event = final_checkpoint
    staged = tmp_path / "global_step_00000012"
    shutil.copytree(event.uri, staged)
    model = reward_model.load_model(staged)
    (staged / "model.safetensors").unlink()
    torch.save(model.state_dict(), staged / "pytorch_model.bin")  # weights that need pickle to load
    files = describe_files(staged)
    s3 = S3Config(endpoint_url=s3_server.url)
    uri = S3Store(f"s3://{s3_bucket}/run", s3).publish(staged, files)
    pickled = dataclasses.replace(event, uri=uri, files=files)
    with pytest.raises(CorruptCheckpoint, match="refused: no \\*.safetensors weights.*allow_pickle"):
        run_evaluation_job(
            pickled, run.valid_data, EvalConfig(nproc=1), tmp_path / "out", s3=s3, cache_dir=tmp_path / "c"
        )
    opted_in = run_evaluation_job(
        pickled,
        run.valid_data,
        EvalConfig(nproc=1, allow_pickle=True),
        tmp_path / "out",
        s3=s3,
        cache_dir=tmp_path / "c",
    )
    assert opted_in.metrics["n_pairs"] == 101


def test_two_nodes_on_loopback_match_one_process_and_fetch_once_per_node(
    final_checkpoint, s3_server, s3_bucket, tmp_path, monkeypatch
):
    """What the Kubernetes template runs, on one machine: node 1's torchrun agent starts with
    ``--follow`` and knows nothing of the job; node 0's is launched by run_evaluation_job."""
    from areal_eval.checkpoints.store import S3Config, S3Store
    from areal_eval.launchers.local import NodeLayout, TorchrunJob
    from tests.helpers import free_port
    from tests.s3_servers import FaultProxy

    run, event = final_checkpoint
    staged = tmp_path / "staged" / Path(event.uri).name
    shutil.copytree(event.uri, staged)
    proxy = FaultProxy(s3_server.url, limit=0)
    s3 = S3Config(endpoint_url=proxy.url)
    remote = dataclasses.replace(event, uri=S3Store(f"s3://{s3_bucket}/run", s3).publish(staged, event.files))

    port = free_port()
    follower = TorchrunJob(
        "areal_eval.evaluation.worker",
        ["--follow", "--cache-dir", str(tmp_path / "node1-cache")],
        1,
        tmp_path / "node1.log",
        nodes=NodeLayout(nnodes=2, node_rank=1, master_port=port),
    )
    for key, value in {"NNODES": 2, "NODE_RANK": 0, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}.items():
        monkeypatch.setenv(f"AREAL_EVAL_{key}", str(value))
    try:
        result = run_evaluation_job(
            remote,
            run.valid_data,
            EvalConfig(nproc=1, batch_size=16),
            tmp_path / "node0",
            s3=s3,
            cache_dir=tmp_path / "node0-cache",
        )
        assert follower.wait(60) == 0, (tmp_path / "node1.log").read_text()[-2000:]
    finally:
        follower.kill()
    monkeypatch.delenv("AREAL_EVAL_NNODES")
    one_node = single_process_metrics(event, run.valid_data)
    assert result.metrics == pytest.approx(one_node, abs=1e-6) and result.metrics["n_pairs"] == 101
    weight_gets = [p for m, p in proxy.requests if m == "GET" and p.split("?")[0].endswith("model.safetensors")]
    assert len(weight_gets) == 2  # each node's local rank 0 fetched its own copy
    assert (tmp_path / "node1-cache" / "jobs" / "rank-1" / "valid.jsonl").read_bytes() == run.valid_data.read_bytes()
    proxy.stop()


def test_a_whitespace_only_response_is_refused_naming_its_line_and_no_rank_crashes(final_checkpoint, tmp_path):
    import json

    from areal_eval.evaluation.jobs import EvaluationDataError
    from areal_eval.failures import is_permanent

    run, event = final_checkpoint
    data = tmp_path / "valid.jsonl"
    rows = [{"chosen": "kind words", "rejected": "rude"}] * 3 + [{"chosen": "kind", "rejected": " "}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(EvaluationDataError, match=rf"{data}:4: field 'rejected' must be a string with text") as info:
        run_evaluation_job(event, data, EvalConfig(nproc=2, batch_size=2), tmp_path / "evals")
    assert is_permanent(info.value) and "refused before any worker started" in str(info.value)
    assert not list((tmp_path / "evals").glob("*.log"))  # no torchrun job was started
    assert live_processes(str(tmp_path)) == []


def test_a_data_error_inside_the_workers_is_a_data_error_and_never_retried(final_checkpoint, tmp_path):
    """What the pre-flight check does not see (an s3 checkpoint is checked by its workers, say)
    still comes back as a data error, not a corrupt checkpoint."""
    import json

    from areal_eval.evaluation import jobs
    from areal_eval.evaluation.jobs import EvaluationDataError

    run, event = final_checkpoint
    data = tmp_path / "valid.jsonl"
    data.write_text(json.dumps({"chosen": "kind", "rejected": " "}) + "\n")
    skip_check = pytest.MonkeyPatch.context()
    with skip_check as patch, pytest.raises(EvaluationDataError, match=rf"DataError: {data}:1: field 'rejected'"):
        patch.setattr(jobs, "check_before_launch", lambda *args: None)
        run_evaluation_job(event, data, EvalConfig(nproc=1, batch_size=2), tmp_path / "evals")


CAUSAL = EvalConfig(
    evaluator="generation,lm_loss",
    batch_size=10,
    generation=GenerationConfig(n_samples=4, temperature=1.0, top_p=0.9, k=[1, 4], max_new_tokens=16),
    lm_loss=LMLossConfig(completion_field="answer"),
)


@pytest.mark.parametrize("world,mp", [(1, 1), (2, 1), (3, 1), (4, 2)])
def test_generation_and_lm_loss_distributed_equal_single_process(causal_checkpoint, warm_ranks, tmp_path, world, mp):
    """Sampled answers, pass@k, maj@k and token losses of 41 prompts, on every layout."""
    checkpoint, prompts = causal_checkpoint
    event = CheckpointEvent("causal", str(checkpoint), 0, 0, 150, 0.0, {}, describe_files(checkpoint))
    settings = {"generation": CAUSAL.generation, "lm_loss": CAUSAL.lm_loss}
    reference, items = causal_metrics(checkpoint, prompts, CAUSAL.evaluator, batch_size=3, items=True, **settings)
    cfg = dataclasses.replace(CAUSAL, nproc=world, mp_size=mp)
    result = run_evaluation_job(event, prompts, cfg, tmp_path, workers=warm_ranks(world))
    assert result.metrics["generation/n_prompts"] == 41 and result.metrics["lm_loss/n_texts"] == 41
    assert set(result.metrics) == set(reference)
    for key, value in reference.items():
        assert result.metrics[key] == pytest.approx(value, abs=1e-6), key
    assert 0 < reference["generation/pass_at_4"] < 1
    # Every answer of every prompt once, in order, the same texts and scores at every layout,
    # and the metrics are their means.
    assert_same_items(result.items, items)
    answers, losses = read_items(result.items["generation"]), read_items(result.items["lm_loss"])
    assert len(answers) == 41 * 5 and {r["sample"] for r in answers} == set(range(5))
    greedy = [r["reward"] for r in answers if r["greedy"]]
    assert sum(greedy) / 41 == pytest.approx(result.metrics["generation/accuracy"], abs=1e-9)
    total = sum(r["nll"] for r in losses) / sum(r["tokens"] for r in losses)
    assert total == pytest.approx(result.metrics["lm_loss/loss"], rel=1e-9)
    assert all(r["prompt"] and r["reference"] for r in answers)


@pytest.mark.parametrize("world", [1, 2])
def test_lm_eval_tasks_on_the_workers_equal_the_harness_in_one_process(
    causal_checkpoint, arith_task, warm_ranks, tmp_path, world
):
    checkpoint, prompts = causal_checkpoint
    event = CheckpointEvent("causal", str(checkpoint), 0, 0, 150, 0.0, {}, describe_files(checkpoint))
    reference = harness_reference(checkpoint, arith_task)
    cfg = EvalConfig(nproc=world, evaluator="lm_eval", lm_eval=arith_task)
    result = run_evaluation_job(event, prompts, cfg, tmp_path, workers=warm_ranks(world))
    assert set(result.metrics) == set(reference) and "arith_mc/acc_stderr" in reference
    for key, value in reference.items():
        assert result.metrics[key] == pytest.approx(value, abs=1e-6), key


def test_a_saved_checkpoint_scores_the_same_with_plain_transformers_on_long_texts(final_checkpoint, awkward_pairs):
    """What a user's own script gets from the checkpoint (AutoTokenizer, one pair at a time) is
    the evaluator's result: the truncation side is saved with the tokenizer."""
    import json

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    _, event = final_checkpoint
    tok = AutoTokenizer.from_pretrained(event.uri)
    model = AutoModelForSequenceClassification.from_pretrained(event.uri).eval()
    assert tok.truncation_side == "left"
    rows = [json.loads(line) for line in awkward_pairs.read_text().splitlines()]
    margins, correct = [], 0.0
    for row in rows:
        ids = [tok(row[k], truncation=True, max_length=64)["input_ids"] for k in ("chosen", "rejected")]
        with torch.no_grad():
            chosen, rejected = (model(input_ids=torch.tensor([i])).logits[0, 0].double().item() for i in ids)
        tie = ids[0] == ids[1]  # the same tokens once cut: a tie, half correct
        correct += 0.5 if tie else float(chosen > rejected)
        margins.append(0.0 if tie else chosen - rejected)
    evaluated = single_process_metrics(event, awkward_pairs)
    assert any(len(tok(row["chosen"])["input_ids"]) > 64 for row in rows) and evaluated["truncated_texts"] == 2
    assert evaluated["accuracy"] == correct / len(rows)
    assert evaluated["margin"] == pytest.approx(sum(margins) / len(rows), abs=1e-6)


def test_a_raising_reward_reaches_the_result_with_its_prompt_at_every_world(causal_checkpoint, warm_ranks, tmp_path):
    checkpoint, prompts = causal_checkpoint
    event = CheckpointEvent("causal", str(checkpoint), 0, 0, 150, 0.0, {}, describe_files(checkpoint))
    reward = "tests.evaluation.test_generation.failing_reward"
    cfg = EvalConfig(nproc=2, evaluator="generation", generation=GenerationConfig(reward=reward, max_new_tokens=12))
    result = run_evaluation_job(event, prompts, cfg, tmp_path, workers=warm_ranks(2))
    assert result.metrics["reward_errors"] > 0
    [note] = result.notes
    assert note.startswith("first error: rank ") and "RuntimeError: verifier crashed" in note and str(prompts) in note

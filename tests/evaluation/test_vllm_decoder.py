"""The vllm generation backend, on torchrun workers in vLLM's own environment (``.venv-vllm``,
made by ``bash scripts/setup.sh --vllm``; CI makes it).

Bounds stated here: greedy answers differ from the transformers backend's on at most 5% of the
prompts, and greedy accuracy by at most 0.05 (float kernels differ between the two; on the test
checkpoint they agree on every answer). Counts and the truncation rate are equal. The test
checkpoint carries a generation config as chat models do (a second end token, a repetition
penalty)."""

import dataclasses
from pathlib import Path

import pytest

from areal_eval.checkpoints.manifest import CheckpointEvent, describe_files
from areal_eval.config.parsing import ConfigError
from areal_eval.evaluation.generation import GenerationConfig
from areal_eval.evaluation.jobs import EvalConfig, run_evaluation_job
from areal_eval.evaluation.worker_pool import WarmEvalWorkers
from tests.helpers import causal_metrics

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
GREEDY = GenerationConfig(max_new_tokens=16)


def checkpoint_event(checkpoint: Path, step: int = 1) -> CheckpointEvent:
    return CheckpointEvent("vllm", str(checkpoint), 0, step, step, 0.0, {}, describe_files(checkpoint))


def perturbed_copy(checkpoint: Path, out: Path) -> Path:
    """The same model with other weights: the next checkpoint of a run, as far as vLLM can tell."""
    import shutil

    import torch

    from areal_eval.models import causal_lm

    model = causal_lm.load_model(checkpoint)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(checkpoint / name, out / name)
    return out


def with_chat_model_generation_config(checkpoint: Path, out: Path) -> Path:
    """The checkpoint with a generation_config.json as chat models carry one: a second end token
    (a digit, which some answers hold) and a repetition penalty. Both backends end answers at
    either token and leave the penalty alone."""
    import json
    import shutil

    from areal_eval.models import causal_lm

    shutil.copytree(checkpoint, out)
    tok = causal_lm.load_tokenizer(out)
    [digit] = tok("3", add_special_tokens=False)["input_ids"]
    settings = {"eos_token_id": [tok.eos_token_id, digit], "repetition_penalty": 10.0}
    (out / "generation_config.json").write_text(json.dumps(settings))
    return out


@pytest.mark.integration
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm: bash scripts/setup.sh --vllm")
def test_vllm_on_two_ranks_answers_as_the_transformers_backend_and_keeps_its_engine(causal_checkpoint, tmp_path):
    checkpoint, prompts = causal_checkpoint
    checkpoint = with_chat_model_generation_config(checkpoint, tmp_path / "chat")
    reference = causal_metrics(checkpoint, prompts, generation=GREEDY)
    cfg = EvalConfig(
        nproc=2, evaluator="generation", python=str(VLLM_PYTHON), generation=dataclasses.replace(GREEDY, backend="vllm")
    )
    sampled_cfg = dataclasses.replace(
        cfg,
        generation=GenerationConfig(
            backend="vllm", n_samples=2, temperature=1.0, k=[2], max_new_tokens=16, greedy=False
        ),
    )
    stopping = dataclasses.replace(GREEDY, stop=["####"])
    stopped_cfg = dataclasses.replace(cfg, generation=dataclasses.replace(stopping, backend="vllm"))
    event = checkpoint_event(checkpoint)
    later = perturbed_copy(checkpoint, tmp_path / "later")
    later_reference = causal_metrics(later, prompts, generation=GREEDY)
    with WarmEvalWorkers(2, tmp_path / "warm", python=str(VLLM_PYTHON)) as workers:
        greedy = run_evaluation_job(event, prompts, cfg, tmp_path / "greedy", workers=workers).metrics
        later_event = checkpoint_event(later, 2)
        reloaded = run_evaluation_job(later_event, prompts, cfg, tmp_path / "later-eval", workers=workers)
        sampled = [
            run_evaluation_job(event, prompts, sampled_cfg, tmp_path / f"sampled-{i}", workers=workers).metrics
            for i in range(2)
        ]
        stopped = run_evaluation_job(event, prompts, stopped_cfg, tmp_path / "stopped", workers=workers).metrics
        tensor_parallel_cfg = dataclasses.replace(cfg, mp_size=2)
        tensor_parallel = run_evaluation_job(event, prompts, tensor_parallel_cfg, tmp_path / "tp", workers=workers)
        assert workers.started_jobs == 1
    log = (tmp_path / "warm" / "warm-workers-1.log").read_text()
    assert log.count("vllm engine started in") == 3
    assert log.count("(tensor parallel 1, float32,") == 2  # one engine per rank, kept for the five evaluations
    assert log.count("(tensor parallel 2, float32,") == 1  # then one engine for the group of two ranks
    assert log.count("vllm weights reloaded") == 2 * 2  # each rank: the later checkpoint, then the first again
    # The ranks stopped their engine and exited on the stop job, not killed with their stacks dumped.
    assert "most recent call first" not in log and "did not shut down" not in log
    # The later checkpoint's answers, not the first's: within the stated bounds of the transformers backend's.
    assert reloaded.metrics["response_length"] != greedy["response_length"]
    assert reloaded.metrics["response_length"] == pytest.approx(later_reference["response_length"], rel=0.05)
    assert abs(reloaded.metrics["accuracy"] - later_reference["accuracy"]) <= 0.05
    counts = ("n_prompts", "n_answers", "truncated_prompts", "reward_errors")
    assert {c: greedy[c] for c in counts} == {c: reference[c] for c in counts}
    assert abs(greedy["accuracy"] - reference["accuracy"]) <= 0.05
    assert greedy["truncation_rate"] == reference["truncation_rate"]  # an answer that ended at the digit ended
    assert sampled[0] == sampled[1]  # each sample's own seed: the same answers again
    assert sampled[0]["n_answers"] == 2 * 41 and sampled[0]["truncation_rate"] < 1.0
    # A stop string cuts the answer where the transformers backend cuts it.
    stopped_reference = causal_metrics(checkpoint, prompts, generation=stopping)
    assert stopped["response_length"] == stopped_reference["response_length"] < greedy["response_length"]
    # Tensor parallel over the two ranks' cores: every prompt once, the same answers within the bounds.
    assert {c: tensor_parallel.metrics[c] for c in counts} == {c: reference[c] for c in counts}
    assert abs(tensor_parallel.metrics["accuracy"] - reference["accuracy"]) <= 0.05
    assert tensor_parallel.metrics["response_length"] == pytest.approx(reference["response_length"], rel=0.05)


def test_a_tensor_parallel_engine_takes_the_devices_of_its_group(monkeypatch):
    from areal_eval.evaluation.vllm_decoder import core_share, group_devices

    assert [core_share([4, 5, 6, 7, 8], 2, r) for r in range(2)] == [[4, 5, 6], [7, 8]]
    assert [core_share([0, 1], 4, r) for r in range(4)] == [[0], [1], [0], [1]]
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    assert group_devices(2, on_gpu=False) == {"VLLM_CPU_OMP_THREADS_BIND": "4,5|6,7"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    assert group_devices(2, on_gpu=True) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3|4-7")
    assert group_devices(2, on_gpu=False) == {}  # the user's own binding stands


def test_the_engine_runs_in_the_checkpoints_own_dtype_as_the_transformers_backend(causal_checkpoint, tmp_path):
    import json
    import shutil

    from areal_eval.evaluation.vllm_decoder import engine_dtype

    checkpoint, _ = causal_checkpoint
    assert engine_dtype(checkpoint, "auto") == "float32"  # vLLM's own auto would be bfloat16 here
    assert engine_dtype(checkpoint, "bfloat16") == "bfloat16"
    half = shutil.copytree(checkpoint, tmp_path / "half")
    config = json.loads((half / "config.json").read_text())
    (half / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    assert engine_dtype(half, "auto") == "bfloat16"
    with pytest.raises(ConfigError, match="eval.dtype: 'fp8' is not one of"):
        engine_dtype(checkpoint, "fp8")


def test_vllm_missing_from_the_workers_interpreter_is_a_config_error(causal_checkpoint):
    from areal_eval.evaluation import vllm_decoder

    if vllm_decoder.vllm_available():
        pytest.skip("vLLM is installed in this interpreter")
    checkpoint, _ = causal_checkpoint
    with pytest.raises(ConfigError, match=r"eval.generation.backend: vllm is not installed in this interpreter"):
        vllm_decoder.VLLMDecoder(checkpoint, None, GREEDY)

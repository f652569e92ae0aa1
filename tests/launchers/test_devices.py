"""Where training and each evaluation slot run: the plan, on GPUs and on CPU cores."""

import os

import pytest

from areal_eval.config.parsing import ConfigError, FieldError
from areal_eval.launchers.devices import Placement, Visible, plan_devices, plan_here
from tests.conftest import tiny_config

EIGHT_GPUS = Visible("cuda", tuple(range(8)), tuple(map(str, range(8))))
ONE_GPU = Visible("cuda", (0,), ("0",))
TWO_CORES = Visible("cpu", (0, 1))


def gpus(placement):
    return placement.env()["CUDA_VISIBLE_DEVICES"]


def test_auto_gives_training_the_first_gpus_and_each_slot_its_own_of_the_rest():
    plan = plan_devices("auto", "auto", train_nproc=4, eval_nproc=2, slots=2, share=False, visible=EIGHT_GPUS)
    assert gpus(plan.train) == "0,1,2,3"
    assert [gpus(p) for p in plan.eval_slots] == ["4,5", "6,7"]
    assert plan.train.cpus is None


def test_indices_are_this_processs_visible_gpus_and_children_get_their_physical_names():
    narrowed = Visible("cuda", (0, 1, 2), ("3", "5", "GPU-9f2c"))
    plan = plan_devices([0], [2], train_nproc=1, eval_nproc=1, slots=1, share=False, visible=narrowed)
    assert gpus(plan.train) == "3" and gpus(plan.eval_slots[0]) == "GPU-9f2c"


def test_too_few_gpus_are_refused_naming_the_field_unless_evaluation_may_share():
    with pytest.raises(FieldError, match=r"eval.devices: 1 slot\(s\) of 1 rank\(s\) need 1 GPUs apart"):
        plan_devices("auto", "auto", train_nproc=1, eval_nproc=1, slots=1, share=False, visible=ONE_GPU)
    shared = plan_devices("auto", "auto", train_nproc=1, eval_nproc=1, slots=2, share=True, visible=ONE_GPU)
    assert gpus(shared.train) == "0" and [gpus(p) for p in shared.eval_slots] == ["0", "0"]
    with pytest.raises(FieldError, match=r"train.devices: 2 training ranks need 2 GPUs"):
        plan_devices([0], "auto", train_nproc=2, eval_nproc=1, slots=1, share=False, visible=EIGHT_GPUS)
    # Sharing already: the ranks themselves are too many (it told the user to share, which they did).
    with pytest.raises(FieldError, match=r"eval.nproc: 2 evaluation ranks need a GPU each.*at most 1$"):
        plan_devices("auto", "auto", train_nproc=1, eval_nproc=2, slots=1, share=True, visible=ONE_GPU)


def test_an_overlap_is_refused_naming_both_fields_and_a_missing_device_naming_its_own():
    overlap = r"eval.devices: \[1, 2\] overlaps train.devices \[0, 1\] on device\(s\) \[1\]"
    with pytest.raises(FieldError, match=overlap):
        plan_devices([0, 1], [1, 2], train_nproc=2, eval_nproc=1, slots=1, share=False, visible=EIGHT_GPUS)
    assert (
        gpus(
            plan_devices(
                [0, 1], [1, 2], train_nproc=2, eval_nproc=1, slots=2, share=True, visible=EIGHT_GPUS
            ).eval_slots[1]
        )
        == "2"
    )
    with pytest.raises(FieldError, match=r"eval.devices: device 9 does not exist here \(visible GPUs: 0,1,2"):
        plan_devices("auto", [9], train_nproc=1, eval_nproc=1, slots=1, share=False, visible=EIGHT_GPUS)


def test_where_no_training_runs_evaluation_takes_every_visible_gpu():
    plan = plan_devices(
        "auto", "auto", train_nproc=4, eval_nproc=2, slots=2, share=False, visible=EIGHT_GPUS, training_here=False
    )
    assert [gpus(p) for p in plan.eval_slots] == ["0,1", "2,3"]
    # An evaluation pool's worker pinned to 2 GPUs, for a run that trains on 8 elsewhere.
    pool = Visible("cuda", (0, 1), ("4", "5"))
    plan = plan_devices(
        [0, 1, 2, 3, 4, 5, 6, 7],
        "auto",
        train_nproc=8,
        eval_nproc=1,
        slots=2,
        share=False,
        visible=pool,
        training_here=False,
    )
    assert plan.train is None and [gpus(p) for p in plan.eval_slots] == ["4", "5"]


def test_on_cpu_auto_pins_nothing_and_listed_cores_are_split_among_the_slots():
    assert plan_devices(
        "auto", "auto", train_nproc=2, eval_nproc=2, slots=2, share=False, visible=TWO_CORES
    ).eval_slots == (None, None)
    plan = plan_devices([0], [1], train_nproc=2, eval_nproc=2, slots=1, share=False, visible=TWO_CORES)
    assert plan.train == Placement("cpu", (0,)) and plan.train.env() == {} and plan.eval_slots[0].cpus == {1}
    three = plan_devices(
        "auto", [0, 1, 2], train_nproc=1, eval_nproc=1, slots=2, share=False, visible=Visible("cpu", (0, 1, 2))
    )
    assert [p.cpus for p in three.eval_slots] == [{0, 1}, {2}]
    with pytest.raises(FieldError, match=r"eval.devices: 1 core\(s\) cannot give 2 slots a core each"):
        plan_devices("auto", [1], train_nproc=1, eval_nproc=1, slots=2, share=False, visible=TWO_CORES)


def test_the_config_refuses_an_overlap_when_it_is_read(tmp_path):
    with pytest.raises(ConfigError, match=r"eval.devices: \[0\] overlaps train.devices \[0\]"):
        tiny_config(tmp_path, train={"devices": [0]}, eval={"devices": [0]})
    with pytest.raises(ConfigError, match=r"train.devices: \[1, 1\] must be distinct"):
        tiny_config(tmp_path, train={"devices": [1, 1]})
    with pytest.raises(ConfigError, match=r"eval.devices: invalid value 'gpu'"):
        tiny_config(tmp_path, eval={"devices": "gpu"})


def test_this_machines_devices_are_read_without_torch(tmp_path, monkeypatch):
    (tmp_path / "0000:17:00.0").mkdir()
    (tmp_path / "0000:65:00.0").mkdir()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert Visible.here(str(tmp_path)) == Visible("cuda", (0, 1), ("0", "1"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert Visible.here(str(tmp_path)) == Visible("cuda", (0,), ("1",))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert Visible.here(str(tmp_path)).kind == "cpu"
    assert Visible.here(str(tmp_path / "absent")) == Visible("cpu", tuple(sorted(os.sched_getaffinity(0))))
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match=rf"eval.devices: device {cores + 5} does not exist here"):
        plan_here(tiny_config(tmp_path, eval={"devices": [cores + 5]}))


def _ranks(job, count, timeout_s=60.0):
    """The job's torchrun agent and its ``count`` rank processes, once they are all up."""
    import time

    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs = [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]
        if len(procs) > count:
            return [p.pid for p in procs]
        time.sleep(0.2)
    raise AssertionError(f"{count} ranks did not start")


def _allowed_cpus(pid: int) -> str:
    status = open(f"/proc/{pid}/status").read()
    return next(line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list"))


def _environ(pid: int) -> dict:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.mark.integration
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPU cores")
def test_training_and_each_evaluation_slot_really_run_on_their_own_devices(tmp_path, monkeypatch):
    """What each launched process got, read from /proc: cores here, and the GPUs a machine with
    two (a driver listing, as /proc/driver/nvidia/gpus has) would give each slot."""
    from areal_eval.pipeline.setup import prepare_run
    from tasks.evaluation import worker_groups
    from tasks.training import start_training

    core_a, core_b = sorted(os.sched_getaffinity(0))[:2]
    cfg = tiny_config(tmp_path, train={"devices": [core_a]}, eval={"devices": [core_b], "nproc": 2})
    training = start_training.fn(cfg, prepare_run(cfg))
    try:
        with worker_groups(cfg, tmp_path / "evals", training_here=True) as groups:
            groups.start()
            evaluation = groups.groups[0].job
            assert {_allowed_cpus(pid) for pid in _ranks(training, 2)} == {str(core_a)}
            assert {_allowed_cpus(pid) for pid in _ranks(evaluation, 2)} == {str(core_b)}
    finally:
        training.kill()

    driver = tmp_path / "gpus"
    for bus in ("0000:17:00.0", "0000:65:00.0", "0000:b3:00.0"):
        (driver / bus).mkdir(parents=True)
    monkeypatch.setattr("areal_eval.launchers.devices.NVIDIA_GPUS", str(driver))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = tiny_config(tmp_path, train={"nproc": 1}, eval={"nproc": 1, "slots": 2})
    for training_here, expected in ((True, [{"1"}, {"2"}]), (False, [{"0"}, {"1"}])):
        with worker_groups(cfg, tmp_path / f"gpu-evals-{training_here}", training_here) as groups:
            groups.start()
            seen = [{_environ(pid)["CUDA_VISIBLE_DEVICES"] for pid in _ranks(g.job, 1)} for g in groups.groups]
        assert seen == expected  # beside this process's training, its auto share (GPU 0) is left alone


def test_vllm_on_a_gpu_shared_with_training_needs_its_kv_cache_size(tmp_path, monkeypatch):
    (tmp_path / "gpus" / "0000:17:00.0").mkdir(parents=True)  # a driver listing of one GPU
    monkeypatch.setattr("areal_eval.launchers.devices.NVIDIA_GPUS", str(tmp_path / "gpus"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    vllm = {"backend": "vllm"}
    shared = {"nproc": 1, "share_devices": True, "evaluator": "generation", "generation": vllm}
    cfg = tiny_config(tmp_path, train={"nproc": 1}, eval=shared)
    with pytest.raises(ConfigError, match=r"^eval.generation.vllm_kv_cache_gb: set it with eval.share_devices"):
        plan_here(cfg)
    sized = tiny_config(tmp_path, train={"nproc": 1}, eval={**shared, "generation": {**vllm, "vllm_kv_cache_gb": 4}})
    assert gpus(plan_here(sized).eval_slots[0]) == "0"
    monkeypatch.setattr(
        "areal_eval.launchers.devices.NVIDIA_GPUS", str(tmp_path / "none")
    )  # on CPU cores vLLM takes 1 GiB
    assert plan_here(cfg).eval_slots == (None,)

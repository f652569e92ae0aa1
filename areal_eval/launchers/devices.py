"""Which devices training and each evaluation slot run on, kept apart.

``train.devices`` and ``eval.devices`` are lists of device indices or ``auto``. On a machine
with GPUs an index is a visible GPU (``CUDA_VISIBLE_DEVICES`` numbering of this process), and
``auto`` gives training the first ``train.nproc`` GPUs and evaluation the rest. Without GPUs an
index is a CPU core this process may run on (as ``taskset`` numbers them), and ``auto`` pins
nothing. Each evaluation slot's worker group gets devices of its own: ``CUDA_VISIBLE_DEVICES``
on GPUs, the CPU affinity of its processes on cores. Training and evaluation never share a
device unless ``eval.share_devices`` says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
from collections.abc import Iterator, Sequence
from typing import Literal

from areal_eval.config.parsing import ConfigError, FieldError

Devices = Literal["auto"] | list[int]
"""A ``devices`` setting: ``auto`` or device indices."""

NVIDIA_GPUS = "/proc/driver/nvidia/gpus"
"""One entry per GPU the NVIDIA driver manages."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """The devices one torchrun job runs on: GPUs (``cuda``) or CPU cores (``cpu``)."""

    kind: str
    devices: tuple[int, ...]
    """Visible GPU indices of this process, or CPU core ids."""
    physical: tuple[str, ...] = ()
    """The GPUs as this process's ``CUDA_VISIBLE_DEVICES`` names them (what a child is given)."""

    def env(self) -> dict[str, str]:
        """What the job's environment must say (GPUs: ``CUDA_VISIBLE_DEVICES``)."""
        if self.kind != "cuda":
            return {}
        names = self.physical or tuple(map(str, self.devices))
        return {"CUDA_VISIBLE_DEVICES": ",".join(names[i] for i in self.devices)}

    @property
    def cpus(self) -> set[int] | None:
        """The CPU cores the job's processes may run on (None: not pinned)."""
        return set(self.devices) if self.kind == "cpu" else None

    def __str__(self) -> str:
        return f"{'GPU' if self.kind == 'cuda' else 'CPU core'}s {','.join(map(str, self.devices))}"


@dataclasses.dataclass(frozen=True)
class Visible:
    """The devices this process can see."""

    kind: str
    """``cuda`` where there are GPUs, else ``cpu``."""
    devices: tuple[int, ...]
    physical: tuple[str, ...] = ()

    @classmethod
    def here(cls, gpus_dir: str | None = None) -> Visible:
        """This process's GPUs (what the NVIDIA driver lists, as ``CUDA_VISIBLE_DEVICES``
        narrows them; read without importing torch), else its CPU cores."""
        try:
            count = len(os.listdir(gpus_dir or NVIDIA_GPUS))
        except OSError:
            count = 0
        named = os.environ.get("CUDA_VISIBLE_DEVICES")
        physical = tuple(map(str, range(count)))
        if named is not None and count:
            physical = tuple(d.strip() for d in named.split(",") if d.strip())
            if any(d.startswith("-") for d in physical):  # "-1": no GPU is visible
                physical = physical[: next(i for i, d in enumerate(physical) if d.startswith("-"))]
        if physical and count:
            return cls("cuda", tuple(range(len(physical))), physical)
        return cls("cpu", tuple(sorted(os.sched_getaffinity(0))))

    def describe(self) -> str:
        what = "visible GPUs" if self.kind == "cuda" else "CPU cores this process may use"
        return f"{what}: {','.join(map(str, self.devices)) or 'none'}"


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """Training's devices and each evaluation slot's (None: not pinned)."""

    train: Placement | None
    eval_slots: tuple[Placement | None, ...]


def check_setting(devices: Devices, field: str) -> None:
    """A list of distinct non-negative indices, or ``auto`` (read with the config)."""
    if devices == "auto":
        return
    if not devices:
        raise FieldError(field, "must list at least one device, or be auto")
    if any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        raise FieldError(field, f"{devices} must be distinct device indices (0, 1, ...)")


def check_disjoint(train: Devices, evaluation: Devices, share: bool) -> None:
    """Training and evaluation listed on the same device is refused unless they may share."""
    if share or train == "auto" or evaluation == "auto":
        return
    both = sorted(set(train) & set(evaluation))
    if both:
        raise FieldError(
            "eval.devices",
            f"{evaluation} overlaps train.devices {train} on device(s) {both}: evaluation would slow training and "
            "compete for its memory; list disjoint devices, or set eval.share_devices: true on a one-GPU machine",
        )


def plan_devices(
    train: Devices,
    evaluation: Devices,
    *,
    train_nproc: int,
    eval_nproc: int,
    slots: int,
    share: bool,
    visible: Visible,
    training_here: bool = True,
) -> DevicePlan:
    """Where training and each evaluation slot run on the machine ``visible`` describes.

    On GPUs each rank takes one device: training takes ``train_nproc`` (the first ones under
    ``auto``), each slot ``eval_nproc`` of what is left (all slots share training's under
    ``share``). Where this process runs no training (``training_here`` false: the evaluation
    pool's flows, the service, the sweep, or training already over), ``auto`` gives evaluation
    every visible GPU: pin such a pool's worker to its GPUs with ``CUDA_VISIBLE_DEVICES``. On CPU
    cores ranks may share cores, and ``auto`` pins nothing."""
    check_disjoint(train, evaluation, share)
    if not training_here:  # training's devices are another process's (or machine's) to check
        train = "auto" if visible.kind == "cpu" else []
    for setting, field in ((train, "train.devices"), (evaluation, "eval.devices")):
        unknown = [] if setting == "auto" else [d for d in setting if d not in visible.devices]
        if unknown:
            raise FieldError(field, f"device {unknown[0]} does not exist here ({visible.describe()})")
    if visible.kind == "cpu":
        return _plan_cores(train, evaluation, slots)
    train_list = list(visible.devices[:train_nproc]) if train == "auto" else list(train)
    if training_here and len(train_list) < train_nproc:
        raise FieldError(
            "train.devices", f"{train_nproc} training ranks need {train_nproc} GPUs ({visible.describe()})"
        )
    need = slots * eval_nproc
    if evaluation == "auto":
        rest = [d for d in visible.devices if d not in train_list]
        pool = list(visible.devices) if share and len(rest) < need else rest
    else:
        pool = list(evaluation)
    # Sharing, slots may take turns on the same GPUs; a group's ranks always need one GPU each.
    if share and len(pool) < eval_nproc:
        raise FieldError(
            "eval.nproc",
            f"{eval_nproc} evaluation ranks need a GPU each, even sharing training's, and {len(pool)} can be "
            f"had ({visible.describe()}); set eval.nproc to at most {len(pool)}",
        )
    if len(pool) < need and not share:
        raise FieldError(
            "eval.devices",
            f"{slots} slot(s) of {eval_nproc} rank(s) need {need} GPUs apart from training's {train_list}, and "
            f"{len(pool)} are left ({visible.describe()}); set eval.share_devices: true to run evaluation on "
            "training's GPUs (a one-GPU machine)",
        )
    groups = [[pool[j % len(pool)] for j in range(i * eval_nproc, (i + 1) * eval_nproc)] for i in range(slots)]
    return DevicePlan(
        Placement("cuda", tuple(train_list), visible.physical) if training_here else None,
        tuple(Placement("cuda", tuple(g), visible.physical) for g in groups),
    )


def _plan_cores(train: Devices, evaluation: Devices, slots: int) -> DevicePlan:
    pinned_train = None if train == "auto" else Placement("cpu", tuple(train))
    if evaluation == "auto":
        return DevicePlan(pinned_train, (None,) * slots)
    if len(evaluation) < slots:
        raise FieldError("eval.devices", f"{len(evaluation)} core(s) cannot give {slots} slots a core each")
    share, extra = divmod(len(evaluation), slots)
    groups, start = [], 0
    for i in range(slots):
        size = share + (i < extra)
        groups.append(Placement("cpu", tuple(evaluation[start : start + size])))
        start += size
    return DevicePlan(pinned_train, tuple(groups))


def plan_here(cfg, training_here: bool = True) -> DevicePlan:
    """:func:`plan_devices` for a pipeline config on this machine; a setting this machine cannot
    honour is a ``ConfigError`` naming the field."""
    try:
        plan = plan_devices(
            cfg.train.devices,
            cfg.eval.devices,
            train_nproc=cfg.train.nproc,
            eval_nproc=cfg.eval.nproc,
            slots=cfg.eval.slots,
            share=cfg.eval.share_devices,
            visible=Visible.here(),
            training_here=training_here,
        )
    except FieldError as exc:
        raise ConfigError(str(exc)) from None
    generation = cfg.eval.generation
    decodes_with_vllm = "generation" in cfg.eval.evaluator.replace(" ", "").split(",") and generation.backend == "vllm"
    on_gpus = any(slot is not None and slot.kind == "cuda" for slot in plan.eval_slots)
    if cfg.eval.share_devices and on_gpus and decodes_with_vllm and generation.vllm_kv_cache_gb is None:
        raise ConfigError(
            "eval.generation.vllm_kv_cache_gb: set it with eval.share_devices on GPUs: without it each vLLM "
            "engine takes its share of the whole GPU's memory (0.92 by default), which training holds too"
        )
    return plan


class SlotDevices:
    """The evaluation slots' placements, leased one evaluation at a time (fresh torchrun jobs:
    warm worker groups keep their own)."""

    def __init__(self, placements: Sequence[Placement | None]):
        self.placements = tuple(placements)
        self._free: queue.Queue[Placement | None] = queue.Queue()
        for placement in placements:
            self._free.put(placement)

    @contextlib.contextmanager
    def lease(self) -> Iterator[Placement | None]:
        placement = self._free.get()
        try:
            yield placement
        finally:
            self._free.put(placement)

    def __enter__(self) -> SlotDevices:
        return self

    def __exit__(self, *exc) -> None:
        pass

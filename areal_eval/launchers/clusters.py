"""Evaluation slots on a cluster: Ray placement groups and Slurm jobs, beside the local launcher.

Each slot runs one torchrun agent per node (:mod:`~areal_eval.launchers.node_agent`) and looks
to the flow like a local warm worker group: ``run(spec, timeout_s) -> (exit code, log)``, with
the result and its per-item files written where a local job would write them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def cluster_slots(cfg, work_dir: str | Path, *, run_name: str, report: Callable[[str], None] = log.info):
    """The slots of ``cfg.launcher`` (``ray`` or ``slurm``) for one run, as a context manager
    (entering it starts acquiring them); ``cfg`` is the ``eval`` section."""
    if cfg.launcher == "ray":
        from areal_eval.launchers.ray_slots import RaySlots

        return RaySlots(cfg, work_dir, run_name=run_name, report=report)
    if cfg.launcher == "slurm":
        from areal_eval.launchers.slurm_slots import SlurmSlots

        return SlurmSlots(cfg, work_dir, run_name=run_name, report=report)
    raise ValueError(f"launcher {cfg.launcher!r} has no cluster slots")

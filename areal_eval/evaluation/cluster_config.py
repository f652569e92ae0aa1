"""Where evaluation runs (``eval.launcher``) and the settings of the cluster launchers."""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib.util
import os
from typing import ClassVar

from areal_eval.config.parsing import NON_NEGATIVE, POSITIVE, Bounds, FieldError, Ranges, check_ranges

LAUNCHERS = ("local", "ray", "slurm")
"""``local``: torchrun on the flow's machine; ``ray``: a placement group per slot; ``slurm``: a job per slot."""

PASS_ENV = ["AWS_*", "HF_*", "HUGGING_FACE_*", "NCCL_*", "GLOO_*", "WANDB_*", "MLFLOW_*"]
"""The flow's variables that reach every rank on a cluster by default (``eval.pass_env``):
credentials for ``s3://`` checkpoints, the model hub's cache, the collectives' network settings."""

EXTRAS = {"ray": ("ray", "pip install 'areal-eval[ray]'")}
"""The package each launcher needs in the flow's environment, and how to get it."""


@dataclasses.dataclass
class RayConfig:
    address: str | None = None
    """The Ray cluster to run on: ``auto`` (the one this machine belongs to), ``host:port`` of its
    head, or ``ray://host:10001``. None starts a Ray instance of its own for the run, on this machine."""
    gpus_per_node: float = 0
    """GPUs in each node's bundle: Ray gives each node agent, and its ranks, its own
    ``CUDA_VISIBLE_DEVICES``. 0 on CPU-only clusters."""
    cpus_per_node: float = 1
    """CPUs in each node's bundle."""
    resources: dict = dataclasses.field(default_factory=dict)
    """Custom resources in each node's bundle, e.g. ``{eval_node: 1}``: only nodes started with
    ``ray start --resources '{"eval_node": 4}'`` host evaluation, which keeps it off training's."""
    namespace: str = "areal-eval"
    """The Ray namespace of the slots' placement groups and actors."""
    autoscaling: bool = False
    """The cluster adds nodes on demand (KubeRay or Ray's autoscaler, a group with ``min: 0``):
    slots that no live node can hold wait for new nodes instead of being refused."""

    RANGES: ClassVar[Ranges] = {"gpus_per_node": NON_NEGATIVE, "cpus_per_node": NON_NEGATIVE}

    def __post_init__(self):
        check_ranges(self, self.RANGES)
        for name, amount in self.resources.items():
            if not isinstance(amount, (int, float)) or amount <= 0:
                raise FieldError(f"resources.{name}", f"{amount!r} is not a positive amount")

    def bundle(self) -> dict:
        """One node's share of a slot, as a placement group bundle."""
        amounts = {"CPU": self.cpus_per_node, "GPU": self.gpus_per_node, **self.resources}
        return {name: float(amount) for name, amount in amounts.items() if amount}


@dataclasses.dataclass
class SlurmConfig:
    partition: str | None = None
    """``sbatch --partition``; None: the cluster's default."""
    account: str | None = None
    """``sbatch --account``."""
    gpus_per_node: int = 0
    """GPUs each node of a slot's job asks for (``--gres=gpu:N``); Slurm sets each node's
    ``CUDA_VISIBLE_DEVICES``. 0 on CPU-only partitions."""
    cpus_per_node: int = 1
    """CPUs each node of a slot's job asks for (``--cpus-per-task``)."""
    mem_per_node: str | None = None
    """``sbatch --mem`` of each node (``64G``); None: the partition's default."""
    time_limit: str = "1-00:00:00"
    """``sbatch --time`` of a slot's job. A kept job is renewed (a new job submitted) before its
    limit could cut an evaluation, so the run may outlive it."""
    controller_grace_s: float = 180.0
    """How long the controller may not answer (a restart, a failover) before an evaluation in
    flight is given up; meanwhile the job is kept and its evaluation goes on."""
    orphan_after_s: float = 300.0
    """A job's node agents end once the flow has not touched their heartbeat for this long (a
    flow killed on another host), giving the nodes back before the time limit."""
    sbatch_args: list[str] = dataclasses.field(default_factory=list)
    """More ``sbatch`` options, as given on its command line (``--qos=eval``, ``--exclude=n7``)."""
    keep_jobs: bool = True
    """Keep each slot's job for the whole run (it serves evaluation after evaluation); False
    submits a job per evaluation and frees the nodes in between."""
    shared_dir: str | None = None
    """A directory the flow's machine and every node see (jobs, results, logs); None: the run's
    ``evals`` directory, which must then be on a shared file system."""

    RANGES: ClassVar[Ranges] = {
        "gpus_per_node": NON_NEGATIVE,
        "cpus_per_node": POSITIVE,
        "controller_grace_s": NON_NEGATIVE,
        "orphan_after_s": Bounds(30),  # the flow touches the heartbeat every 10 s
    }

    def __post_init__(self):
        check_ranges(self, self.RANGES)


def rank_env(cfg) -> dict[str, str]:
    """What a cluster's ranks get of the flow's environment: its variables that match
    ``cfg.pass_env``, then ``cfg.env`` (``cfg``: the ``eval`` section)."""
    passed = {k: v for k, v in os.environ.items() if any(fnmatch.fnmatchcase(k, p) for p in cfg.pass_env)}
    return {**passed, **{k: str(v) for k, v in cfg.env.items()}}


def check_launcher(launcher: str, nodes: int, devices) -> None:
    """``eval.launcher`` and what it needs, in one line naming the field."""
    if launcher not in LAUNCHERS:
        raise FieldError("launcher", f"{launcher!r} is not one of {', '.join(LAUNCHERS)}")
    if launcher == "local" and nodes > 1:
        raise FieldError("nodes", f"{nodes} nodes per slot need launcher ray or slurm (local runs on one machine)")
    if launcher != "local" and devices != "auto":
        raise FieldError(
            "devices",
            f"{devices!r}: with launcher {launcher} the cluster gives each node its devices ({launcher}.gpus_per_node)",
        )
    package, how = EXTRAS.get(launcher, (None, None))
    if package and importlib.util.find_spec(package) is None:
        raise FieldError("launcher", f"{launcher} needs the {package} package, not installed here: {how}")

"""Where evaluation runs (``eval.launcher``) and the settings of the cluster launchers."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import ClassVar

from areal_eval.config.parsing import NON_NEGATIVE, POSITIVE, FieldError, Ranges, check_ranges

LAUNCHERS = ("local", "ray", "slurm")
"""``local``: torchrun on the flow's machine; ``ray``: a placement group per slot; ``slurm``: a job per slot."""

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
    time_limit: str = "1-00:00:00"
    """``sbatch --time`` of a slot's job (a kept job lives as long as the run, at most this)."""
    sbatch_args: list[str] = dataclasses.field(default_factory=list)
    """More ``sbatch`` options, as given on its command line (``--qos=eval``, ``--exclude=n7``)."""
    keep_jobs: bool = True
    """Keep each slot's job for the whole run (it serves evaluation after evaluation); False
    submits a job per evaluation and frees the nodes in between."""
    shared_dir: str | None = None
    """A directory the flow's machine and every node see (jobs, results, logs); None: the run's
    ``evals`` directory, which must then be on a shared file system."""

    RANGES: ClassVar[Ranges] = {"gpus_per_node": NON_NEGATIVE, "cpus_per_node": POSITIVE}

    def __post_init__(self):
        check_ranges(self, self.RANGES)


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

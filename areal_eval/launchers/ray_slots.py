"""``eval.launcher: ray``: each slot a placement group with a bundle per node, and a long-lived
node agent (an actor) in each bundle that runs that node's torchrun with ``eval.python``.

Jobs and results travel as actor calls, so the flow's machine and the nodes share no file
system. Ray gives each agent, and the ranks it starts, its bundle's ``CUDA_VISIBLE_DEVICES``.
Nothing is detached: when the flow's process ends, however it ends, Ray removes its actors and
placement groups.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from pathlib import Path

from areal_eval.config.parsing import ConfigError
from areal_eval.evaluation.cluster_config import RayConfig
from areal_eval.launchers.node_agent import NodeAgent
from areal_eval.launchers.slot_pool import ClusterSlot, SlotLost, SlotPool

CONNECT_TIMEOUT_S = 5.0
"""How long a head address may take to answer before it is refused (Ray itself waits minutes)."""


class RayNodeAgent(NodeAgent):
    """A node agent as a Ray actor: its address is the node's, its directory node-local."""

    def __init__(self, node_rank: int, slot_name: str, **settings):
        import ray

        work_dir = Path(tempfile.gettempdir()) / "areal-eval-ray" / slot_name / f"node-{node_rank}"
        super().__init__(node_rank, work_dir, address=ray.util.get_node_ip_address(), **settings)
        self.node_id = ray.get_runtime_context().get_node_id()

    def where(self) -> dict:
        return {**super().where(), "node_id": self.node_id}


def connect(cfg: RayConfig) -> bool:
    """Join ``cfg.address``'s cluster, or start a Ray instance here (None); True if started here.
    An address that does not answer is refused in one line."""
    import ray

    address = cfg.address
    if address and address != "auto" and not address.startswith("ray://"):
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except (OSError, ValueError) as exc:
            raise ConfigError(f"eval.ray.address: {address!r}: no Ray head answers there ({exc})") from None
    if ray.is_initialized():
        return False
    settings = {"namespace": cfg.namespace, "log_to_driver": False, "configure_logging": False}
    if address is None:
        settings.update(include_dashboard=False, object_store_memory=128 << 20)
    try:
        ray.init(address=address or "local", **settings)  # "local": its own, even beside a running Ray
    except ConnectionError as exc:
        raise ConfigError(f"eval.ray.address: {address!r}: {exc}") from None
    return address is None


def check_bundle(cfg: RayConfig) -> None:
    """Refuse a bundle no live node could ever hold (more GPUs than any node has, a custom
    resource no node offers); a bundle that only waits for busy nodes is fine."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    for name, amount in cfg.bundle().items():
        most = max((r.get(name, 0.0) for r in nodes), default=0.0)
        if most < amount:
            field = {"CPU": "cpus_per_node", "GPU": "gpus_per_node"}.get(name, f"resources.{name}")
            raise ConfigError(f"eval.ray.{field}: {amount:g} {name} per node, but the largest Ray node has {most:g}")


class RaySlot(ClusterSlot):
    def __init__(self, index: int, log_path: Path, cfg, run_name: str):
        super().__init__(index, log_path)
        self.cfg, self.name = cfg, f"{run_name}-slot-{index}"
        self.group = None
        self.agents: list = []
        self.state = "waiting for its placement group"

    def acquire(self, stop: threading.Event) -> bool:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        e = self.cfg
        strategy = "STRICT_SPREAD" if e.nodes > 1 else "PACK"
        self.group = placement_group([e.ray.bundle()] * e.nodes, strategy=strategy, name=self.name)
        self.state = f"waiting for {e.nodes} x {e.ray.bundle()} ({strategy})"
        while not self.group.wait(timeout_seconds=1):
            if stop.is_set():
                return False
        agent = ray.remote(RayNodeAgent)
        settings = dict(
            nproc=e.nproc,
            python=e.python,
            nice=e.nice,
            warm=e.warm_workers,
            collective_timeout_s=e.collective_timeout_s,
        )
        self.agents = [
            agent.options(
                name=f"{self.name}-node-{i}",
                num_cpus=e.ray.cpus_per_node,
                num_gpus=e.ray.gpus_per_node,
                resources=e.ray.resources,
                max_concurrency=2,  # where() answers while an evaluation runs
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i),
            ).remote(i, self.name, **settings)
            for i in range(e.nodes)
        ]
        self.nodes = ray.get([a.where.remote() for a in self.agents])
        if stop.is_set():  # the pool closed meanwhile
            self.release()
            return False
        self.state = "ready on " + ", ".join(f"{n['host']}/{n['address']} (devices {n['devices']})" for n in self.nodes)
        return True

    def call(self, spec: dict, data: bytes, timeout_s: float) -> dict:
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        nnodes = len(self.agents)
        try:
            rendezvous = ray.get(self.agents[0].rendezvous.remote()) if nnodes > 1 else None
            followers = [a.follow.remote(nnodes, rendezvous, timeout_s=timeout_s) for a in self.agents[1:]]
            head = self.agents[0].evaluate.remote(spec, data, nnodes=nnodes, rendezvous=rendezvous, timeout_s=timeout_s)
            reply = ray.get(head, timeout=timeout_s + 30)
            for follower in ray.get(followers, timeout=60):
                reply["log"] += follower["log"]
        except (RayError, GetTimeoutError) as exc:
            self.broken = True
            raise SlotLost(
                f"{self.describe()}: a node agent was lost: {type(exc).__name__}: {_first_line(exc)}"
            ) from None
        return reply

    def release(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():  # disconnected: Ray removed what this driver owned (a call would start a new Ray)
            self.agents, self.group, self.state = [], None, "released"
            return
        for agent in self.agents:
            try:
                ray.get(agent.close.remote(), timeout=30)
            except Exception:
                pass  # a lost agent has nothing left to close
            ray.kill(agent)
        self.agents = []
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None
        self.state = "released"

    def describe(self) -> str:
        return f"ray slot {self.index} ({self.name}): {self.state}"


def _first_line(exc: BaseException) -> str:
    return next((line for line in str(exc).splitlines() if line.strip()), "")


class RaySlots(SlotPool):
    """``eval.slots`` Ray slots of ``eval.nodes`` nodes for one run (``run_name`` names its
    placement groups and actors, so ``ray list actors`` says whose they are)."""

    def __init__(self, cfg, work_dir: str | Path, *, run_name: str, **pool):
        self.cfg = cfg
        self.started_ray = connect(cfg.ray)
        check_bundle(cfg.ray)
        name = f"areal-eval-{run_name}-{os.getpid()}"
        work_dir = Path(work_dir)
        slots = [RaySlot(i, work_dir / f"ray-slot-{i}.log", cfg, name) for i in range(cfg.slots)]
        super().__init__(slots, **pool)

    def close(self) -> None:
        super().close()
        if self.started_ray:
            import ray

            ray.shutdown()

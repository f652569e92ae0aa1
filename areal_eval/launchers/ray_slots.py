"""``eval.launcher: ray``: each slot a placement group with a bundle per node, and a long-lived
node agent (an actor) in each bundle that runs that node's torchrun with ``eval.python``.

Jobs and results travel as actor calls, so the flow's machine and the nodes share no file
system. Ray gives each agent, and the ranks it starts, its bundle's ``CUDA_VISIBLE_DEVICES``, and
the flow's variables named by ``eval.pass_env`` and ``eval.env`` (a ``runtime_env``).
Nothing is detached: when the flow's process ends, however it ends, Ray removes its actors and
placement groups; a slot that gives up its nodes (a lost node, agents that failed to start)
removes them itself.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import ClassVar

from areal_eval.config.parsing import NON_NEGATIVE, ConfigError, FieldError, Ranges, check_ranges
from areal_eval.evaluation.interpreter import required_modules
from areal_eval.launchers.local import WorkerError
from areal_eval.launchers.node_agent import NodeAgent, NodeCheckFailed, check_node
from areal_eval.launchers.slot_pool import ClusterSlot, SlotLost, SlotPool, rank_env

CONNECT_TIMEOUT_S = 5.0
"""How long a head address may take to answer before it is refused (Ray itself waits minutes)."""
START_S = 600.0
"""How long a slot's node agents may take to start (the node check imports the package)."""
FOLLOWERS_S = 60.0
"""How long after node 0's result the other nodes may take to end before the slot is rebuilt."""


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


class RayNodeAgent(NodeAgent):
    """A node agent as a Ray actor: its address is the node's, its directory node-local."""

    def __init__(self, node_rank: int, slot_name: str, needs: tuple[str, ...] = ("areal_eval",), **settings):
        import ray

        try:
            check_node(settings.get("python"), needs)
            self.refusal = None
        except NodeCheckFailed as exc:  # said by where(): the flow refuses the slot in this line
            self.refusal = str(exc)
        work_dir = Path(tempfile.gettempdir()) / "areal-eval-ray" / slot_name / f"node-{node_rank}"
        super().__init__(node_rank, work_dir, address=ray.util.get_node_ip_address(), **settings)
        self.node_id = ray.get_runtime_context().get_node_id()

    def where(self) -> dict:
        return {**super().where(), "node_id": self.node_id, "error": self.refusal}


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


def check_bundle(cfg: RayConfig, nodes: int = 1) -> None:
    """Refuse a slot no live nodes could ever hold: a bundle larger than any node (more GPUs, a
    custom resource no node offers), or ``nodes`` bundles on distinct nodes when fewer nodes can
    hold one; one that only waits for busy nodes is fine, and so is anything on a cluster that
    adds nodes on demand (``autoscaling``)."""
    import ray

    if cfg.autoscaling:
        return
    live = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    bundle = cfg.bundle()
    for name, amount in bundle.items():
        most = max((r.get(name, 0.0) for r in live), default=0.0)
        if most < amount:
            field = {"CPU": "cpus_per_node", "GPU": "gpus_per_node"}.get(name, f"resources.{name}")
            raise ConfigError(f"eval.ray.{field}: {amount:g} {name} per node, but the largest Ray node has {most:g}")
    holding = sum(all(r.get(k, 0.0) >= v for k, v in bundle.items()) for r in live)
    if holding < nodes:
        raise ConfigError(
            f"eval.nodes: {nodes} nodes per slot, but only {holding} Ray node(s) can hold a bundle of {bundle}"
        )


class RaySlot(ClusterSlot):
    def __init__(self, index: int, log_path: Path, cfg, run_name: str):
        super().__init__(index, log_path)
        self.cfg, self.name = cfg, f"{run_name}-slot-{index}"
        self.nodes: list[dict] = []
        self.group = None
        self.agents: list = []
        self.shown = "waiting for its placement group"

    def acquire(self, stop: threading.Event) -> bool:
        from ray.util.placement_group import placement_group

        e = self.cfg
        strategy = "STRICT_SPREAD" if e.nodes > 1 else "PACK"
        self.group = placement_group([e.ray.bundle()] * e.nodes, strategy=strategy, name=self.name)
        self.shown = f"waiting for {e.nodes} x {e.ray.bundle()} ({strategy})"
        try:
            while not self.group.wait(timeout_seconds=1):
                if stop.is_set():
                    self.release()
                    return False
            self._start_agents()
        except ConfigError:
            self.release()
            raise
        except Exception as exc:  # the group and whatever started in it are given back, then retried
            why = _first_line(exc)
            self.release()
            raise SlotLost(f"ray slot {self.index} ({self.name}): its node agents did not start: {why}") from None
        if stop.is_set():  # the pool closed meanwhile
            self.release()
            return False
        self.shown = "ready on " + ", ".join(f"{n['host']}/{n['address']} (devices {n['devices']})" for n in self.nodes)
        return True

    def _start_agents(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        e = self.cfg
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
                max_concurrency=2,  # where() and interrupt() answer while an evaluation runs
                runtime_env={"env_vars": rank_env(e)},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i),
            ).remote(i, self.name, needs=tuple(required_modules(e.evaluator, e.generation)), **settings)
            for i in range(e.nodes)
        ]
        self.nodes = ray.get([a.where.remote() for a in self.agents], timeout=START_S)
        refused = [n["error"] for n in self.nodes if n.get("error")]
        if refused:
            raise ConfigError(f"eval.python: {refused[0]}")

    def call(self, spec: dict, data: bytes, timeout_s: float) -> dict:
        """Node 0's reply. Every node's call is watched at once: a lost follower is seen when Ray
        sees it (its actor or node dead), not at node 0's collective timeout."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

        nnodes, reply = len(self.agents), None
        try:
            rendezvous = ray.get(self.agents[0].rendezvous.remote(), timeout=60) if nnodes > 1 else None
            part = {"nnodes": nnodes, "rendezvous": rendezvous, "timeout_s": timeout_s}
            head, *followers = [
                agent.take_part.remote(spec, None if i else data, **part) for i, agent in enumerate(self.agents)
            ]
            waiting, deadline = [head, *followers], time.monotonic() + timeout_s + 30
            while head in waiting:
                done, waiting = ray.wait(waiting, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
                if not done:
                    raise GetTimeoutError(f"no result from node 0 in {timeout_s + 30:.0f} s")
                for ref in done:
                    answer = ray.get(ref)  # a lost node's call raises here
                    if ref == head:
                        reply = answer
                    else:
                        followers[followers.index(ref)] = answer
            done, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=FOLLOWERS_S) if waiting else ([], [])
            for ref in done:
                try:
                    followers[followers.index(ref)] = ray.get(ref)
                except RayError:
                    if reply["code"]:  # the lost node is why node 0 failed
                        raise
                    waiting.append(ref)  # lost after node 0's result: the result stands
            for follower in followers:
                reply["log"] += follower["log"] if isinstance(follower, dict) else ""
            if waiting:  # node 0's result stands; the slow or lost node is rebuilt before the next one
                self.broken = True
                reply["log"] += (
                    f"{len(waiting)} node(s) did not end cleanly within {FOLLOWERS_S:.0f} s of node 0's result\n"
                )
        except RayTaskError as exc:  # the agent raised: its node is alive, and a rebuild would change nothing
            if isinstance(exc, RayActorError):
                raise self._lost(exc, reply) from None
            raise WorkerError(f"{self.describe()}: a node agent failed: {_first_line(exc.cause or exc)}") from None
        except (RayError, GetTimeoutError) as exc:
            raise self._lost(exc, reply) from None
        return reply

    def _lost(self, exc: BaseException, reply: dict | None) -> SlotLost:
        """A node was lost: the others' jobs are ended now, and node 0's log lines of this try
        kept (from its reply, where it had ended already)."""
        import ray

        self.broken = True
        try:
            salvaged = reply["log"] if reply else ray.get(self.agents[0].interrupt.remote(), timeout=30)
        except Exception as lost:  # node 0 itself was lost
            salvaged = f"node 0's log lines of this try are lost with it: {_first_line(lost)}\n"
        if salvaged:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a") as fh:
                fh.write(salvaged)
        return SlotLost(f"{self.describe()}: a node agent was lost: {type(exc).__name__}: {_first_line(exc)}")

    def release(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():  # disconnected: Ray removed what this driver owned (a call would start a new Ray)
            self.agents, self.group, self.shown = [], None, "released"
            return
        for agent in self.agents:
            try:
                ray.get(agent.close.remote(), timeout=30)
            except Exception:
                pass  # a lost agent has nothing left to close
            ray.kill(agent)
        self.agents, self.nodes = [], []
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None
        self.shown = "released"

    def describe(self) -> str:
        return f"ray slot {self.index} ({self.name}): {self.shown}"


def _first_line(exc: BaseException) -> str:
    return next((line for line in str(exc).splitlines() if line.strip()), "")


class RaySlots(SlotPool):
    """``eval.slots`` Ray slots of ``eval.nodes`` nodes for one run (``run_name`` names its
    placement groups and actors, so ``ray list actors`` says whose they are)."""

    Config = RayConfig
    EXTRA = ("ray", "pip install 'areal-eval[ray]'")

    def __init__(self, cfg, work_dir: str | Path, *, run_name: str, **pool):
        self.cfg = cfg
        self.started_ray = connect(cfg.ray)
        check_bundle(cfg.ray, cfg.nodes)
        # The host too: two flows of one run in pods of the same pid must not share names.
        name = f"areal-eval-{run_name}-{socket.gethostname()}-{os.getpid()}"
        work_dir = Path(work_dir)
        slots = [RaySlot(i, work_dir / f"ray-slot-{i}.log", cfg, name) for i in range(cfg.slots)]
        super().__init__(slots, **pool)

    def close(self) -> None:
        super().close()
        if self.started_ray:
            import ray

            ray.shutdown()

"""torch.distributed helpers: the one place that knows about process groups.

Nothing here creates a process group at import; entry points call :func:`init` and
:func:`shutdown`. Collectives are skipped when the world size is 1, so the same code runs in a
plain single process.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def spans_nodes() -> bool:
    """True when the job's ranks are on more than one node (torchrun's ``--nnodes`` > 1)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size())) < world_size()


def broadcast_object(obj: Any, src_rank: int = 0) -> Any:
    """A picklable object from ``src_rank`` to every rank (returned as is on a world of 1)."""
    if world_size() == 1:
        return obj
    box = [obj if rank() == src_rank else None]
    dist.broadcast_object_list(box, src=src_rank)
    return box[0]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def init(timeout_s: float, backend: str | None = None) -> None:
    """Join the process group torchrun describes in the environment (no-op without one).

    ``timeout_s`` bounds every collective, so a dead or hung rank becomes an error.
    """
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
        # Turn a hung NCCL collective into an error instead of a silent stall.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


def shutdown(clean: bool = True) -> None:
    """Leave the process group. ``clean``: every rank got here, so wait for all of them first
    (tearing gloo down while a peer is still in a collective can abort the process).

    Free any DistributedDataParallel model first (``del ddp``). Its Reducer holds the group too,
    and freed after this, it drops the group's last reference with the GIL held: the group's
    destructor then waits for a gloo thread that is freeing the barrier's tensors and needs the
    GIL, and the rank hangs after its work is done (seen with py-spy in about 1 training job in
    60 under load; pytorch/pytorch#56297). Freed before, the group's last reference goes with
    ``destroy_process_group``, whose binding lets go of the GIL."""
    if dist.is_initialized():
        if clean and world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    if world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def all_reduce_max_scalar(value: float, group=None) -> float:
    """Largest ``value`` over the ranks of ``group`` (default: all): ranks agree on elapsed time
    for time-based triggers."""
    if world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def shard_range(n: int, shard: int, shards: int) -> range:
    """Contiguous, exact shard of ``range(n)``: every index once, no padding duplicates.

    Unlike DistributedSampler (which pads by repeating samples), shard sizes may differ by one.
    """
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} out of range for {shards} shards")
    return range(shard * n // shards, (shard + 1) * n // shards)


def dealt_batches(lengths: list[int], batch_size: int, shard: int, shards: int) -> list[list[int]]:
    """This shard's batches of item indices: all items sorted by length (less padding) and cut
    into batches once for the whole data set, then dealt to the shards in turn.

    Every batch holds the same items whatever the number of shards, so each item is computed
    in a forward pass of the same shape: results agree to the bit across world sizes.
    """
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} out of range for {shards} shards")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    return batches[shard::shards]


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Ranks split into data-parallel replicas of ``mp_size`` consecutive ranks each.

    Within a model/context-parallel group every rank needs the same batch; the group's first
    rank (the data-parallel head) reads it and broadcasts it.
    """

    world_size: int
    rank: int
    mp_size: int = 1

    def __post_init__(self):
        if self.mp_size < 1 or self.world_size % self.mp_size:
            raise ValueError(f"world size {self.world_size} is not divisible by mp_size {self.mp_size}")

    @property
    def dp_size(self) -> int:
        return self.world_size // self.mp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.mp_size

    @property
    def dp_head(self) -> int:
        return self.dp_rank * self.mp_size

    @property
    def is_dp_head(self) -> bool:
        return self.rank == self.dp_head

    def mp_groups(self) -> list[list[int]]:
        return [list(range(s, s + self.mp_size)) for s in range(0, self.world_size, self.mp_size)]


def new_mp_group(layout: ParallelLayout):
    """This rank's model-parallel group; every rank must call this (new_group is collective)."""
    if layout.mp_size == 1 or layout.world_size == 1:
        return None
    mine = None
    for ranks in layout.mp_groups():
        group = dist.new_group(ranks=ranks)
        if layout.rank in ranks:
            mine = group
    return mine


def broadcast_tensor_container(data: Any, src_rank: int = 0, group=None) -> Any:
    """Send ``data`` (tensors, or dicts/lists/tuples of them, or None) from ``src_rank``.

    The structure, shapes and dtypes go first as one small object; then each tensor is
    broadcast. Other ranks pass anything (ignored) and get the source's container back.
    """
    if group is None and world_size() == 1:
        return data
    is_src = dist.get_rank() == src_rank
    leaves: list[torch.Tensor] = []

    def skeleton(node):
        if isinstance(node, torch.Tensor):
            leaves.append(node)
            return ("tensor", tuple(node.shape), node.dtype)
        if isinstance(node, dict):
            return ("dict", {k: skeleton(v) for k, v in node.items()})
        if isinstance(node, (list, tuple)):
            return ("list" if isinstance(node, list) else "tuple", [skeleton(v) for v in node])
        return ("object", node)

    meta = [skeleton(data) if is_src else None]
    dist.broadcast_object_list(meta, src=src_rank, group=group)
    dev = device()
    received: list[torch.Tensor] = []

    def build(node):
        kind, info = node[0], node[1:]
        if kind == "tensor":
            shape, dtype = info
            tensor = leaves[len(received)].to(dev) if is_src else torch.empty(shape, dtype=dtype, device=dev)
            dist.broadcast(tensor, src=src_rank, group=group)
            received.append(tensor)
            return tensor
        if kind == "dict":
            return {k: build(v) for k, v in info[0].items()}
        if kind in ("list", "tuple"):
            items = [build(v) for v in info[0]]
            return items if kind == "list" else tuple(items)
        return info[0]

    return build(meta[0])


def exit_process(code: int) -> None:
    """Exit without interpreter finalization.

    Torch's C++ threads (gloo) can abort the process while Python tears itself down
    ("terminate called without an active exception"), turning a finished job into a failure.
    Results are written and the group destroyed by now, so skipping finalization loses nothing.
    """
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

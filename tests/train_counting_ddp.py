"""``areal_eval.train``, whose ranks print how many DistributedDataParallel models are still
alive when they leave the process group (0, or a rank can hang: see ``distributed.shutdown``)."""

import gc

import torch

from areal_eval import distributed, train

_leave_group = distributed.shutdown


def _counting_shutdown(clean: bool = True) -> None:
    alive = sum(isinstance(o, torch.nn.parallel.DistributedDataParallel) for o in gc.get_objects())
    print(f"rank {distributed.rank()} leaves the group with {alive} DDP model(s) alive", flush=True)
    _leave_group(clean)


def main(argv: list[str]) -> int:
    distributed.shutdown = _counting_shutdown
    return train.main(argv)

"""Exact sharding and the data/model-parallel layout: pure functions, no process group."""

import pytest

from areal_eval import distributed


def test_shards_are_exact_without_padding():
    for n in (0, 1, 7, 101):
        for shards in (1, 2, 3, 4):
            covered = [i for s in range(shards) for i in distributed.shard_range(n, s, shards)]
            assert covered == list(range(n))


def test_parallel_layout():
    layout = distributed.ParallelLayout(world_size=4, rank=3, mp_size=2)
    assert (layout.dp_size, layout.dp_rank, layout.dp_head, layout.is_dp_head) == (2, 1, 2, False)
    assert layout.mp_groups() == [[0, 1], [2, 3]]
    with pytest.raises(ValueError):
        distributed.ParallelLayout(world_size=3, rank=0, mp_size=2)

"""Pipeline stages on the engine (issue 46): the layout's "pipe" dimension, stages sharded zero1/zero2/zero3
over their data-parallel ranks, micro-batches reduced once per step, and a weight tied across the first and
last stage kept one value. Real gloo ranks against one process (DESIGN's fp32 1e-5 / 1e-6)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import shardwise as sw
from shardwise.engine.layout.parallel_layout import ParallelLayout

# ---- the layout's "pipe" dimension ---------------------------------------------------------


def _ranks_of(group) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def _pipe_layout_on_rank(grid) -> dict:
    layout = ParallelLayout.pipelined(grid)
    return {"stage": layout.pipe_rank, "stages": layout.pipe_world, "pipe": _ranks_of(layout.pipe_group),
            "data": _ranks_of(layout.group), "shard": _ranks_of(layout.shard_group),
            "shard_rank": layout.shard_rank, "replicas": layout.replicate_world,
            "replicate": _ranks_of(layout.replicate_group), "mesh": layout.device_mesh is not None}


def test_the_layout_gains_a_pipe_dimension(ranks):
    """Catches a stage's data-parallel group that spans another stage, a pipe group that mixes shard
    coordinates (a tied weight's rows summed with other rows), and a hybrid stage without its mesh:
    pipe 2 x shard 2 and pipe 2 x replicate 2 at ws 4, each rank's groups by global rank."""
    pipe_shard = [[[0, 2]], [[1, 3]]]  # stage 0 on ranks 0 and 2 (the pipeline's replica-major numbering)
    for rank, got in enumerate(ranks.run(_pipe_layout_on_rank, 4, pipe_shard)):
        stage, shard = rank % 2, rank // 2
        assert (got["stage"], got["stages"], got["shard_rank"], got["replicas"]) == (stage, 2, shard, 1)
        assert got["data"] == got["shard"] == [stage, stage + 2]
        assert got["pipe"] == [2 * shard, 2 * shard + 1] and got["replicate"] is None and not got["mesh"]
    pipe_replicate = [[[0], [2]], [[1], [3]]]
    for rank, got in enumerate(ranks.run(_pipe_layout_on_rank, 4, pipe_replicate)):
        stage = rank % 2
        assert got["data"] == got["replicate"] == [stage, stage + 2] and got["shard"] == [rank]
        assert got["replicas"] == 2 and got["mesh"] and got["pipe"] == [rank - stage, rank - stage + 1]


def _bad_grid_on_rank(grid) -> str:
    with pytest.raises(sw.ShardwiseError) as error:
        ParallelLayout.pipelined(grid)
    return str(error.value)


def test_a_grid_that_misses_a_rank_is_refused_on_every_rank(ranks):
    """Catches a grid that leaves a rank out or is ragged: each rank would make other groups (a hang)."""
    for message in ranks.run(_bad_grid_on_rank, 2, [[[0]], [[0]]]) + ranks.run(_bad_grid_on_rank, 2, [[[0, 1]], [[1]]]):
        assert "pipeline grid" in message, message

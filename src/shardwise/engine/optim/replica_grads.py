"""Whole copies' gradients averaged over their data-parallel group: the engine's reduce for a module
that every rank of a group holds whole and steps with its own optimizer. Uses: collectives, parallel_layout.

Note [whole replicas]: the pipeline's default route (`PipelineConfig(strategy=None)`) keeps every layer
whole on every rank, for speed, and runs its stages under torch's own `PipelineStage`: the engine's zero
strategies would cut the layers into rows, and torch's `DistributedDataParallel` under `PipelineStage`
fails on gloo (docs/pipeline.md). What such a stage still needs from data parallelism is one thing: after
the step's backward, each replica's gradient (the mean over its samples) replaced by the mean over every
replica, i.e. over the stage's data-parallel ranks of its `ParallelLayout` (`layout.group`, made by the
layout like every other group). It is done here, so the pipeline keeps no data-parallel code of its own.
A parameter the step did not reach on some rank contributes zeros there, and then holds the average.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardwise.engine.comm.collectives import all_reduce_avg_async
from shardwise.engine.layout.parallel_layout import ParallelLayout


def average_replica_gradients(params: Sequence[nn.Parameter], layout: ParallelLayout) -> None:
    """Set every parameter's `.grad` to the mean over `layout`'s data-parallel ranks of their `.grad` (one
    flat all-reduce; a collective over `layout.group`, the same parameters in the same order on each)."""
    if not params or layout.group is None or dist.get_world_size(layout.group) == 1:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    all_reduce_avg_async(flat, layout.group, what="the whole replicas' gradient average").wait()
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()

"""The two collectives of the engine, and the layout changes around them.

A unit's shards travel as one flat, rank-major buffer: rank r's rows of every
parameter, one parameter after another (`S` elements per rank). Full values live
param-major: each parameter's padded rows of all ranks, contiguous, so a parameter's
full tensor is a plain view. Going between the two is one strided copy per parameter
("copy-out" after an all-gather, "pack" before a reduce-scatter).

Every call names its process group: nothing here reads global state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class Pending:
    """An in-flight collective and what to do with its result once it lands."""

    work: object | None  # dist.Work, or None when it already completed
    output: Tensor

    def wait(self) -> Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.output


def all_gather(shard_flat: Tensor, world_size: int, group, async_op: bool) -> Pending:
    """Gather every rank's flat shard into one rank-major buffer of `world_size * S`."""
    gathered = torch.empty(world_size * shard_flat.numel(), dtype=shard_flat.dtype, device=shard_flat.device)
    work = dist.all_gather_single(gathered, shard_flat, group=group, async_op=async_op)
    return Pending(work, gathered)


def reduce_scatter_avg(packed: Tensor, world_size: int, group, async_op: bool) -> Pending:
    """Average a rank-major `world_size * S` buffer across ranks; this rank gets its `S` rows."""
    shard = torch.empty(packed.numel() // world_size, dtype=packed.dtype, device=packed.device)
    work = dist.reduce_scatter_single(shard, packed, op=dist.ReduceOp.AVG, group=group, async_op=async_op)
    return Pending(work, shard)


def copy_out(gathered: Tensor, world_size: int, segments: list[tuple[int, int]], full_regions: list[Tensor]) -> None:
    """Rank-major gathered rows -> each parameter's param-major padded region.

    `segments[i]` is (offset, numel) of parameter i inside one rank's shard;
    `full_regions[i]` is its padded full region (`world_size * numel` elements).
    """
    by_rank = gathered.view(world_size, -1)
    for (offset, numel), region in zip(segments, full_regions):
        region.view(world_size, numel).copy_(by_rank[:, offset : offset + numel])


def pack(grads: list[Tensor | None], rows: list[int], world_size: int, segments: list[tuple[int, int]],
         total: int, like: Tensor) -> Tensor:
    """Full gradients (None = unused this step: zeros) -> one rank-major buffer for reduce-scatter."""
    packed = torch.zeros(world_size, total, dtype=like.dtype, device=like.device)
    for grad, num_rows, (offset, numel) in zip(grads, rows, segments):
        if grad is None or numel == 0:
            continue
        target = packed[:, offset : offset + numel]
        flat = grad.reshape(-1)
        if flat.numel() == world_size * numel:
            target.copy_(flat.view(world_size, numel))
        else:  # the last rank's rows are padding: copy the real rows through a padded view
            padded = torch.zeros(world_size * numel, dtype=flat.dtype, device=flat.device)
            padded[: flat.numel()] = flat
            target.copy_(padded.view(world_size, numel))
    return packed.view(-1)

"""The training loop several test files share: a zoo model's steps on this rank's slice of each global batch,
each step's loss averaged over the ranks."""

from __future__ import annotations

import torch.distributed as dist

from shardwise.testing import global_batch, rank_slice


def train_losses(model, optimizer, spec, steps: int, batches: int | None = None, global_batch_size: int = 8,
                 ) -> list[float]:
    """`steps` steps of forward, backward, step, zero_grad on zoo model `model` (spec `spec`); `batches`: cycle
    through that many global batches (learnable: the same data again and again), else a new one each step.
    Each step's loss, averaged over the ranks."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        x, y = rank_slice(global_batch(spec, step if batches is None else step % batches, global_batch_size),
                          rank, world_size)
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach().float()
        dist.all_reduce(value, op=dist.ReduceOp.AVG)
        losses.append(value.item())
    return losses

"""The two collectives of a sliced layer pair, as autograd functions (Megatron-LM's f and g).

Note [f and g]: a column-sliced layer needs its whole input on every rank of the tensor
group, and a row-sliced layer leaves each rank with a partial sum of the output. Megatron
names the two operators that join them:
- f (`copy_to_slices`): forward the identity (the input is already the same on every rank);
  backward an all-reduce (sum), since every rank's slice contributed to the input's gradient.
- g (`reduce_from_slices`): forward an all-reduce (sum) of the partial outputs; backward the
  identity (the output's gradient is already the same on every rank).
A column/row pair (an MLP's up and down projections, attention's q/k/v and output) therefore
costs one all-reduce in forward (g) and one in backward (f). The tensor group is distinct from
the data-parallel group, so these collectives never interleave with the engine's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class _CopyToSlices(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromSlices(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def copy_to_slices(x: Tensor, group) -> Tensor:
    """Note [f and g]: f, identity forward and all-reduced gradient (nothing to do for one slice)."""
    return x if dist.get_world_size(group) == 1 else _CopyToSlices.apply(x, group)


def reduce_from_slices(x: Tensor, group) -> Tensor:
    """Note [f and g]: g, all-reduced forward and identity gradient (nothing to do for one slice)."""
    return x if dist.get_world_size(group) == 1 else _ReduceFromSlices.apply(x, group)


def gather_along(local: Tensor, dim: int, sizes: list[int], group) -> Tensor:
    """Every rank's `local` (its `sizes[r]` entries along `dim`) concatenated along `dim`, on every rank.

    Ranks may hold different sizes (an uneven split), so each pads to the largest first."""
    world = len(sizes)
    if world == 1:
        return local
    biggest = max(sizes)
    pad = list(local.shape)
    pad[dim] = biggest - local.shape[dim]
    padded = torch.cat([local, local.new_zeros(pad)], dim=dim) if pad[dim] else local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part.narrow(dim, 0, size) for part, size in zip(parts, sizes)], dim=dim)

"""`sw.clip_grad_norm_` on a sliced model: the norm over whole gradients, from slices and shards.

Note [sliced norm]: a sliced parameter's gradient is spread over the tensor group (each rank
its slice) and, under zero3, over the data group (each rank its rows of the slice); a
parameter no plan slices (a norm, a row-sliced layer's bias) has the same gradient on every
tensor rank. So the norm raised to p is this rank's sum over sliced gradients' rows plus, on
tensor rank 0 only, its unsliced gradients' rows, summed over every rank of the mesh (over
the tensor group alone when no engine shards the data axis: replicas hold equal gradients;
on a replicate x shard x tensor mesh, over replica 0's ranks alone, for the same reason).
Each rank's part is torch's arithmetic (one norm per tensor, `_foreach_norm`, in the gradients'
dtype, no float64 copy; Note [clip arithmetic]); the ∞-norm is the largest over every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardwise.engine import engine_of
from shardwise.engine.optim.grads import tensor_norms
from shardwise.engine.protocol import is_sliced_param


def clip_sliced_grad_norm_(model: nn.Module, slicing, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient so the global norm is at most `max_norm`; return the norm before (Note [sliced norm])."""
    engine = engine_of(model)
    if engine is not None and engine.shards_rows:
        params, group = [s for u in engine.units for s in u.shard_params], dist.group.WORLD
    else:
        params, group = list(model.parameters()), slicing.group
    grads = [(p.grad, is_sliced_param(p)) for p in params if p.grad is not None]
    counted = [g for g, sliced in grads if sliced or slicing.rank == 0]
    if engine is not None and engine.shards_rows and engine.mesh.replicate_rank != 0:
        counted = []  # Note [sliced mesh]: the other replicas hold the same rows; replica 0 counts them
    norm_type = float(norm_type)
    device = params[0].device if params else torch.device("cpu")
    if norm_type == float("inf"):
        total = torch.cat([_norms([g for g, _ in grads], norm_type, device), torch.zeros(1, device=device)]).max()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        # The norm of the per-tensor norms, raised to p so that the ranks' parts add up.
        powered = _norms(counted, norm_type, device).pow(norm_type).sum()  # 0 where this rank counts nothing
        dist.all_reduce(powered, group=group)
        total = powered.pow(1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's own formula
    for grad, _ in grads:
        grad.mul_(coefficient.to(grad.dtype))
    return total


def _norms(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """grads.tensor_norms, or none on `device` (the group's: an NCCL all-reduce follows) where this rank has none."""
    return tensor_norms(grads, norm_type) if grads else torch.zeros(0, device=device)

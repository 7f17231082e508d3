"""Gradient helpers that work on any model, sharded or not: accumulation and clipping."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from shardwise.engine.info import engine_of
from shardwise.engine.step_in_backward import steps_in_backward
from shardwise.errors import ShardwiseError


@contextmanager
def no_sync(model: nn.Module):
    """Accumulate gradients locally, skipping the cross-rank reduction, inside this block.

    Use it for every micro-batch but the last of a step. On an unsharded model it does
    nothing. Memory: ddp keeps its usual full gradients, so accumulation costs nothing extra.
    """
    engine = engine_of(model)
    with engine.no_sync() if engine is not None else nullcontext():
        yield


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm`; return the norm before clipping.

    The norm is over the whole model's gradients on all ranks, the same number a single
    process would compute.
    """
    engine = engine_of(model)
    if steps_in_backward(model):
        raise ShardwiseError(
            "sw.clip_grad_norm_ with sw.optimizer_in_backward: each unit was already stepped during backward, "
            "before the global norm existed, so there is nothing left to clip. Clip without "
            "optimizer_in_backward, or turn clipping off (Trainer: TrainingArguments(max_grad_norm=0); "
            "Lightning: gradient_clip_val=None) (Note [optimizer in backward])."
        )
    slicing = getattr(model, "_sw_slicing", None)  # sliced by sw.slice: Note [sliced norm] (parallel/slicing)
    if slicing is not None:
        return slicing.clip_grad_norm_(model, max_norm, norm_type)
    if engine is not None and hasattr(engine, "units"):  # zero: each rank holds some gradient rows
        grads = [s.grad for u in engine.units for s in u.shard_params if s.grad is not None]
        return _clip_sharded(grads, max_norm, float(norm_type), engine.group)
    # Unsharded and ddp: every rank holds the full, already-averaged gradients.
    grads = [p for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type)


def _clip_sharded(grads: list[torch.Tensor], max_norm: float, norm_type: float, group) -> torch.Tensor:
    """Global gradient norm over every rank's shards (padding rows are zero), then scale."""
    if norm_type == float("inf"):
        local = max((g.abs().max() for g in grads), default=torch.tensor(0.0)).clone().float()
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total = local
    else:
        local = sum((g.double().abs().pow(norm_type).sum() for g in grads), torch.tensor(0.0, dtype=torch.float64))
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        total = local.pow(1.0 / norm_type).float()
    # The same coefficient torch.nn.utils.clip_grad_norm_ computes, so results match it.
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(grad.dtype))
    return total

"""Gradient helpers that work on any model, sharded or not: accumulation, clipping and per-parameter norms.
Uses: compat, protocol, small.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from shardwise.engine.comm.small import all_reduce_max, all_reduce_sum
from shardwise.engine.compat import plain_tensors, unwrap_compiled
from shardwise.engine.protocol import engine_of, slicing_of
from shardwise.errors import ShardwiseError


@contextmanager
def no_sync(model: nn.Module):
    """Accumulate gradients locally, skipping the cross-rank reduction, inside this block.

    Use it for every micro-batch but the last of a step. On an unsharded model it does
    nothing. Memory: ddp keeps its usual full gradients, so accumulation costs nothing extra.
    """
    engine = engine_of(unwrap_compiled(model))
    with engine.no_sync() if engine is not None else nullcontext():
        yield


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm`; return the norm before clipping.

    The norm is over the whole model's gradients on all ranks, with torch's arithmetic: one norm
    per tensor in the gradients' dtype, then the norm of those norms (Note [clip arithmetic]);
    at one rank it equals `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` bitwise.
    """
    model = unwrap_compiled(model)  # the compiled handle too
    engine = engine_of(model)
    if engine is not None and engine.steps_in_backward():
        raise ShardwiseError(
            "sw.clip_grad_norm_ with sw.optimizer_in_backward: each unit was already stepped during backward, "
            "before the global norm existed, so there is nothing left to clip. Clip without "
            "optimizer_in_backward, or turn clipping off (Trainer: TrainingArguments(max_grad_norm=0); "
            "Lightning: gradient_clip_val=None) (Note [optimizer in backward])."
        )
    slicing = slicing_of(model)  # sliced by sw.slice: Note [sliced norm] (parallel/slicing)
    if slicing is not None:
        return slicing.clip_grad_norm_(model, max_norm, norm_type)
    if engine is not None and engine.shards_rows:  # zero: each rank holds some gradient rows
        # model.parameters() order, as torch's clip_grad_norm_(model.parameters()) stacks its norms.
        # Each gradient read once: `p.grad` of a shard is a property (shard_param.py), 4 Python calls a read.
        grads = [grad for p in model.parameters() if getattr(p, "_sw_unit", None) is not None
                 for grad in (p.grad,) if grad is not None]
        return _clip_sharded(grads, max_norm, float(norm_type), engine.mesh.norm_group)  # Note [mesh info]
    # Unsharded and ddp: every rank holds the full, already-averaged gradients.
    grads = [p for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type)


def grad_norms(model: nn.Module, norm_type: float = 2.0) -> dict[str, torch.Tensor]:
    """Each parameter's gradient norm over the whole tensor, by name (parameters without a gradient are left
    out): per-layer logging. On a sharded model every rank's rows count (one all-reduce: call it on every
    rank) and every rank gets the same values; `p.grad.norm()` would be this rank's rows' and is refused
    (Note [rows read whole], shard_param.py)."""
    return _per_parameter_norms(model, lambda p: p.grad, float(norm_type))


def param_norms(model: nn.Module, norm_type: float = 2.0) -> dict[str, torch.Tensor]:
    """Each parameter's norm over the whole tensor, by name, as `grad_norms` (a collective on a sharded model)."""
    return _per_parameter_norms(model, lambda p: p.detach(), float(norm_type))


def _per_parameter_norms(model: nn.Module, read, norm_type: float) -> dict[str, torch.Tensor]:
    """One norm per tensor with torch's arithmetic (Note [clip arithmetic]): a sharded tensor's is the p-norm
    of its rows' norms over the shard group (padding rows are zero; replicas hold the same rows)."""
    model = unwrap_compiled(model)
    if slicing_of(model) is not None:
        raise ShardwiseError("per-parameter norms of a sliced model (sw.slice) are not computed yet: read "
                             "sw.full_parameters(model) for whole values, or sw.clip_grad_norm_ for the global norm")
    engine = engine_of(model)
    named = [(name, p, read(p)) for name, p in model.named_parameters()]
    named = [(name, p, value) for name, p, value in named if value is not None]
    if not named:
        return {}
    norms = list(tensor_norms([value for _, _, value in named], norm_type).unbind())
    if engine is not None and engine.shards_rows and dist.get_world_size(engine.mesh.norm_group) > 1:
        # Picked by index on the host, never by a mask tensor: a CPU mask beside device norms is a device
        # mismatch in torch.where, and a mask copied to the device a host-to-device copy per call (issue 58).
        # A host-shared (frozen="host") parameter is whole on every rank: its own norm stands.
        rows = [i for i, (_, p, _) in enumerate(named) if getattr(p, "_sw_unit", None) is not None]
        if rows:
            summed = torch.stack([norms[i] for i in rows])
            if norm_type == float("inf"):
                all_reduce_max(summed, engine.mesh.norm_group, "the per-parameter norms")
            else:
                summed = summed.pow(norm_type)
                all_reduce_sum(summed, engine.mesh.norm_group, "the per-parameter norms")
                summed = summed.pow(1.0 / norm_type)
            for i, norm in zip(rows, summed.unbind()):
                norms[i] = norm
    return {name: norm for (name, _, _), norm in zip(named, norms)}


def _clip_sharded(grads: list[torch.Tensor], max_norm: float, norm_type: float, group) -> torch.Tensor:
    """torch's arithmetic over every rank's rows (Note [clip arithmetic]), then scale."""
    if not grads:
        return torch.tensor(0.0)
    if dist.get_world_size(group) == 1:  # the rows are the tensors: torch's own function, bitwise
        total = torch.nn.utils.get_total_norm(grads, norm_type)
    else:
        total = _global_norm(grads, norm_type, group)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch.nn.utils.clip_grads_with_norm_
    torch._foreach_mul_(grads, coefficient.to(grads[0].device))
    return total


def tensor_norms(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """One norm per tensor in its own dtype, as float32: torch's arithmetic (Note [clip arithmetic]), in one
    `_foreach_norm` called directly (get_total_norm loops over a type not registered for foreach, as a
    zero3 shard's gradient is not), with RowsGrad, which refuses norms to everyone else, read plain."""
    with plain_tensors():
        return torch.stack(torch._foreach_norm(grads, norm_type)).float()


def _global_norm(grads: list[torch.Tensor], norm_type: float, group) -> torch.Tensor:
    """Note [clip arithmetic]: torch takes one norm per tensor in the gradients' dtype, then the
    norm of those norms. A tensor's norm over ranks is the p-norm of its rows' norms (padding
    rows are zero), so each rank sends its rows' norms, raised to p, in one all-reduce; the
    float64 sum of every element that shardwise used before ended 1.15e-4 from one process on
    an OPT model after 5 clipped steps, where torch DDP ends 1.3e-6."""
    local = tensor_norms(grads, norm_type)
    if norm_type == float("inf"):
        all_reduce_max(local, group, "the gradient norm")
        per_tensor = local
    else:
        powered = local.pow(norm_type)
        all_reduce_sum(powered, group, "the gradient norm")
        per_tensor = powered.pow(1.0 / norm_type)
    return torch.linalg.vector_norm(per_tensor, norm_type)

"""Gradient helpers that work on any model, sharded or not: accumulation and clipping."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from shardwise.strategies import state_of


@contextmanager
def no_sync(model: nn.Module):
    """Accumulate gradients locally, skipping the cross-rank reduction, inside this block.

    Use it for every micro-batch but the last of a step. On an unsharded model it does
    nothing. Memory: ddp keeps its usual full gradients, so accumulation costs nothing extra.
    """
    state = state_of(model)
    with state.no_sync() if state is not None else nullcontext():
        yield


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm`; return the norm before clipping.

    The norm is over the whole model's gradients on all ranks, the same number a single
    process would compute.
    """
    state = state_of(model)
    if state is not None and hasattr(state, "clip_grad_norm_"):
        return state.clip_grad_norm_(max_norm, norm_type)
    # Unsharded and ddp: every rank holds the full, already-averaged gradients.
    grads = [p for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type)

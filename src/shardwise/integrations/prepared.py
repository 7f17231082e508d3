"""What every trainer integration does to a sharded model before the trainer sees it."""

from __future__ import annotations

from torch import nn

from shardwise.engine.grads import no_sync


def mark_prepared(model: nn.Module) -> None:
    """Tell Accelerate (which the transformers Trainer uses too) that `model` needs no wrapper,
    and give it the `no_sync()` Accelerate's `accumulate()` looks for, so gradient accumulation
    skips the reduce on all but the last micro-batch, as DDP's does."""
    model._is_accelerate_prepared = True  # Accelerate: no DistributedDataParallel around it
    model.no_sync = lambda: no_sync(model)

"""What every trainer integration does to a sharded model before the trainer sees it."""

from __future__ import annotations

from types import MethodType

from torch import nn

from shardwise.engine.optim.grads import no_sync


def mark_prepared(model: nn.Module) -> None:
    """Tell Accelerate (which the transformers Trainer uses too) that `model` needs no wrapper,
    and give it the `no_sync()` Accelerate's `accumulate()` looks for, so gradient accumulation
    skips the reduce on all but the last micro-batch, as DDP's does."""
    model._is_accelerate_prepared = True  # Accelerate: no DistributedDataParallel around it
    model.no_sync = lambda: no_sync(model)


# Accelerate's GradScaler would check this rank's rows only for inf/NaN: the fix both integrations give.
FP16_FIX = ("shard with sw.shard(model, strategy=..., precision=\"fp16\") and leave fp16 off: shardwise's loss "
            "scaler agrees on inf/NaN across ranks, Accelerate's GradScaler would check this rank's rows only")


def autocast_forward(model: nn.Module, accelerator) -> None:
    """Run `model`'s forward under the accelerator's autocast, outputs in fp32: what Accelerate's
    `prepare_model` does to an unsharded model, and skips for one `mark_prepared` marked."""
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    context = get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
    model._original_forward = model.forward
    if hasattr(model.forward, "__func__"):
        model.forward = MethodType(convert_outputs_to_fp32(context(model.forward.__func__)), model)
    else:
        model.forward = convert_outputs_to_fp32(context(model.forward))

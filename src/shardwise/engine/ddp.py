"""`strategy="ddp"`: torch's DistributedDataParallel, applied in place.
Uses: compat, host_copy, protocol.

DDP's C++ reducer is the engine (bucketed all-reduce overlapped with backward); we do
not rewrite it. What shardwise adds is the in-place contract every strategy keeps: the
user's `model` object stays the model, its `state_dict()` keys carry no `module.`
prefix, and calling `model(x)` goes through DDP.

How: DDP wraps a small proxy module that owns `model` and calls its *original*
forward. `model.forward` is then replaced by a call into DDP, so `model(x)` runs the
user's hooks once, then DDP's pre-forward bookkeeping, then the real forward.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardwise.config import ShardConfig
from shardwise.engine.compat import DDP_IGNORE_ATTRIBUTE
from shardwise.engine.memory.host_copy import host_param_names
from shardwise.engine.protocol import Engine
from shardwise.errors import ShardwiseError


class _ForwardProxy(nn.Module):
    """What DDP wraps: owns the model (so DDP sees its parameters) and runs its original forward."""

    def __init__(self, model: nn.Module, original_forward):
        super().__init__()
        self.model = model
        self._original_forward = original_forward

    def forward(self, *args, **kwargs):
        return self._original_forward(*args, **kwargs)


class DDPEngine(Engine):
    """What `shard(..., strategy="ddp")` attaches to the model (Note [engine protocol])."""

    strategy = "ddp"

    def __init__(self, model: nn.Module, process_group, find_unused_parameters: bool):
        self.group = process_group
        self.original_forward = model.forward
        device_ids = None
        if next(model.parameters(), torch.empty(0)).device.type not in ("cpu", "meta"):
            device_ids = [torch.accelerator.current_device_index()]  # the accelerator's, CUDA or not
        proxy = _ForwardProxy(model, model.forward)
        # Host-shared frozen weights (Note [host copy]): DDP's start-up broadcast would write them.
        setattr(proxy, DDP_IGNORE_ATTRIBUTE, [f"model.{name}" for name in host_param_names(model)])
        self.ddp = DistributedDataParallel(
            proxy,
            device_ids=device_ids,
            process_group=process_group,
            find_unused_parameters=find_unused_parameters,
            # Grads alias the all-reduce buckets: one copy of the gradients, not two.
            gradient_as_bucket_view=True,
        )
        self.find_unused_parameters = find_unused_parameters

    def forward(self, *args, **kwargs):
        try:
            return self.ddp(*args, **kwargs)
        except RuntimeError as error:
            if "find_unused_parameters" not in str(error) or self.find_unused_parameters:
                raise
            raise ShardwiseError(
                "a trainable parameter received no gradient in the previous step, so DDP could not "
                "finish its all-reduce (and that step's update used unreduced gradients: restart "
                "from a checkpoint). If the model skips parameters in some steps (an unused branch, "
                "a layer frozen mid-training), pass "
                "`sw.shard(model, strategy='ddp', find_unused_parameters=True)`; it costs one extra "
                "graph traversal per step. The zero strategies handle this without a flag."
            ) from error

    @contextmanager
    def no_sync(self):
        with self.ddp.no_sync():
            yield

    def parameters_with_grads(self, model: nn.Module):
        return [p for p in model.parameters() if p.grad is not None]


def apply_ddp(model: nn.Module, group: dist.ProcessGroup, config: ShardConfig) -> DDPEngine:
    """Wrap `model` with DDP in place (see the module docstring) and return its engine."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ShardwiseError("the model has no trainable parameter (all have requires_grad=False): nothing to train")
    engine = DDPEngine(model, group, config.find_unused_parameters)
    model.forward = engine.forward  # instance attribute: model(x) now goes through DDP
    return engine

"""Mixed precision at run time: a loss scaler whose overflow check all ranks agree on.
Uses: compat, protocol, small.

The policy itself (`MixedPrecision`) is in shardwise/config.py.

Shards stay the optimizer's fp32 masters; a gathered unit holds its full values in
`param_dtype`, so forward and backward compute in it; gradients are reduced in
`reduce_dtype` (fp32 by default: a bf16 reduction over many ranks loses the low bits
of every sum, a known source of instability at scale) and land on the fp32 shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from shardwise.engine.comm.small import all_reduce_max
from shardwise.engine.compat import plain_tensors, unwrap_compiled
from shardwise.engine.protocol import engine_of, slicing_of
from shardwise.errors import ShardwiseError
from shardwise.wire.backends import device_of


def cast_floating_inputs(dtype: torch.dtype):
    """A forward pre-hook (with kwargs) casting floating inputs to `dtype`, as FSDP2 casts
    forward inputs; integer inputs such as token ids are left alone."""
    def cast(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        return value

    def hook(module, args, kwargs):
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook


# Raised by both sides: a loss scaler refuses a model stepped in backward, and sw.optimizer_in_backward a scaled one.
NO_SCALING = ("sw.optimizer_in_backward with a loss scaler: each unit is stepped during backward, before "
               "the scaler could unscale its gradients or skip an overflowing step. Use precision='bf16' or "
               "'fp32' without a scaler, or no optimizer_in_backward.")


class LossScaler:
    """Dynamic loss scaling for fp16, with the overflow verdict agreed across ranks.

    Each rank holds different gradient rows, so an inf/NaN may appear on one rank only;
    the verdict is all-reduced (MAX) so every rank skips the same step and lowers the
    scale together — otherwise their shards would silently diverge.

        scaler = sw.LossScaler(model)
        scaler.scale(loss).backward()
        scaler.unscale_(optim); sw.clip_grad_norm_(model, 1.0)   # optional
        scaler.step(optim); scaler.update(); optim.zero_grad()
    """

    def __init__(self, model: nn.Module, *, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        model = unwrap_compiled(model)  # the compiled handle too
        engine = engine_of(model)
        self.group = engine.group if engine is not None else None
        if slicing_of(model) is not None:  # sliced (sw.slice): tensor ranks hold other
            self.group = None  # gradients than their data group's, so the whole mesh (the world) agrees
        if engine is not None and engine.steps_in_backward():
            raise ShardwiseError(NO_SCALING)
        model._sw_loss_scaler = True  # read by sw.optimizer_in_backward, which refuses it
        self.model = model
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self._good_steps = 0
        self._unscaled = False
        self.found_overflow = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current scale: call `.backward()` on this."""
        return loss * self.scale_value

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide gradients by the scale and agree across ranks whether any is inf/NaN."""
        if self._unscaled:
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        overflow = torch.zeros(1, device=grads[0].device if grads else _group_device(self.group))
        if grads:
            with plain_tensors():  # a shard's RowsGrad refuses norms to users; this one is per tensor
                torch._foreach_mul_(grads, 1.0 / self.scale_value)
                largest = torch.stack(torch._foreach_norm(grads, float("inf")))  # inf or NaN where any is
            overflow = (~torch.isfinite(largest)).any().float().reshape(1)  # on the device: no host read
        if dist.is_initialized():
            all_reduce_max(overflow, self.group, "the loss scaler's overflow check")
        # The one host read of a step under a loss scaler (torch's GradScaler makes it too): whether
        # to step is decided in Python.
        self.found_overflow = bool(overflow.item())
        self._unscaled = True

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step unless some rank overflowed; returns whether the step was taken."""
        self.unscale_(optimizer)
        if not self.found_overflow:
            optimizer.step()
        return not self.found_overflow

    def update(self) -> None:
        """Lower the scale after an overflow; raise it after `growth_interval` clean steps."""
        if self.found_overflow:
            self.scale_value *= self.backoff_factor
            self._good_steps = 0
        else:
            self._good_steps += 1
            if self._good_steps % self.growth_interval == 0:
                self.scale_value *= self.growth_factor
        self._unscaled = False
        self.found_overflow = False


def _group_device(group) -> torch.device:
    """Where `group`'s collectives take tensors, for a rank with no gradient: where its peers' gradients are (the
    accelerator on NCCL, a mixed group's included: Note [group backends])."""
    return device_of(group) if dist.is_initialized() else torch.device("cpu")

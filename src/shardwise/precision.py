"""Mixed precision: a small policy, and a loss scaler whose overflow check all ranks agree on.

Shards stay the optimizer's fp32 masters; a gathered unit holds its full values in
`param_dtype`, so forward and backward compute in it; gradients are reduced in
`reduce_dtype` (fp32 by default: a bf16 reduction over many ranks loses the low bits
of every sum, a known source of instability at scale) and land on the fp32 shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardwise.errors import ShardwiseError

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class MixedPrecision:
    """`param_dtype`: gathered parameters and compute. `reduce_dtype`: gradient reduction.
    `buffer_dtype`: module buffers (None keeps them as they are)."""

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    buffer_dtype: torch.dtype | None = None

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ShardwiseError(f"MixedPrecision.{field}={value!r} must be a floating torch.dtype, "
                                     "e.g. torch.bfloat16")


def resolve_precision(precision: str | MixedPrecision | None) -> MixedPrecision:
    """`"fp32" | "bf16" | "fp16"` (compute in that dtype, reduce in fp32) or a policy."""
    if precision is None:
        return MixedPrecision()
    if isinstance(precision, MixedPrecision):
        return precision
    if precision not in _DTYPES:
        raise ShardwiseError(f"precision={precision!r} is not one of {sorted(_DTYPES)} or a MixedPrecision(...)")
    return MixedPrecision(param_dtype=_DTYPES[precision])


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
        state = getattr(model, "_shardwise", None)
        self.group = getattr(state, "group", None) or getattr(state, "process_group", None)
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
        overflow = torch.zeros(1)
        for grad in grads:
            grad.mul_(1.0 / self.scale_value)
            if not torch.isfinite(grad).all():
                overflow.fill_(1.0)
        if dist.is_initialized():
            dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=self.group)
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

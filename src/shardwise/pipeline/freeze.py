"""`FreezePolicy`: how many leading layers are frozen, by hand or by PipeTransformer's rule.

PipeTransformer (He et al., ICML 2021) observed that networks converge bottom-up: the
first layers' gradients settle first. Its rule freezes a growing prefix: a layer whose
gradient norm has stopped changing (relative change per window below a threshold)
counts as converged, and the frozen prefix grows over the leading converged layers,
but by at most a fraction alpha of the still-active layers per decision, so a noisy
window cannot freeze the whole network at once. The prefix only ever grows: unfreezing
would need the optimizer state that freezing dropped.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardwise.engine.optim.grads import tensor_norms
from shardwise.errors import ShardwiseError


class FreezePolicy:
    """Decides the frozen prefix length; only grows.

    `threshold`: a layer counts as converged when its gradient norm changed by less than
    this fraction between the last two windows (None: no automatic freezing, only
    `freeze_until`). `alpha`: one decision freezes at most
    `max(1, floor(alpha * active layers))` more layers. `max_frozen`: never freeze more
    than this many layers (default: all but the last, which computes the loss).
    """

    def __init__(self, *, threshold: float | None = None, alpha: float = 0.5, max_frozen: int | None = None):
        if threshold is not None and not threshold > 0:
            raise ShardwiseError(f"FreezePolicy.threshold must be > 0 (or None for manual only), got {threshold!r}")
        if not 0 < alpha <= 1:
            raise ShardwiseError(f"FreezePolicy.alpha must be in (0, 1], got {alpha!r}")
        if max_frozen is not None and max_frozen < 0:
            raise ShardwiseError(f"FreezePolicy.max_frozen must be >= 0, got {max_frozen!r}")
        self.threshold, self.alpha, self.max_frozen = threshold, alpha, max_frozen
        self.num_frozen = 0
        self._requested = 0
        self.history: list[list[float]] = []  # per window: gradient norm of every layer

    def freeze_until(self, num_layers: int) -> None:
        """Ask for layers [0, num_layers) to be frozen at the next `update` (manual freezing)."""
        if num_layers < self.num_frozen:
            raise ShardwiseError(
                f"freeze_until({num_layers}) would unfreeze layers: {self.num_frozen} are already frozen "
                "and the frozen prefix only grows"
            )
        self._requested = max(self._requested, num_layers)

    def record(self, grad_norms: Sequence[float]) -> None:
        """Record one window's (an epoch's) gradient norm of every layer (0 for frozen ones)."""
        self.history.append([float(n) for n in grad_norms])

    def change_rates(self) -> list[float] | None:
        """Relative change of each layer's gradient norm over the last two windows (None before two)."""
        if len(self.history) < 2:
            return None
        before, now = self.history[-2], self.history[-1]
        # A layer with no gradient in either window (no trainable parameters) has settled.
        return [abs(b - a) / a if a > 0 else (0.0 if b == 0 else math.inf) for a, b in zip(before, now)]

    def update(self, num_layers: int) -> int:
        """Apply the requested and the automatic rule; return the new frozen prefix length."""
        limit = num_layers - 1 if self.max_frozen is None else min(self.max_frozen, num_layers - 1)
        target = max(self.num_frozen, self._requested)
        rates = self.change_rates() if self.threshold is not None else None
        if rates is not None:
            converged = self.num_frozen
            while converged < num_layers and rates[converged] < self.threshold:
                converged += 1
            step = max(1, math.floor(self.alpha * (num_layers - self.num_frozen)))
            target = max(target, min(converged, self.num_frozen + step))
        self.num_frozen = max(self.num_frozen, min(target, limit))
        return self.num_frozen


class GradNormWindow:
    """Each layer's gradient norm over an epoch (the mean over its steps), what `FreezePolicy.record` takes.

    A rank records, per step, the sum of squares of the gradients it holds of each layer it owns: a
    whole-copy stage's whole tensors, or a sharded stage's rows (Note [rows]). `window` sums those
    over every rank and divides by how many ranks hold each row (`copies`: the replicas of a row), so
    each layer's squared norm is its whole gradient's on either route, then takes the root per step.
    Every rank records every step (zeros where it owns nothing), so the sums line up."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.steps: list[Tensor] = []

    def record(self, params: Sequence[nn.Parameter], layers: Tensor) -> None:
        """One step: `params`' gradients (a missing one counts zero), `layers[i]` the layer of `params[i]`."""
        squares = torch.zeros(self.num_layers, dtype=torch.float64)
        if params:  # kept as tensors (no per-parameter .item()): this runs every step
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            squares.index_add_(0, layers, tensor_norms(grads, 2.0).double().pow(2))  # a shard's: its rows
        self.steps.append(squares)

    def window(self, group: dist.ProcessGroup, copies: int) -> list[float]:
        """Every layer's mean gradient norm over the recorded steps (a collective over `group`)."""
        rows = torch.stack(self.steps) if self.steps else torch.zeros(1, self.num_layers, dtype=torch.float64)
        dist.all_reduce(rows, group=group)
        return (rows / copies).sqrt().mean(dim=0).tolist()

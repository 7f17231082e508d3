"""A unit window's autograd pieces: `GatherUnit`, `Use`, and the per-window `StepState`.

Note [unit window]: a window runs from the first forward after the shards were installed
to the end of the backward through it. The unit's first use in the window runs
`GatherUnit`, an autograd function whose outputs are the full parameter views; every
later use in the window — a block reused N times, a module shared by two branches, a
unit used again after others ran (A, B, A), a second forward before one backward
(`model(a) + model(b)`: siamese and contrastive losses) — uses those same tensors. So
autograd sums every use's gradient and runs `GatherUnit.backward` once per backward,
after the last use: that is where the unit's gradients are reduced, each contribution
exactly once. Each forward pass reaches those views through a `Use` node of its own,
which only that forward's graph holds: a later forward joins the open window while any
`Use` node of it is alive (a weak reference: a graph that may still be backwarded keeps
it alive); once all are gone, nothing can backward through the window and it is closed. zero3
frees a unit whenever another unit opens and gathers it again at its next use, forward
or backward: one extra gather for each non-consecutive reuse, which is the price of
keeping one unit's full values (plus the prefetched one) at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardwise.engine.flat_unit import FlatUnit


class GatherUnit(torch.autograd.Function):
    """Forward: hand out the unit's full views. Backward: give the full grads to the engine."""

    @staticmethod
    def forward(ctx, engine, unit, *trainable_shards):
        ctx.engine, ctx.unit, ctx.num_shards = engine, unit, len(trainable_shards)
        ctx.set_materialize_grads(False)  # an unused parameter's gradient stays None, not zeros
        # Fresh view objects every window: autograd attaches this window's graph to them,
        # and a view reused from an earlier window would carry that window's history.
        outputs = tuple(view.view(view.shape) for view in unit.full_views)
        frozen = [out for out, shard in zip(outputs, unit.shard_params) if not shard.requires_grad]
        ctx.mark_non_differentiable(*frozen)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine.post_backward(ctx.unit, list(grads))
        return (None, None) + (None,) * ctx.num_shards


class Use(torch.autograd.Function):
    """One forward pass's use of a window's full views (Note [unit window]): an identity whose
    node only that forward's graph holds, so its weak reference tells whether it can still
    be backwarded."""

    @staticmethod
    def forward(ctx, *fulls):
        ctx.set_materialize_grads(False)
        outputs = tuple(full.view(full.shape) for full in fulls)
        ctx.mark_non_differentiable(*[out for out, full in zip(outputs, fulls) if not full.requires_grad])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        return grads


@dataclass
class StepState:
    """What the engine tracks within one window (Note [unit window]); a fresh one every window."""

    fulls: dict[int, tuple] = field(default_factory=dict)  # GatherUnit's outputs, by unit, for this window
    uses: list = field(default_factory=list)  # weak references to this window's Use nodes
    pass_uses: dict[int, tuple] = field(default_factory=dict)  # this forward pass's Use outputs, by unit
    order: list[int] = field(default_factory=list)  # units in the order this forward pass first used them
    open_units: list[FlatUnit] = field(default_factory=list)  # units whose forward is running
    prefetching: dict[int, FlatUnit] = field(default_factory=dict)  # gathers in flight, in issue order
    gather_queue: list[FlatUnit] = field(default_factory=list)  # forward: units to gather, fixed order
    backward_queue: list[FlatUnit] = field(default_factory=list)  # zero3 backward: the same, reversed
    callback_queued: bool = False  # _finalize_backward is queued on autograd's engine
    in_window: bool = False

"""A unit window's autograd pieces: `GatherUnit`, `Use`, and the per-window `StepState`.
Uses: compat, flat_unit, shard_param.

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

Note [aborted backward]: a backward that raises midway never reaches `_finalize_backward`.
The next forward finds its window with a backward started and no graph left to finish it:
it waits for the reduces already issued, drops the step's gradients (the partial ones, and
this step's accumulation: as `zero_grad()` would before redoing the step; until then
`model.parameters()` still shows the window's full views) and starts the reduce order
afresh, the same on every rank.

Note [one backward at a time]: a window's backward is one autograd graph task; its end
(`_finalize_backward`, queued on that task) reduces what is left and closes the window. A
backward run *inside* it — a reentrant activation checkpoint (`torch.utils.checkpoint(...,
use_reentrant=True)`, torch's default when the flag is not given) recomputes under a nested
`torch.autograd.backward` — would hand the unit's gradients to a graph the window does not
see and lose them (measured: parameters 0.43 off one process after one step). Every unit hook
in backward checks that it runs in the window's graph task and raises otherwise, on every rank
(they all run the same checkpoint), naming the fix: `use_reentrant=False`.

Note [gradients of inputs]: a gradient penalty (WGAN-GP, R1) takes
`torch.autograd.grad(score, inputs, create_graph=True)` through the model, then backwards a loss
that holds that gradient. The first call reaches the units' pre-backward hooks but is not the
step's backward: it must not open the reduce (which would close the window with zero gradients),
and zero3 must gather each unit it passes and keep it (pinned) until the window closes, since the
gradient's own graph reads the full values again in the real backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint
from torch.autograd.graph import get_gradient_edge

from shardwise.engine.compat import Reach, graph_task_id, in_reentrant_backward, plain_tensors, reach
from shardwise.engine.unit.flat_unit import FlatUnit
from shardwise.engine.unit.shard_param import run_grad_hooks
from shardwise.errors import ShardwiseError


class GatherUnit(torch.autograd.Function):
    """Forward: hand out the unit's full views. Backward: give the full grads to the engine."""

    @staticmethod
    def forward(ctx, engine, unit, *trainable_shards):
        ctx.engine, ctx.unit, ctx.num_shards = engine, unit, len(trainable_shards)
        ctx.set_materialize_grads(False)  # an unused parameter's gradient stays None, not zeros
        # Fresh view objects every window: autograd attaches this window's graph to them,
        # and a view reused from an earlier window would carry that window's history.
        outputs = tuple(view.view(view.shape) for view in unit.full_views)
        with plain_tensors():  # Note [engine reads] (shard_param.py)
            frozen = [out for out, shard in zip(outputs, unit.shard_params) if not shard.requires_grad]
        ctx.mark_non_differentiable(*frozen)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if ctx.num_shards and reach(ctx.next_functions[0][0]) is Reach.CAPTURES:
            raise ShardwiseError(
                "torch.autograd.grad over a sharded model's parameters: each rank holds only rows of them, and "
                "their gradients exist whole only inside shardwise's reduce. Call loss.backward() and read "
                "p.grad (this rank's rows of the averaged gradient), or p.register_hook(fn) to see each "
                "parameter's whole gradient; for MAML-style inner steps use strategy='ddp'. A gradient "
                "penalty with respect to the inputs (autograd.grad(out, inputs)) works as it is."
            )
        grads = [grad if grad is None else run_grad_hooks(shard, grad)  # Note [parameter hooks]
                 for grad, shard in zip(grads, ctx.unit.shard_params)]
        ctx.engine.post_backward(ctx.unit, grads)
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
    callback_queued: bool = False  # _finalize_backward is queued on autograd's engine
    in_window: bool = False
    graph_task: int = -1  # the autograd graph task running this window's backward
    outer_call: object = None  # the module whose call opened this pass, when not the root (Note [outer calls])


def in_backward() -> bool:
    """Inside autograd's backward: a unit's forward hooks then come from a recompute."""
    return graph_task_id() != -1




def refuse_nested_backward(step: StepState, recompute: bool = False) -> None:
    """Note [one backward at a time]: raise inside a backward nested in the window's own, or, for
    a `recompute`, inside a reentrant checkpoint's (which runs in the window's task, just before
    its own backward; only then is the call stack walked: backward hooks run per unit per step)."""
    nested = recompute and in_reentrant_backward()
    if nested or step.callback_queued and graph_task_id() != step.graph_task:
        raise ShardwiseError(
            "a backward ran inside the model's backward (a reentrant activation checkpoint: "
            "torch.utils.checkpoint(..., use_reentrant=True), torch's default when the flag is not given); "
            "shardwise would not see the gradients it computes. Pass use_reentrant=False to "
            "torch.utils.checkpoint (Hugging Face: activation_checkpointing_enable("
            "activation_checkpointing_kwargs={'use_reentrant': False})), or use sw.shard(..., "
            "checkpoint_activations=True) (Note [one backward at a time])."
        )


def in_grad_call(unit: FlatUnit) -> bool:
    """Note [gradients of inputs]: whether the autograd task reaching `unit` leaves its parameters
    alone (`autograd.grad(out, inputs)`), so it is not the step's backward."""
    shard = next((s for s in unit.shard_params if s.requires_grad), None)
    return shard is not None and reach(get_gradient_edge(shard).node) is Reach.SKIPS

"""`sw.optimizer_in_backward(model, optimizer)`: each unit's shards are stepped as soon as their
gradient is reduced, and the gradient is dropped at once.

Note [optimizer in backward]: a zero model holds, per parameter and rank, 4/N bytes of values,
8/N of AdamW moments and 4/N of gradient, and all three live together from the end of backward
to the step. Stepping each unit right after its reduce lands and dropping its gradient keeps
only the units in flight with a gradient: 12/N bytes per parameter instead of 16/N, so a third
more model fits the same memory (bench/max_model.py, "+ optimizer in backward" rows). torchtune
calls this `optimizer_in_bwd`; torch has the experimental `_apply_optimizer_in_backward`.

It is exact because every torch optimizer's update of a parameter reads only that parameter,
its gradient and its own state, and a unit is reduced only once every use of it in this backward
has its gradient (GatherUnit). The unit's step is the user's own optimizer, called on a
param-group view holding only the unit's shards (`lr`, schedules and state stay the optimizer's);
the user's later `optimizer.step()` finds no gradient and changes nothing, so a training loop
keeps its usual lines. What needs every gradient at once cannot work and is refused on every
rank: clipping by the global norm (sw.clip_grad_norm_ and torch's), fp16 loss scaling; and what
would step a parameter twice is an error: a gradient that reaches an already-stepped shard later
in the same backward (a loss term reading `model.parameters()` outside the forward that autograd
reaches after the unit's reduce; one reached before it is simply added, and one that saved the
parameter stops at torch's in-place-modification check), or a backward that raised after some
units were stepped (the model is then partly updated).
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.engine.info import engine_of
from shardwise.errors import ShardwiseError


class UnitStepper:
    """Steps units for the Reducer (`after_reduce`) and checks the end of each backward."""

    def __init__(self, engine, optimizer: torch.optim.Optimizer):
        self.engine, self.optimizer = engine, optimizer
        self.stepped: list = []  # shards stepped in this backward

    def after_reduce(self, unit) -> None:
        shards = [shard for shard in unit.shard_params if shard.grad is not None]
        if not shards:
            return
        keep = {id(shard) for shard in shards}
        groups = self.optimizer.param_groups
        saved = [group["params"] for group in groups]
        try:
            for group in groups:
                group["params"] = [param for param in group["params"] if id(param) in keep]
            self.optimizer.step()
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params
        for shard in shards:
            shard.grad = None  # the point: no gradient outlives its unit's step
        self.stepped += shards

    def after_backward(self) -> None:
        late = [shard for shard in self.stepped if shard.grad is not None]
        self.stepped = []
        if late:
            raise ShardwiseError(
                f"a gradient reached {len(late)} parameter shard(s) after sw.optimizer_in_backward stepped them "
                "in this backward (a loss term that reads model.parameters() outside the forward, e.g. a weight "
                "penalty): they would be stepped twice. The model now holds this step's update without that "
                "term. Add such terms to the loss through the model's forward, or do not use "
                "optimizer_in_backward; reload the last checkpoint."
            )

    def after_abandon(self) -> None:
        if self.stepped:
            self.stepped = []
            raise ShardwiseError(
                "a backward raised after sw.optimizer_in_backward had stepped some units: the model is partly "
                "updated by that step. Reload the last checkpoint (sw.load) before training on, or do not use "
                "optimizer_in_backward where a backward may fail."
            )


def optimizer_in_backward(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Step `optimizer` on each unit's shards as soon as their gradients are reduced, and drop
    the gradients (Note [optimizer in backward]); keep calling `optimizer.step()` and
    `zero_grad()` as usual. Saves 4 bytes per parameter / N of memory; refuses gradient
    clipping and fp16 loss scaling."""
    engine = engine_of(model)
    if engine is None or not hasattr(engine, "reducer"):
        raise ShardwiseError(
            "sw.optimizer_in_backward needs a model sharded with strategy='zero1', 'zero2' or 'zero3': "
            "call sw.shard(model, strategy=...) first, then build the optimizer from model.parameters()."
        )
    if engine.precision.param_dtype == torch.float16:
        raise ShardwiseError(
            "sw.optimizer_in_backward cannot unscale fp16 gradients before each unit's step (the loss "
            "scale is known only after every gradient): use precision='bf16', or no optimizer_in_backward."
        )
    held = {id(param) for group in optimizer.param_groups for param in group["params"]}
    for unit in engine.units:
        for shard, layout in zip(unit.shard_params, unit.layouts):
            if shard.requires_grad and id(shard) not in held:
                raise ShardwiseError(
                    f"this {type(optimizer).__name__} does not hold the trainable parameter {layout.owned.name!r}: "
                    "with optimizer_in_backward one optimizer steps every trainable parameter. Build it from "
                    "model.parameters() after sw.shard(...), or freeze what it should not train."
                )
    stepper = UnitStepper(engine, optimizer)
    engine.reducer.stepper = stepper
    for unit in engine.units:
        unit.optimizer_in_backward = True  # read by ShardParameter.grad: torch's clipping is refused

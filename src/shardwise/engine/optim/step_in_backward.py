"""`sw.optimizer_in_backward(model, optimizer)`: each unit's shards are stepped as soon as their
gradient is reduced, and the gradient is dropped at once.
Uses: compat, lowbit, precision, protocol, whole_step.

Note [optimizer in backward]: a zero model holds, per parameter and rank, 4/N bytes of values,
8/N of AdamW moments and 4/N of gradient, and all three live together from the end of backward
to the step. Stepping each unit right after its reduce lands and dropping its gradient keeps
only the units in flight with a gradient: 12/N bytes per parameter instead of 16/N, so a third
more model fits the same memory (bench/memory/max_model.py, "+ optimizer in backward" rows). torchtune
calls this `optimizer_in_bwd`; torch has the experimental `_apply_optimizer_in_backward`.

It is exact because every torch optimizer's update of a parameter reads only that parameter,
its gradient and its own state (an elementwise one steps the unit's rows; one that reads the whole tensor,
or keeps its state quantized over it, steps the unit's parameters whole on their owners: Note [whole step
per unit] in whole_step.py), and a unit is reduced only once every use of it in this backward
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

from shardwise.engine.compat import unwrap_compiled
from shardwise.engine.memory.precision import NO_SCALING
from shardwise.engine.optim.lowbit import quantizes_state
from shardwise.engine.optim.whole_step import StepShape, step_shape
from shardwise.engine.protocol import engine_of
from shardwise.errors import ShardwiseError


class UnitStepper:
    """Steps units for the Reducer (`after_reduce`) and keeps each synced backward paired with
    one `optimizer.step()` of the user's (Note [one backward, one step]).

    Note [one backward, one step]: every synced backward steps the model, so a second one
    before the user's `step()` (micro-batches accumulated without sw.no_sync, two losses
    backwarded apart, a new optimizer whose step() reaches nothing) would step twice. Errors
    are raised where they stop the next update before it happens and leave the engine's
    window closed: at the user's `step()`, or at the next backward's first unit, before any
    step of it. Settings changed between backward and `step()` (an lr set there) would have
    reached the units too late: also an error at `step()`."""

    def __init__(self, engine, optimizer: torch.optim.Optimizer):
        self.engine, self.optimizer = engine, optimizer
        self.stepped: list = []  # shards stepped (or being stepped) in this backward
        self.inside = False  # our own per-unit step(): not the user's
        self.awaiting_step = False  # a synced backward ran; the user's step() has not
        self.pending_error: str | None = None
        self.settings: list[dict] | None = None  # the groups' options the units were stepped with
        self.hook = optimizer.register_step_pre_hook(self.before_user_step)

    def after_reduce(self, unit) -> None:
        if not self.stepped:  # this backward's first unit: nothing stepped yet
            self._raise_pending()
            if self.awaiting_step:
                raise ShardwiseError(
                    "a second backward before optimizer.step() with sw.optimizer_in_backward: each synced "
                    "backward steps the model, so this one would step it again. Accumulate micro-batches "
                    "under sw.no_sync(model) (the last backward outside it), call optimizer.step() after every "
                    "synced backward, and if you built a new optimizer, pass it to sw.optimizer_in_backward "
                    "again. Nothing of this backward was applied."
                )
        shards = [shard for shard in unit.shard_params if shard.grad is not None]
        if not shards:
            return
        self.stepped += shards  # before step(): a step that raises midway still counts
        keep = {id(shard) for shard in shards}
        groups = self.optimizer.param_groups
        saved = [group["params"] for group in groups]
        self.inside = True
        try:
            for group in groups:
                group["params"] = [param for param in group["params"] if id(param) in keep]
            self.optimizer.step()
        finally:
            self.inside = False
            for group, params in zip(groups, saved):
                group["params"] = params
        for shard in shards:
            shard.grad = None  # the point: no gradient outlives its unit's step

    def after_backward(self) -> None:
        """The synced backward finished (the engine's window closes whatever this finds)."""
        late = [shard for shard in self.stepped if shard.grad is not None]
        if self.stepped:  # the options every unit of this backward was stepped with, taken once
            self.settings = _settings(self.optimizer)
        self.stepped = []
        self.awaiting_step = True
        if late:
            self.pending_error = (
                f"a gradient reached {len(late)} parameter shard(s) after sw.optimizer_in_backward stepped them "
                "in the last backward (a loss term that reads model.parameters() outside the forward, e.g. a "
                "weight penalty): they would be stepped twice. The model holds that step's update without the "
                "term. Add such terms through the model's forward, or do not use optimizer_in_backward; reload "
                "the last checkpoint."
            )

    def after_abandon(self) -> None:
        if self.stepped:
            self.stepped = []
            self.pending_error = (
                "a backward raised after sw.optimizer_in_backward had stepped some units: the model is partly "
                "updated by that step. Reload the last checkpoint (sw.load) before training on, or do not use "
                "optimizer_in_backward where a backward may fail."
            )

    def before_user_step(self, optimizer, args, kwargs) -> None:
        if self.inside:
            return
        self._raise_pending()
        if self.awaiting_step and self.settings is not None and _settings(optimizer) != self.settings:
            self.awaiting_step = False
            raise ShardwiseError(
                "the optimizer's settings (lr, weight decay, ...) changed between backward and optimizer.step() "
                "with sw.optimizer_in_backward: the units were already stepped during backward with the old "
                "ones. Set them before the backward (scheduler.step() after optimizer.step(), as torch orders it)."
            )
        self.awaiting_step = False

    def _raise_pending(self) -> None:
        if self.pending_error is not None:
            message, self.pending_error = self.pending_error, None
            raise ShardwiseError(message)


def steps_in_backward(model: nn.Module) -> bool:
    """Whether sw.optimizer_in_backward steps this model's units."""
    engine = engine_of(unwrap_compiled(model))
    return engine is not None and engine.steps_in_backward()


def _settings(optimizer) -> list[dict]:
    """The groups' options but their parameters, comparable with == (tensors as plain values)."""
    return [{key: value.tolist() if isinstance(value, torch.Tensor) else value
             for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def optimizer_in_backward(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                          any_optimizer: bool = False) -> None:
    """Step `optimizer` on each unit's shards as soon as their gradients are reduced, and drop
    the gradients (Note [optimizer in backward]); keep calling `optimizer.step()` (once after
    each synced backward) and `zero_grad()` as usual. Saves 4 bytes per parameter / N of memory
    under zero2/zero3; refuses gradient clipping and loss scaling.

    Exact for torch.optim's optimizers and torchao's low-bit AdamW, whose update of a parameter reads
    only that parameter, its gradient and state: elementwise ones step each unit's rows, the others
    (Adafactor, Muon, AdamW8bit, ...) each unit's parameters whole on their owner ranks (Note [whole
    step per unit]). `any_optimizer=True` accepts another one you know to be such (not one with
    group-level counters, global norms, step hooks or a closure)."""
    engine = engine_of(unwrap_compiled(model))  # the compiled handle too
    if engine is None or not engine.shards_rows:
        raise ShardwiseError(
            "sw.optimizer_in_backward needs a model sharded with strategy='zero1', 'zero2' or 'zero3': "
            "call sw.shard(model, strategy=...) first, then build the optimizer from model.parameters()."
        )
    if engine.precision.param_dtype == torch.float16:
        raise ShardwiseError(
            "sw.optimizer_in_backward cannot unscale fp16 gradients before each unit's step (the loss "
            "scale is known only after every gradient): use precision='bf16', or no optimizer_in_backward."
        )
    kind = type(optimizer)
    # Rows for torch's elementwise classes; whole tensors on their owners, one unit at a time, for the
    # others (Note [whole step per unit], whole_step.py): torch's Adafactor and Muon, low-bit optimizers
    # (Note [low-bit state]), and a class of the user's that any_optimizer=True vouches for.
    shape = step_shape(optimizer)
    known = shape is StepShape.ROWS or (shape is StepShape.WHOLE and (
        kind.__module__.startswith("torch.optim") or quantizes_state(optimizer)))
    if not any_optimizer and (not known or optimizer._optimizer_step_pre_hooks
                              or optimizer._optimizer_step_post_hooks):
        raise ShardwiseError(
            f"sw.optimizer_in_backward steps {kind.__name__} once per unit: exact only for an optimizer whose "
            "update of a parameter reads that parameter (whole or by rows), its gradient and its state alone, "
            "without a closure or step hooks of its own (torch.optim's AdamW, Adam, SGD, Adafactor, torchao's "
            "AdamW8bit, ...). Use one of those, or pass any_optimizer=True if yours is such."
        )
    if getattr(model, "_sw_loss_scaler", False):
        raise ShardwiseError(NO_SCALING)
    held = {id(param) for group in optimizer.param_groups for param in group["params"]}
    for unit in engine.units:
        for shard, layout in zip(unit.shard_params, unit.layouts):
            if shard.requires_grad and id(shard) not in held:
                raise ShardwiseError(
                    f"this {type(optimizer).__name__} does not hold the trainable parameter {layout.owned.name!r}: "
                    "with optimizer_in_backward one optimizer steps every trainable parameter. Build it from "
                    "model.parameters() after sw.shard(...), or freeze what it should not train."
                )
    engine.reducer.step_units_with(UnitStepper(engine, optimizer))
    for unit in engine.units:
        unit.hand_steps_to_backward()  # read by ShardParameter.grad: torch's clipping is refused

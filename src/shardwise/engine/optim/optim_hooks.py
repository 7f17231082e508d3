"""What the engine learns from the user's optimizer, through torch's global step hooks.
Uses: compat, whole_step.

The user builds an ordinary torch optimizer (before or after `shard()`), so torch's global
optimizer hooks are the one place that sees every step without an extra call to remember:
- before a step: an optimizer still holding a parameter that `shard()` had to replace
  (deferred init, Note [kept parameter objects]) is refused, since it would step tensors
  the model no longer uses and train nothing;
- before and after a step: an optimizer that reads parameters as whole tensors is stepped on
  whole tensors, and one that couples tensors is refused (Note [whole-tensor step]); when such a
  step raises on one rank, every rank stops it (Note [raising step]);
- before a step: every unit whose shards the optimizer holds is marked stale, so zero1/zero2
  re-gather it before the next forward even when a fused kernel bumped no version counter
  (Note [writes the engine must see]); before, not after, so that a step that raised midway, on
  some ranks or all (Note [raising step]), still marks the same units on every rank, as the
  re-gather needs (Note [agreement rides the traffic], agreement.py).
"""

from __future__ import annotations

import weakref

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from shardwise.engine.compat import guard_step, on_step_error
from shardwise.engine.optim.whole_step import StepShape, WholeStep, refuse_coupled, sharded_params, step_shape
from shardwise.errors import ShardwiseError

_WHOLE_STEPS: dict[int, WholeStep] = {}  # id(optimizer) -> its step in progress
_LIVE_UNITS: weakref.WeakSet = weakref.WeakSet()  # every sharded unit in this process

_INSTALLED: list[bool] = []


def watch_units(units) -> None:
    """Tie each unit's shards to the unit and install the global hooks once per process."""
    for unit in units:
        _LIVE_UNITS.add(unit)
        for shard, layout in zip(unit.shard_params, unit.layouts):
            shard._sw_unit, shard._sw_layout = unit, layout
    if not _INSTALLED:
        register_optimizer_step_pre_hook(_mark_stepped_units_stale)
        register_optimizer_step_pre_hook(_refuse_replaced_params)
        register_optimizer_step_pre_hook(_refuse_optimizer_of_nothing)
        register_optimizer_step_pre_hook(_begin_whole_step)
        register_optimizer_step_post_hook(_end_whole_step)
        on_step_error(_abort_whole_step)
        _INSTALLED.append(True)


def _params(optimizer):
    for group in optimizer.param_groups:
        yield from group["params"]


def _refuse_replaced_params(optimizer, args, kwargs) -> None:
    if any(getattr(param, "_sw_replaced", False) for param in _params(optimizer)):
        raise ShardwiseError(
            f"this {type(optimizer).__name__} holds parameters of a model that sw.shard(...) has since sharded: "
            "the model was built under sw.deferred_init(), so its parameters are new objects and this optimizer "
            "would step tensors the model no longer uses. Build the optimizer after sw.shard(model, ...), "
            "from model.parameters()."
        )


def _refuse_optimizer_of_nothing(optimizer, args, kwargs) -> None:
    """At an optimizer's first step: one that holds none of a sharded model's parameters and no
    gradient at all (built over another model, or over a copy) would step nothing, silently."""
    if getattr(optimizer, "_sw_checked", False) or not _LIVE_UNITS:
        return
    params = list(_params(optimizer))
    if params and not any(getattr(p, "_sw_unit", None) is not None or p.grad is not None for p in params):
        raise ShardwiseError(
            f"this {type(optimizer).__name__} holds {len(params)} parameters, none of them a parameter of the "
            "model sw.shard(...) sharded and none with a gradient: its step would change nothing. Build it "
            "from the sharded model's parameters (model.parameters() after sw.shard), not another model's."
        )
    optimizer._sw_checked = True


def _stepped_units(optimizer) -> dict:
    """{id(unit): (unit, the layout indices of its shards this optimizer holds)}."""
    units = {}
    for param in _params(optimizer):
        unit = getattr(param, "_sw_unit", None)
        if unit is not None:
            units.setdefault(id(unit), (unit, set()))[1].add(unit.index_of[id(param._sw_layout)])
    return units


def _mark_stepped_units_stale(optimizer, args, kwargs) -> None:
    for unit, indices in _stepped_units(optimizer).values():  # once each: a unit's mark records whether it
        unit.mark_stepped(indices)  # was current (FlatUnit.mark_stepped)


def _begin_whole_step(optimizer, args, kwargs) -> None:
    """Note [whole-tensor step]: only optimizers holding rows of a tensor sharded over ranks."""
    if not sharded_params(optimizer):
        return
    shape = step_shape(optimizer)
    if shape is StepShape.REFUSE:
        refuse_coupled(optimizer)
    if shape is StepShape.WHOLE:
        guard_step(optimizer)  # a class torch wrapped before on_step_error (Note [raising step])
        step = WholeStep(optimizer)
        step.begin()
        _WHOLE_STEPS[id(optimizer)] = step


def _end_whole_step(optimizer, args, kwargs) -> None:
    step = _WHOLE_STEPS.pop(id(optimizer), None)
    try:
        if step is not None:
            step.end()
    finally:  # ended or undone on every rank (Note [raising step]): the rows' writes so far are the step's
        _after_step(optimizer)


def _after_step(optimizer) -> None:
    for unit, _indices in _stepped_units(optimizer).values():  # (Note [stepped parameters], flat_unit.py)
        unit.after_step()


def _abort_whole_step(optimizer, error) -> None:
    """The step of `optimizer` raised on this rank (Note [raising step]): every rank is told, and the
    rows come back; the ShardwiseError naming the failed rank replaces the error."""
    step = _WHOLE_STEPS.pop(id(optimizer), None)
    if step is not None:
        failure = step.abort(error)
        _after_step(optimizer)
        raise failure from error

"""What the engine learns from the user's optimizer: one hook on torch's optimizer steps, dispatching
to the engine of each parameter the optimizer steps. Uses: compat, host_offload, offload, shard_param, whole_step.

Note [one step hook]: the user builds an ordinary torch optimizer (before or after `shard()`), so
torch's global optimizer hooks are the one place that sees every step without an extra call to
remember. They are installed once (`install`), and hold no state of their own: each sharded
parameter points at its engine's `StepWatch`, which keeps that engine's units and its whole-tensor
steps in progress; the hooks find the watches through the optimizer's parameters, in a fixed order:
- before a step: an optimizer still holding a parameter that `shard()` had to replace
  (deferred init, Note [kept parameter objects]) is refused, since it would step tensors
  the model no longer uses and train nothing; so is one holding nothing of any live engine's;
- before a step: every rank is at its step, or every rank refuses it (Note [uneven work], agreement.py; where
  the collectives run on a device, this step's header is compared at the next step's: Note [headers on the
  device], agreement_device.py);
- before a step: the engine's checks still in flight are settled (on a device, the phases' headers, then zero3's
  gather tags: Note [headers on the device], Note [tags on the device]), so a step never applies values computed
  in a phase the ranks disagree on or from a mismatched gather;
- before a step: every unit whose shards the optimizer holds is marked stale, so zero1/zero2
  re-gather it before the next forward even when a fused kernel bumped no version counter
  (Note [writes the engine must see]); before, not after, so that a step that raised midway, on
  some ranks or all (Note [raising step]), still marks the same units on every rank, as the
  re-gather needs (Note [agreement rides the traffic], agreement.py);
- offloaded shards step one unit at a time from their mapped files (offload.py), inside the step; an optimizer
  they cannot step (whole tensors over ranks, quantized state) is refused first (Note [what a chunk can step]);
- before and after a step: an optimizer that reads parameters as whole tensors is stepped on
  whole tensors, and one that couples tensors is refused (Note [whole-tensor step]); when such a
  step raises on one rank, every rank stops it (Note [raising step]).
The one process-wide fact is which watches are alive (`_LIVE`, weak), because torch's hooks are
process-wide: an optimizer that steps nothing is refused only while some sharded model exists.

Note [plain rows step]: an elementwise optimizer (`StepShape.ROWS`: exactly one of torch's classes in
`_ELEMENTWISE`, whose step reads each element alone) steps a shard's rows with a few torch calls per
parameter, and each call on a ShardParameter or its RowsGrad went through their `__torch_function__`
(Note [rows meet a whole tensor], [rows read whole] in shard_param.py): about 6 per parameter, 10 ms a
step on the bench GPT at 2 ranks, where its whole AdamW step on rows is 70 ms. Inside such a step the
only tensors are each parameter, its gradient and its state, and those checks can fire only where a state
tensor is not of its parameter's shape (a full-shape state loaded with torch's `load_state_dict`). So the
body of the step, beneath torch's wrapper and its hooks (a user's hook still meets every check), runs
under `plain_tensors()` once every parameter, gradient and state tensor is a plain tensor or ours and of
its parameter's shape (0-d state such as `step` aside); else the checks run as before and raise where
they did. The ops are the same ones, so the step is bitwise what it was. Classes torch wrapped before the
engine's first `shard()` get torch's wrapper anew at the first step of an optimizer over shards, one rank's
too (compat.guard_step), the plain body from the next one.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from shardwise.engine.compat import get_grad, guard_step, on_step_body, on_step_error, plain_tensors
from shardwise.engine.memory.host_offload import refuse_whole_step
from shardwise.engine.memory.offload import chunked_step, restore_groups
from shardwise.engine.optim.whole_step import (
    StepShape,
    WholeStep,
    refuse_compressed,
    refuse_coupled,
    refuse_disk_offload,
    sharded_params,
    step_shape,
)
from shardwise.engine.unit.shard_param import RowsGrad, ShardParameter
from shardwise.errors import ShardwiseError

_OURS_OR_PLAIN = {torch.Tensor, nn.Parameter, ShardParameter, RowsGrad}  # Note [plain rows step]

_LIVE: weakref.WeakSet = weakref.WeakSet()  # the StepWatch of every live engine (Note [one step hook])
_INSTALLED: list[bool] = []


class StepWatch:
    """One engine's side of its optimizers' steps (Note [one step hook]): its units, and the whole-tensor
    steps in progress over its parameters."""

    def __init__(self, units, before_step=None) -> None:
        self.whole_steps: dict[int, WholeStep] = {}  # id(optimizer) -> its step in progress
        self.before_step = before_step  # the engine's checks to settle before any step (Note [one step hook])
        self.agree_on_step = None  # the engine's wait for every rank at its step (Note [uneven work]), or None
        for unit in units:
            for shard, layout in zip(unit.shard_params, unit.layouts):
                shard._sw_unit, shard._sw_layout, shard._sw_watch = unit, layout, self
        _WATCHES_MADE[0] += 1  # Note [step plan]: every optimizer's plan is made again at its next step
        _LIVE.add(self)
        install()

    def mark_stepped(self, stepped) -> None:
        """Before a step: the units whose shards are about to be written (`stepped`: the step plan's units of
        this watch and their layout indices, each unit once)."""
        for unit, indices in stepped:  # once each: a unit's mark records whether
            unit.mark_stepped(indices)  # it was current (FlatUnit.mark_stepped)

    def after_step(self, stepped) -> None:
        """The step ended (or was undone): its writes are accounted for (Note [stepped parameters])."""
        for unit, _indices in stepped:
            unit.after_step()


def install() -> None:
    """Register the hooks on torch's optimizer steps, once per process."""
    if not _INSTALLED:
        register_optimizer_step_pre_hook(_before_step)
        register_optimizer_step_post_hook(_after_step)
        on_step_error(_step_failed)
        on_step_body(_plain_rows_body)
        _INSTALLED.append(True)


def _params(optimizer) -> list:
    return [param for group in optimizer.param_groups for param in group["params"]]


# Note [step plan]: which engines' watches an optimizer's parameters belong to, which units of each it steps (and
# their layout indices), and whether it holds a parameter shard() replaced depend only on its parameter objects
# and on what shard() wrote on them, which only a new StepWatch does (`_WATCHES_MADE` counts them). So they are
# found once and kept on the optimizer under a key of both, and made again whenever either changed (a parameter
# group added, a model sharded): 1.3k Python calls a step on make demo's GPT were these walks over 70 parameters,
# three and two times a step (bench/overhead/step_counts.py). The plan holds the parameters themselves, so their
# ids in the key cannot be reused by other objects while it lives. The checks that read values which do change
# between steps (gradients, state: Note [plain rows step]) still run at every step.
_WATCHES_MADE = [0]


@dataclass
class _StepPlan:
    key: tuple
    params: list  # held: see the Note
    replaced: bool  # some parameter is one shard() replaced (_refuse_replaced_params)
    watches: list
    stepped: dict  # id(watch) -> [(unit, its layout indices among the parameters)]


def _plan(optimizer, params) -> _StepPlan:
    """`optimizer`'s step plan for `params` (its parameters now): kept, or made again (Note [step plan])."""
    key = (_WATCHES_MADE[0], tuple(map(id, params)))
    plan = optimizer.__dict__.get("_sw_step_plan")
    if plan is None or plan.key != key:
        watches = _watches(params)
        plan = _StepPlan(key, params, any(getattr(param, "_sw_replaced", False) for param in params), watches,
                         {id(watch): [(unit, frozenset(indices)) for unit, indices
                                      in _stepped_units(params, watch).values()] for watch in watches})
        optimizer._sw_step_plan = plan
    return plan


def _watches(params) -> list[StepWatch]:
    """The watches of the engines whose shards are among `params`, in the parameters' order, once each."""
    found = {}
    for param in params:
        watch = getattr(param, "_sw_watch", None)
        if watch is not None:
            found.setdefault(id(watch), watch)
    return list(found.values())


def _stepped_units(params, watch: StepWatch) -> dict:
    """{id(unit): (unit, the layout indices of its shards among `params`)} for `watch`'s engine."""
    units = {}
    for param in params:
        if getattr(param, "_sw_watch", None) is watch:
            unit = param._sw_unit
            units.setdefault(id(unit), (unit, set()))[1].add(unit.index_of[id(param._sw_layout)])
    return units


def _before_step(optimizer, args, kwargs) -> None:
    params = _params(optimizer)
    plan = _plan(optimizer, params)
    _refuse_replaced_params(optimizer, plan.replaced)
    _refuse_optimizer_of_nothing(optimizer, params)
    refuse_disk_offload(optimizer)  # before anything steps or moves (Note [what a chunk can step], offload.py)
    watches = plan.watches
    for watch in watches:  # every rank is at its step, or every rank refuses it (Note [uneven work], agreement.py)
        if watch.agree_on_step is not None:
            watch.agree_on_step()
    if watches:  # any optimizer over shards, one rank's included: a class torch wrapped before shardwise
        guard_step(optimizer)  # (Note [raising step], Note [plain rows step])
    for watch in watches:  # every engine's checks first: a refused step marks nothing
        if watch.before_step is not None:
            watch.before_step()
    for watch in watches:
        watch.mark_stepped(plan.stepped[id(watch)])
    chunked_step(optimizer, args, kwargs)  # offloaded shards: stepped here, chunk by chunk (offload.py)
    _begin_whole_step(optimizer)


def _plain_rows_body(optimizer):
    """The context of an optimizer's own step body: `plain_tensors()` for an elementwise step over rows whose
    tensors the shard checks cannot fault, else none (Note [plain rows step])."""
    if step_shape(optimizer) is not StepShape.ROWS or not _LIVE:
        return contextlib.nullcontext()
    with plain_tensors():
        params = _params(optimizer)
        if not any(type(param) is ShardParameter for param in params) or not all(
                _rows_alike(optimizer, param) for param in params):
            return contextlib.nullcontext()
    return plain_tensors()


def _rows_alike(optimizer, param) -> bool:
    """`param` (read under plain_tensors), its gradient and its state: plain or ours, all of its shape."""
    if type(param) not in _OURS_OR_PLAIN:
        return False
    tensors = [get_grad(param), *optimizer.state.get(param, {}).values()]  # the stored gradient, no property
    return all(type(t) in _OURS_OR_PLAIN and (t.dim() == 0 or t.shape == param.shape)
               for t in tensors if isinstance(t, torch.Tensor))


def _after_step(optimizer, args, kwargs) -> None:
    restore_groups(optimizer)
    watch, step = _whole_step_of(optimizer)
    try:
        if step is not None:
            step.end()
    finally:  # ended or undone on every rank (Note [raising step]): the rows' writes so far are the step's
        _settle(optimizer)


def _step_failed(optimizer, error) -> None:
    """The step of `optimizer` raised on this rank (Note [raising step]): every rank is told, and the
    rows come back; the ShardwiseError naming the failed rank replaces the error."""
    watch, step = _whole_step_of(optimizer)
    if step is not None:
        failure = step.abort(error)
        _settle(optimizer)
        raise failure from error


def _settle(optimizer) -> None:
    plan = _plan(optimizer, _params(optimizer))
    for watch in plan.watches:
        watch.after_step(plan.stepped[id(watch)])


def _refuse_replaced_params(optimizer, replaced: bool) -> None:
    if replaced:
        raise ShardwiseError(
            f"this {type(optimizer).__name__} holds parameters of a model that sw.shard(...) has since sharded: "
            "the model was built under sw.deferred_init(), so its parameters are new objects and this optimizer "
            "would step tensors the model no longer uses. Build the optimizer after sw.shard(model, ...), "
            "from model.parameters()."
        )


def _refuse_optimizer_of_nothing(optimizer, params) -> None:
    """At an optimizer's first step: one that holds none of a sharded model's parameters and no
    gradient at all (built over another model, or over a copy) would step nothing, silently."""
    if getattr(optimizer, "_sw_checked", False) or not _LIVE:
        return
    if params and not any(getattr(p, "_sw_unit", None) is not None or p.grad is not None for p in params):
        raise ShardwiseError(
            f"this {type(optimizer).__name__} holds {len(params)} parameters, none of them a parameter of the "
            "model sw.shard(...) sharded and none with a gradient: its step would change nothing. Build it "
            "from the sharded model's parameters (model.parameters() after sw.shard), not another model's."
        )
    optimizer._sw_checked = True


def _begin_whole_step(optimizer) -> None:
    """Note [whole-tensor step]: only optimizers holding rows of a tensor sharded over ranks. The step in
    progress is kept by the watch of its first sharded parameter's engine."""
    sharded = sharded_params(optimizer)
    if not sharded:
        return
    shape = step_shape(optimizer)
    if shape is StepShape.REFUSE:
        refuse_coupled(optimizer)
    if shape is StepShape.WHOLE:
        refuse_compressed(optimizer, sharded)
        refuse_whole_step(optimizer, sharded)  # offload="host" (Note [host offload])
        step = WholeStep(optimizer)
        step.begin()
        sharded[0]._sw_watch.whole_steps[id(optimizer)] = step


def _whole_step_of(optimizer) -> tuple[StepWatch | None, WholeStep | None]:
    """The whole-tensor step in progress of `optimizer` (taken out of its watch), if any."""
    for watch in _plan(optimizer, _params(optimizer)).watches:
        step = watch.whole_steps.pop(id(optimizer), None)
        if step is not None:
            return watch, step
    return None, None

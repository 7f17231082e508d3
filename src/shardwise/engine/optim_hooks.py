"""What the engine learns from the user's optimizer, through torch's global step hooks.

The user builds an ordinary torch optimizer (before or after `shard()`), so torch's global
optimizer hooks are the one place that sees every step without an extra call to remember:
- before a step: an optimizer still holding a parameter that `shard()` had to replace
  (deferred init, Note [kept parameter objects]) is refused, since it would step tensors
  the model no longer uses and train nothing;
- after a step: every unit whose shards the optimizer holds is marked stale, so zero1/zero2
  re-gather it before the next forward even when a fused kernel bumped no version counter
  (Note [writes the engine must see]).
"""

from __future__ import annotations

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from shardwise.errors import ShardwiseError

_INSTALLED: list[bool] = []


def watch_units(units) -> None:
    """Tie each unit's shards to the unit and install the global hooks once per process."""
    for unit in units:
        for shard in unit.shard_params:
            shard._sw_unit = unit
    if not _INSTALLED:
        register_optimizer_step_pre_hook(_refuse_replaced_params)
        register_optimizer_step_post_hook(_mark_stepped_units_stale)
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


def _mark_stepped_units_stale(optimizer, args, kwargs) -> None:
    for param in _params(optimizer):
        unit = getattr(param, "_sw_unit", None)
        if unit is not None:
            unit.stale = True

"""The registered parameter after `shard()`: this rank's rows, in the user's own Parameter object.

Note [kept parameter objects]: an optimizer built before `shard()` (the order Accelerate and
Hugging Face examples use) holds the model's original `nn.Parameter` objects. So `shard()`
keeps those objects and changes what they hold: each becomes a `ShardParameter` whose data
is this rank's rows. Optimizers, param groups and per-parameter settings made earlier keep
working. Only a parameter built on the meta device (deferred init) cannot change device in
place; it gets a new object, and the old one is marked so that an optimizer still holding it
is refused at its first step (optim_hooks.py) instead of training nothing.

Note [writes the engine must see]: zero1/zero2 re-gather a unit only when its rows may have
changed. Every write path is made visible:
- in-place ops on the parameter (`p.mul_()` under no_grad, `load_state_dict`, `sw.load`)
  bump its version counter;
- `p.data` returns `p.detach()`, which shares that version counter (a plain Parameter's
  `.data` has its own, so `p.data.clamp_()` went unseen);
- `p.data = t` copies `t` into the rows (same shape and dtype) or is refused: the rows'
  storage belongs to the unit's flat buffer;
- optimizer steps, whose fused kernels bump no version counter, mark the unit stale from a
  global step hook (optim_hooks.py).

Note [rank-local clipping]: `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` on a
sharded model would compute the norm of this rank's rows only, and each rank would clip by
a different factor. Reading `.grad` from inside that function (it collects the gradients in
a comprehension at its start, before touching any) is refused with the fix,
`sw.clip_grad_norm_`, which computes the global norm. Its two halves are refused the same
way: `clip_grads_with_norm_(model.parameters(), max_norm, total)` reads `.grad` likewise (the
`total` a user passes comes from `get_total_norm` over this rank's rows, which takes tensors
and cannot be caught). Any other read of `.grad` is a plain read; at world size 1 the rows are
the whole tensor and torch's functions are exact.
"""

from __future__ import annotations

import inspect
import sys

import torch
from torch import nn

from shardwise.errors import ShardwiseError

_set_data = torch._C.TensorBase.data.__set__  # the plain setter, which rebinds storage
_get_grad, _set_grad = torch._C.TensorBase.grad.__get__, torch._C.TensorBase.grad.__set__
_TORCH_CLIPS = {inspect.unwrap(torch.nn.utils.clip_grad_norm_).__code__: "clip_grad_norm_",
                inspect.unwrap(torch.nn.utils.clip_grads_with_norm_).__code__: "clip_grads_with_norm_"}
# Exact on shards, but with sw.optimizer_in_backward it would find no gradient left to clip.
_AFTER_STEP_CLIPS = {**_TORCH_CLIPS, inspect.unwrap(torch.nn.utils.clip_grad_value_).__code__: "clip_grad_value_"}


class ShardParameter(nn.Parameter):
    """A parameter holding this rank's rows of a sharded tensor (Note [writes the engine must see])."""

    @property
    def data(self) -> torch.Tensor:
        return self.detach()  # shares the version counter: writes through it are seen

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if value.shape != self.shape or value.dtype != self.dtype or value.device != self.device:
            raise ShardwiseError(
                f"cannot set .data of a sharded parameter (this rank's rows: {list(self.shape)} {self.dtype} on "
                f"{self.device}) to a {list(value.shape)} {value.dtype} tensor on {value.device}: shardwise owns "
                "its storage. Cast or move the model (model.to(...), .half()) before sw.shard(...), or write "
                "values in place under torch.no_grad()."
            )
        with torch.no_grad():
            self.copy_(value)

    @property
    def grad(self) -> torch.Tensor | None:
        caller = sys._getframe(1)
        if caller.f_code.co_name == "<listcomp>":  # Python 3.11 gives comprehensions a frame
            caller = caller.f_back
        stepped = getattr(getattr(self, "_sw_unit", None), "optimizer_in_backward", False)
        function = (_AFTER_STEP_CLIPS if stepped else _TORCH_CLIPS).get(caller.f_code) if caller is not None else None
        if function is not None and stepped:
            raise ShardwiseError(
                f"torch.nn.utils.{function} with sw.optimizer_in_backward: every unit was stepped during "
                "backward and its gradient dropped, so there is nothing left to clip. Clip without "
                "optimizer_in_backward (Note [optimizer in backward])."
            )
        if function is not None and _sharded(self):
            raise ShardwiseError(
                f"torch.nn.utils.{function} on a sharded model sees only this rank's rows: the norm would be "
                "this rank's and every rank would clip by a different factor. Use "
                "sw.clip_grad_norm_(model, max_norm), which computes the global norm and clips by it "
                "(Note [rank-local clipping])."
            )
        return _get_grad(self)

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        _set_grad(self, value)

    @grad.deleter
    def grad(self) -> None:
        _set_grad(self, None)


def _sharded(param: ShardParameter) -> bool:
    unit = getattr(param, "_sw_unit", None)
    return unit is None or unit.world_size > 1


def make_shard(original: nn.Parameter, rows: torch.Tensor) -> ShardParameter:
    """`original` turned into a ShardParameter holding `rows` (Note [kept parameter objects])."""
    if isinstance(original, nn.Parameter) and original.device.type != "meta" and not isinstance(
            original, ShardParameter):
        _set_data(original, rows)
        original.__class__ = ShardParameter
        return original
    shard = ShardParameter(rows, requires_grad=original.requires_grad)
    original._sw_replaced = True  # read by optim_hooks.refuse_replaced_params
    return shard

"""The registered parameter after `shard()`: this rank's rows, in the user's own Parameter object.
Uses: compat.

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
sharded model would compute the norm of this rank's rows only, and each rank would clip by a
different factor. A sharded parameter's gradient therefore knows it is rows: over more than one
rank it is a `RowsGrad`, a tensor that refuses every norm (`torch.linalg.vector_norm`,
`_foreach_norm`, `Tensor.norm`: what torch's `clip_grad_norm_` and `get_total_norm`, and a
user's `p.grad.norm()`, compute) with the fix, `sw.clip_grad_norm_`, and is a plain tensor to
everything else (elementwise ops, optimizers, `clip_grads_with_norm_` by a global total, which
is exact). At world size 1 the rows are the whole tensor and gradients stay plain. This replaced
a walk of the caller's stack frame on every `.grad` read; what remains of it (compat.py) runs
only under `sw.optimizer_in_backward`, where the gradient is gone and nothing else can carry the
knowledge that torch's clipping would find nothing to clip.

Note [rows read whole]: a parameter is a whole tensor to everything that reads it (DESIGN.md), so
a read that would return this rank's rows' value where the whole tensor's was meant raises instead,
naming `sw.grad_norms` / `sw.param_norms` (per-parameter norms over every rank's rows). Decided by
the tensors' types, never by walking the stack: a gradient's rows (`RowsGrad`) refuse reductions
across dim 0 (`sum`, `mean`, `max`, `amax`, `std`, ...: `p.grad.abs().max()`, `p.grad.pow(2).sum()`),
and the elementwise reads of logging idioms (`pow`, `abs`, `square`, `float`, `detach`, `.data`) keep
them rows; a parameter's rows refuse norms (`p.norm()`). What remains local on purpose: reductions
over other dimensions (each row's), and a parameter's own elementwise values (`p.pow(2).sum()` as a
penalty: its gradient is exact on every row; its value is this rank's part).

Note [rows meet a whole tensor]: a tensor of the parameter's full shape combined with its rows
(an EMA copy taken before `shard()` updated by `ema.lerp_(p, 0.1)`, `p.copy_(full)`) is a shape
error from deep inside torch, or, where the first dimension equals the world size, a silent
broadcast of one row over all. Every torch function that takes a shard and such a tensor (also
paired in foreach lists) raises instead, naming the fix. It runs for ops on shards only, i.e. in
the optimizer step, outside forward and backward (which see full views): measured in
bench/whole_tensor/whole_tensor.py beside the step.

Note [parameter hooks]: autograd never delivers a gradient to a shard (the forward used the
unit's full views; GatherUnit), so a hook registered on it would never run, or run with None.
`register_hook` on a shard keeps the hook with the shard and GatherUnit runs it on the
parameter's whole gradient of this backward, this rank's contribution, before the reduce (as
torch DDP runs parameter hooks before its all-reduce); what it returns replaces the gradient.
`register_post_accumulate_grad_hook` would see only rows after the reduce, so it is refused with
the two fixes: `register_hook` to read or change the gradient, `sw.optimizer_in_backward` to step
in backward.

Note [engine reads]: a tensor subclass with `__torch_function__` sees every attribute read too
(`requires_grad`, `_version`, `.grad` are torch functions), each a Python call into the checks
below. The engine's own loops over its shards (which are trainable, their version stamps, a
gradient handed out) read them with torch functions off: nothing they read can be a misuse. On
the PipeTransformer bench's re-packed zero3 step they were about 1400 of its 1470 calls a step.
"""

from __future__ import annotations

import collections

import torch
import torch.utils.hooks
from torch import nn

from shardwise.engine.compat import allow_foreach, get_grad, plain_tensors, refuse_clip_after_step, set_data, set_grad
from shardwise.errors import ShardwiseError

_set_data, _get_grad, _set_grad = set_data, get_grad, set_grad  # compat.py
_ROW_NORMS = {torch.linalg.vector_norm, torch.linalg.norm, torch.linalg.matrix_norm, torch.norm, torch.Tensor.norm,
              torch._foreach_norm}
# Note [rows read whole]: reductions across rows, refused on a gradient's rows (and what ROW_VALUES make of them).
_T = torch.Tensor
_ROW_REDUCTIONS = {torch.sum, _T.sum, torch.mean, _T.mean, torch.max, _T.max, torch.min, _T.min, torch.amax, _T.amax,
                   torch.amin, _T.amin, torch.aminmax, _T.aminmax, torch.prod, _T.prod, torch.std, _T.std, torch.var,
                   _T.var, torch.nansum, _T.nansum, torch.nanmean, _T.nanmean, torch.count_nonzero, _T.count_nonzero,
                   torch.dot, _T.dot, torch.vdot, _T.vdot}
# Elementwise reads of one tensor that keep it this rank's rows (the idioms of per-layer logging).
_ROW_VALUES = {torch.pow, _T.pow, _T.__pow__, torch.abs, _T.abs, _T.__abs__, torch.square, _T.square, _T.float,
               _T.double, _T.detach, torch._C.TensorBase.data.__get__}
_USE_INSTEAD = ("Use sw.grad_norms(model) / sw.param_norms(model) for per-parameter norms over the whole tensors "
                "(one collective: every rank calls it), sw.clip_grad_norm_(model, max_norm) for the global norm, "
                "sw.full_parameters(model) for whole values, or reduce over a dimension other than 0 "
                "(Note [rows read whole], shard_param.py).")


def _reduces_rows(func, args, kwargs) -> bool:
    """Whether `func` reduces across dim 0 (the rows) of its first argument with nothing else tensor-valued
    (`torch.max(a, b)` is elementwise)."""
    if any(isinstance(v, torch.Tensor) for v in list(args[1:]) + list(kwargs.values())):
        return False
    dim = kwargs.get("dim", args[1] if len(args) > 1 and isinstance(args[1], (int, tuple, list)) else None)
    if dim is None:
        return True
    ndim = max(args[0].dim(), 1)
    return any(d % ndim == 0 for d in ([dim] if isinstance(dim, int) else dim))


class RowsGrad(torch.Tensor):
    """This rank's rows of a sharded parameter's gradient (Note [rank-local clipping])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ROW_NORMS:
            raise ShardwiseError(
                "a norm of a sharded parameter's gradient (torch.nn.utils.clip_grad_norm_ or get_total_norm, "
                "p.grad.norm()) sees only this rank's rows: the norm would be this rank's and every rank would "
                "clip by a different factor. Use sw.clip_grad_norm_(model, max_norm), which computes the global "
                "norm with torch's arithmetic and clips by it; sw.grad_norms(model) gives each parameter's "
                "(Note [rank-local clipping]).")
        if func in _ROW_REDUCTIONS and args and type(args[0]) is cls and _reduces_rows(func, args, kwargs):
            raise ShardwiseError(
                f"{getattr(func, '__name__', func)}() across the rows of a sharded parameter's gradient would "
                f"return this rank's rows' value, a different one on every rank. {_USE_INSTEAD}")
        with plain_tensors():  # plain results, but for the reads that keep the rows (Note [rows read whole])
            result = func(*args, **kwargs)
        if func in _ROW_VALUES and type(args[0]) is cls and isinstance(result, torch.Tensor):
            return result.as_subclass(cls)
        return result


class ShardParameter(nn.Parameter):
    """A parameter holding this rank's rows of a sharded tensor (Note [writes the engine must see])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ROW_NORMS and args and isinstance(args[0], ShardParameter) and _holds_rows(args[0]):
            raise ShardwiseError(  # Note [rows read whole]
                f"a norm of a sharded parameter ({getattr(func, '__name__', func)}, p.norm()) sees only this "
                f"rank's rows: a different value on every rank. {_USE_INSTEAD}")
        with plain_tensors():  # nn.Parameter's own behaviour: plain results
            # One argument alone (an attribute read, `p.sqrt()`, a list's own elements) meets no whole
            # tensor: most calls, which skip the check.
            if (len(args) > 1 or kwargs) and func not in _REBINDS:
                _refuse_rows_with_whole(func, args, kwargs)
            return func(*args, **kwargs)

    def register_hook(self, hook):
        """Note [parameter hooks]: runs on this parameter's whole gradient, before the reduce."""
        hooks = self.__dict__.setdefault("_sw_grad_hooks", collections.OrderedDict())  # weakly referenced
        return _add_hook(hooks, hook)

    def register_post_accumulate_grad_hook(self, hook):
        raise ShardwiseError(
            "register_post_accumulate_grad_hook on a sharded parameter would see only this rank's rows of "
            "the reduced gradient (Note [parameter hooks]). To read or change the whole gradient, use "
            "p.register_hook(fn) (shardwise runs it before the reduce); to step in backward, use "
            "sw.optimizer_in_backward(model, optimizer)."
        )

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
        unit = getattr(self, "_sw_unit", None)  # not __dict__: dynamo fails on a tensor's (torch.compile(opt.step))
        if unit is not None and unit.stepped_in_backward:
            refuse_clip_after_step()  # Note [rank-local clipping]
        with plain_tensors():  # Note [engine reads]: the stored gradient object itself
            return _get_grad(self)

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        if value is not None and type(value) is not RowsGrad and _sharded(self):
            value = value.as_subclass(RowsGrad)  # an alias, no copy: zero1's grads stay views
        _set_grad(self, value)

    @grad.deleter
    def grad(self) -> None:
        _set_grad(self, None)


# Its elementwise ops are torch's own (with the check above), so the optimizer's foreach kernels apply:
# without this a ShardParameter would step in torch's per-tensor loop where DDP's plain parameters
# take the foreach kernels (CUDA).
allow_foreach(ShardParameter)

_REBINDS = {_set_data, _set_grad}  # the engine's own swaps of rows and whole tensors (whole_step.py)


def _add_hook(hooks: dict, hook):
    handle = torch.utils.hooks.RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def run_grad_hooks(shard: ShardParameter, grad: torch.Tensor) -> torch.Tensor:
    """Note [parameter hooks]: `grad` after every hook the user registered on `shard`."""
    for hook in shard.__dict__.get("_sw_grad_hooks", {}).values():
        result = hook(grad)
        grad = grad if result is None else result
    return grad


def _groups(args, kwargs):
    """Tensors that meet elementwise: the plain arguments together, and each position of lists."""
    values = list(args) + list(kwargs.values())
    plain = [v for v in values if isinstance(v, torch.Tensor)]
    lists = [v for v in values if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor)]
    yield plain
    if lists:
        yield from zip(*lists)


def _refuse_rows_with_whole(func, args, kwargs) -> None:
    """Note [rows meet a whole tensor]."""
    for group in _groups(args, kwargs):
        for shard in group:
            layout = getattr(shard, "_sw_layout", None) if isinstance(shard, ShardParameter) else None
            if layout is None or shard.shape == layout.shape:
                continue
            if any(not isinstance(t, ShardParameter) and t.shape == layout.shape for t in group):
                raise ShardwiseError(
                    f"{getattr(func, '__name__', func)} combines this rank's rows of {layout.owned.name!r} "
                    f"({list(shard.shape)}) with a tensor of its full shape {list(layout.shape)}: every rank holds "
                    "only its rows after sw.shard(...). For an average of the weights use sw.EMA(model); for "
                    "whole values, sw.full_parameters(model) (Note [rows meet a whole tensor])."
                )


def _holds_rows(param: ShardParameter) -> bool:
    """Sharded, and holding rows now (a whole-tensor step swaps the whole tensor in: whole_step.py)."""
    layout = param.__dict__.get("_sw_layout")
    return _sharded(param) and layout is not None and param.shape != layout.shape


def _sharded(param: ShardParameter) -> bool:
    unit = getattr(param, "_sw_unit", None)
    return unit is None or unit.mesh.shard_world > 1


def make_shard(original: nn.Parameter, rows: torch.Tensor) -> ShardParameter:
    """`original` turned into a ShardParameter holding `rows` (Note [kept parameter objects])."""
    if isinstance(original, nn.Parameter) and original.device.type != "meta" and not isinstance(
            original, ShardParameter):
        _set_data(original, rows)
        original.__class__ = ShardParameter
        return original
    shard = ShardParameter(rows, requires_grad=original.requires_grad)
    original._sw_replaced = True  # read by optim_hooks._refuse_replaced_params (Note [step plan])
    return shard

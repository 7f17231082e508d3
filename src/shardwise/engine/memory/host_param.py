"""A frozen parameter whose values live in a read-only mapping that every local rank shares.
Uses: compat.

Note [read-only host weights]: `frozen="host"` (host_copy.py) makes each frozen parameter a
view of one file mapped with `PROT_READ` by every rank of the host, so the host holds one
copy of the frozen base. A store into that memory would kill the process with SIGSEGV (and
a writable shared mapping would silently change every other rank's weights), so writes are
refused before they reach memory, at the Python level, with a `ShardwiseError` naming the
fix:

- `HostParameter` (the registered parameter) and `ReadOnlyView` (any tensor it hands out
  that aliases the mapping: `.data`, `.detach()`, `p[0]`, `p.t()`, `p.view(...)`) refuse
  every in-place op on themselves (`p.add_`, `p.copy_`, `p[0] = x`, `torch.nn.init.*`,
  `load_state_dict`), `out=` into them, and `p.data = t` (`model.half()` goes through it).
- `p.numpy()` / `np.asarray(p)` give a read-only array over the same memory (no copy).
- Copy-on-unfreeze: `p.requires_grad_(True)` (or `p.requires_grad = True`) first copies the
  values into this process's own memory and turns `p` back into a plain `nn.Parameter`: the
  same object, so an optimizer that holds it keeps working, and the shared copy is untouched.

What this cannot see: C++ code handed the raw storage (`p.untyped_storage()`, a kernel given
`p.data_ptr()`). Such a write faults instead of corrupting the other ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.engine.compat import plain_tensors
from shardwise.errors import ShardwiseError

_IN_PLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                     "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                     "__imatmul__"}


def _is_mapped(value, storage_ptr: int) -> bool:
    return (isinstance(value, torch.Tensor) and value.device.type == "cpu"
            and value.untyped_storage().data_ptr() == storage_ptr)


def _refuse(what: str, name: str | None) -> ShardwiseError:
    who = f"{name!r}" if name else "this tensor"
    return ShardwiseError(
        f"{what} would write {who}, a frozen weight shared read-only by every rank on this host "
        "(shard(..., frozen='host')). Unfreeze it first (`p.requires_grad_(True)` copies it out of the "
        "shared mapping, before sw.shard), or change the weights in the file the ranks map "
        "(frozen=sw.HostFrozen(source=...))"
    )


class _ReadOnlyMixin:
    """The `__torch_function__` of Note [read-only host weights], shared by both classes."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with plain_tensors():  # plain tensors below: no re-entry
            _check_write(func, args, kwargs)
            target = _target(args, kwargs)
            if isinstance(target, HostParameter) and _unfreezes(func, args, kwargs):
                return target.unfreeze() if getattr(func, "__name__", "") == "requires_grad_" else None
            result = func(*args, **kwargs)
            if getattr(func, "__name__", "") in ("numpy", "__array__") and hasattr(result, "flags"):
                result.flags.writeable = False  # the same memory, readable without a copy
                return result
            ptr = _mapped_ptr(args, kwargs)
            if ptr and _is_mapped(result, ptr) and not isinstance(result, nn.Parameter):
                view = result.as_subclass(ReadOnlyView)  # an alias of the mapping stays guarded
                view._sw_name = getattr(target, "_sw_name", None)
                return view
            return result


def _target(args, kwargs):
    """What an in-place op writes: `self`, or the first tensor keyword (`nn.init.normal_(tensor=p)`
    reaches `__torch_function__` with keywords only)."""
    if args:
        return args[0]
    return next((kwargs[k] for k in ("tensor", "input", "self") if k in kwargs), None)


def _unfreezes(func, args, kwargs) -> bool:
    """`p.requires_grad_(True)` or `p.requires_grad = True` (Note [read-only host weights])."""
    name = getattr(func, "__name__", "")
    descriptor = getattr(getattr(func, "__self__", None), "__name__", None)
    if name == "requires_grad_":
        return bool(args[1] if len(args) > 1 else kwargs.get("requires_grad", True))
    return name == "__set__" and descriptor == "requires_grad" and bool(args[1])


def _check_write(func, args, kwargs) -> None:
    """Raise when `func` would write the mapping (Note [read-only host weights])."""
    name = getattr(func, "__name__", "")
    descriptor = getattr(getattr(func, "__self__", None), "__name__", None)  # `Tensor.data.__set__` -> "data"
    target = _target(args, kwargs)
    if isinstance(target, _ReadOnlyMixin):
        if _unfreezes(func, args, kwargs) and not isinstance(target, HostParameter):
            raise _refuse("requires_grad=True on a view", target._sw_name)
        if descriptor == "data" and name == "__set__" and not _same_view(target, args[1]):
            raise _refuse("p.data = ...", target._sw_name)  # `module.to(its own device/dtype)` re-sets itself
        if (name.endswith("_") and not name.endswith("__") and name != "requires_grad_") \
                or name in _IN_PLACE_DUNDERS:
            raise _refuse(f"{name}()", target._sw_name)
    ptr = _mapped_ptr(args, kwargs)
    if not ptr:
        return
    out = kwargs.get("out")
    outs = out if isinstance(out, (list, tuple)) else [out]
    if out is not None and any(_is_mapped(o, ptr) for o in outs):
        raise _refuse(f"{name}(out=...)", None)
    if name.startswith("_foreach_") and name.endswith("_") and args and isinstance(args[0], (list, tuple)) \
            and any(_is_mapped(t, ptr) for t in args[0]):
        raise _refuse(f"{name}()", None)


def _mapped_ptr(args, kwargs) -> int:
    for value in list(args) + list(kwargs.values()):
        for item in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(item, _ReadOnlyMixin):
                return item.untyped_storage().data_ptr()
    return 0


def _same_view(current: torch.Tensor, new) -> bool:
    return (isinstance(new, torch.Tensor) and new.data_ptr() == current.data_ptr()
            and new.shape == current.shape and new.stride() == current.stride() and new.dtype == current.dtype)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as a plain tensor (no guard): what pickling writes."""
    with plain_tensors():
        return torch.Tensor._make_subclass(torch.Tensor, tensor.detach(), False)


class ReadOnlyView(_ReadOnlyMixin, torch.Tensor):
    """A tensor aliasing the host mapping (`p.data`, `p.detach()`, `p[0]`): reads only."""

    _sw_name: str | None = None

    def __reduce_ex__(self, protocol):
        # `torch.save(model.state_dict())` then `torch.load(weights_only=True)`: a plain tensor.
        return _plain(self).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = _plain(self).clone()  # a copy is the copier's own, writable memory
        return memo[id(self)]


class HostParameter(_ReadOnlyMixin, nn.Parameter):
    """A frozen parameter over the host's shared read-only mapping (Note [read-only host weights])."""

    _sw_name: str | None = None

    def __new__(cls, data: torch.Tensor, name: str | None = None):
        param = torch.Tensor._make_subclass(cls, data, False)
        param._sw_name = name
        return param

    def unfreeze(self) -> nn.Parameter:
        """Copy-on-unfreeze: this process's own copy of the values, then a plain trainable Parameter."""
        with plain_tensors():
            self.data = self.data.clone()
        self.__class__ = nn.Parameter  # the same object: optimizers and modules that hold it keep it
        self.requires_grad_(True)
        return self

    def __reduce_ex__(self, protocol):
        return nn.Parameter(_plain(self), requires_grad=False).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            with plain_tensors():
                memo[id(self)] = nn.Parameter(self.data.clone(), requires_grad=False)
        return memo[id(self)]

    def __repr__(self):
        with plain_tensors():
            return f"HostParameter({self._sw_name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, read-only)"


def is_host_shared(tensor) -> bool:
    """True for a parameter placed in the host's shared read-only mapping by `frozen="host"`."""
    return isinstance(tensor, HostParameter)

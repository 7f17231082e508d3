"""Which modules are units: what `shard(units=...)` accepts, and the choice `units="auto"` makes.
Uses: nothing of the engine.

Note [auto units]: a unit is the grain of communication, and what is not in a unit sits in
the root, gathered for the whole step. `"auto"` (the default) takes, in order:
1. the model's declared blocks: Hugging Face's `_no_split_modules` (class names), the
   modules a model says must never be split;
2. else the module class that repeats (two or more instances) and whose instances hold the
   most parameters (a parameter counts only if every module holding it is inside them), or a
   coarser repeated class holding at least 80% of that (a block of Linears, not the Linears);
3. else the root only.
If the root then still holds most of the parameters, a `ShardwiseWarning` (rank 0's, once) names the
largest root-held modules and the `units=` that would split them; unless what makes it most is the
embeddings and heads (an `nn.Embedding`, and a parameter of an embedding's shape: an untied head),
which no `units=` splits usefully, or the caller named the root itself as the unit (`units=[model]`: a
small pipeline stage, Note [a stage as one unit] in pipeline/sharded.py): then there is nothing to act
on, and nothing is said.
"""

from __future__ import annotations

import warnings
from typing import Callable, Union

import torch.distributed as dist
from torch import nn

from shardwise.errors import ShardwiseError, ShardwiseWarning

UnitSpec = Union[None, str, type, tuple, list, nn.Module, Callable[[nn.Module], bool]]
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def unit_predicate(model: nn.Module, units: UnitSpec) -> Callable[[nn.Module], bool]:
    """`module -> bool`: is this module a unit (the root always is, whatever this says)."""
    if units is None or units == "auto":
        return _auto(model)
    if isinstance(units, type) or (isinstance(units, tuple) and units and all(isinstance(u, type) for u in units)):
        return lambda module: isinstance(module, units)
    if isinstance(units, nn.Module):  # an instance: a container's children, or the module itself
        chosen = list(units) if isinstance(units, (nn.ModuleList, nn.Sequential)) else [units]
        return _instances(chosen)
    if isinstance(units, (list, tuple)) and units and all(isinstance(u, nn.Module) for u in units):
        return _instances(list(units))
    if isinstance(units, (list, tuple)) and units and all(isinstance(u, str) for u in units):
        modules = dict(model.named_modules())
        missing = [name for name in units if name not in modules]
        if missing:
            raise ShardwiseError(f"units={missing[:3]!r}: no module of that name in the model; names are "
                                 "as model.named_modules() gives them, e.g. 'transformer.h.0'")
        return _instances([modules[name] for name in units])
    if callable(units) and not isinstance(units, str):
        return units
    raise ShardwiseError(
        f"units={units!r} is not understood: pass 'auto' (the default), a module class or tuple of classes, "
        "a module instance or list of them (an nn.ModuleList: each child), a list of module names, or a "
        "callable module -> bool"
    )


def _instances(modules: list[nn.Module]) -> Callable[[nn.Module], bool]:
    chosen = {id(m) for m in modules}
    return lambda module: id(module) in chosen


def _auto(model: nn.Module) -> Callable[[nn.Module], bool]:
    # Declared by the model or by a model inside it (a LightningModule holding a Hugging Face model).
    declared = {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or ())}
    if declared and any(type(m).__name__ in declared for m in model.modules() if m is not model):
        return lambda module: type(module).__name__ in declared
    block = _repeated_class(model)
    if block is None:
        return lambda module: False
    return lambda module: isinstance(module, block)


def _repeated_class(model: nn.Module) -> type | None:
    """The class with two or more instances whose instances hold the most parameters. A
    parameter counts for a class only when every module holding it lies inside its instances:
    a GPT head's weight tied to the embedding counts for no Linear, so Block wins."""
    holders: dict[int, list[int]] = {}  # id(param) -> ids of the modules holding it
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(id(module))
    instances: dict[type, list[nn.Module]] = {}
    for module in model.modules():
        if module is not model and not isinstance(module, _CONTAINERS) and any(True for _ in module.parameters()):
            instances.setdefault(type(module), []).append(module)
    sizes = {id(p): p.numel() for p in model.parameters()}
    held: dict[type, tuple[int, int]] = {}  # class -> (parameters held, instances)
    for cls, members in instances.items():
        if len(members) >= 2:
            inside = {id(m) for member in members for m in member.modules()}
            held[cls] = (sum(sizes[key] for key, who in holders.items() if all(m in inside for m in who)),
                         len(members))
    most = max((numel for numel, _ in held.values()), default=0)
    if most == 0:
        return None
    # The coarsest class that holds nearly as much (a block of Linears, not the Linears).
    close = [cls for cls, (numel, _) in held.items() if numel >= 0.8 * most]
    return min(close, key=lambda cls: (held[cls][1], -held[cls][0]))


def names_the_root(model: nn.Module, units: UnitSpec) -> bool:
    """Whether `units` chose the root itself as a unit (not "auto", which never does)."""
    return not (units is None or units == "auto") and unit_predicate(model, units)(model)


def warn_if_root_holds_most(model: nn.Module, root_params: list[nn.Parameter]) -> None:
    """Note [auto units]: the warning when the root unit keeps most of the parameters."""
    total = sum(p.numel() for p in model.parameters())
    root_ids = {id(p) for p in root_params}
    embedding_shapes = {tuple(p.shape) for module in model.modules() if isinstance(module, nn.Embedding)
                        for p in module.parameters(recurse=False) if id(p) in root_ids}
    in_root = sum(p.numel() for p in root_params)
    splittable = sum(p.numel() for p in root_params if tuple(p.shape) not in embedding_shapes)
    if total == 0 or splittable * 2 <= total or (dist.is_initialized() and dist.get_rank() != 0):
        return
    sizes, seen = [], set()
    for name, module in model.named_modules():  # the modules that hold root parameters themselves
        own = [p for p in module.parameters(recurse=False) if id(p) in root_ids and id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            sizes.append((sum(p.numel() for p in own), name or "<root>", type(module).__name__))
    largest = ", ".join(f"{name} ({cls}, {numel / total:.0%})" for numel, name, cls in sorted(sizes, reverse=True)[:3])
    warnings.warn(ShardwiseWarning(
        f"the root unit holds {in_root / total:.0%} of the parameters, gathered for the whole step: largest "
        f"root-held modules {largest}. If they are blocks, pass units= to split them (their class, the "
        "nn.ModuleList holding them, or their names); an embedding tied to the head stays in the root. "
        "sw.describe(model) shows the plan."
    ), stacklevel=5)  # the user's sw.shard(...) line

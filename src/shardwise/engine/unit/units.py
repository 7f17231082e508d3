"""Cutting a model into units, and deciding which unit owns each (possibly shared) parameter.
Uses: host_param, unit_choice.

A unit is the grain of communication: one all-gather and one reduce-scatter per unit
per step. The root module is always a unit, so every parameter has an owner.

Note [shared params]: a parameter can be reachable under several names — a tied
embedding/head (`tok_emb.weight` and `head.weight`), a module registered in two
branches (`left.shared.weight`, `right.shared.weight`). It belongs to exactly one unit:
the innermost unit whose subtree holds *every* name of it. Its full value then exists
for that whole unit's window, whichever of its holders runs, and autograd sums the
contributions of every use before the owner reduces the gradient once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from shardwise.engine.memory.host_param import is_host_shared
from shardwise.engine.unit.unit_choice import UnitSpec, unit_predicate


@dataclass
class OwnedParam:
    """One distinct parameter, every place it is registered, and the name users know it by."""

    name: str  # the first name named_parameters() gives it: what optimizers and state_dict see
    param: nn.Parameter
    holders: list[tuple[nn.Module, str]]  # (module, attribute) for every registration


@dataclass
class UnitPlan:
    """A unit: its module, its dotted path (root: ""), and the parameters it owns."""

    module: nn.Module
    path: str
    params: list[OwnedParam] = field(default_factory=list)


def build_units(model: nn.Module, units: UnitSpec = "auto") -> list[UnitPlan]:
    """The units of `model` in module order (root first) with the parameters each owns;
    `units` as `shard()` takes it (unit_choice.py)."""
    is_unit = unit_predicate(model, units)
    plans: dict[int, UnitPlan] = {id(model): UnitPlan(model, "")}
    for path, module in model.named_modules():  # named_modules() visits a shared module once
        if module is not model and is_unit(module):
            plans[id(module)] = UnitPlan(module, path)
    # Every path a unit module is registered under (a shared unit has several).
    unit_paths: dict[int, list[str]] = {key: [] for key in plans}
    for path, module in model.named_modules(remove_duplicate=False):
        if id(module) in plans:
            unit_paths[id(module)].append(path)

    owned: dict[int, OwnedParam] = {}
    param_paths: dict[int, list[str]] = {}
    modules_by_path = dict(model.named_modules(remove_duplicate=False))
    for full_name, param in model.named_parameters(remove_duplicate=False):
        if is_host_shared(param):
            continue  # Note [host copy] (host_copy.py): one read-only copy per host, outside every unit
        module_path, _, attribute = full_name.rpartition(".")
        holder = (modules_by_path[module_path], attribute)
        if id(param) not in owned:
            owned[id(param)] = OwnedParam(full_name, param, [])
            param_paths[id(param)] = []
        if not any(h[0] is holder[0] and h[1] == attribute for h in owned[id(param)].holders):
            owned[id(param)].holders.append(holder)
        param_paths[id(param)].append(module_path)

    for key, entry in owned.items():
        owner = _innermost_enclosing(plans, unit_paths, param_paths[key])
        owner.params.append(entry)
    return list(plans.values())


def _within(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def _innermost_enclosing(plans, unit_paths, paths: list[str]) -> UnitPlan:
    """The deepest unit such that every registration path of the parameter lies under it."""
    best, best_depth = None, -1
    for key, plan in plans.items():
        if all(any(_within(p, u) for u in unit_paths[key]) for p in paths):
            depth = min(len(u.split(".")) if u else 0 for u in unit_paths[key])
            if depth > best_depth:
                best, best_depth = plan, depth
    return best


def root_scope_modules(model: nn.Module, unit_modules: list[nn.Module]) -> list[nn.Module]:
    """The root unit's modules below the model: every module not inside a unit (Note [outer calls])."""
    units = {id(m) for m in unit_modules}
    found: dict[int, nn.Module] = {}

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if id(child) not in units and id(child) not in found:
                found[id(child)] = child
                visit(child)

    visit(model)
    return list(found.values())

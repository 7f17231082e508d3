"""The optimizers' part of a load's first phase (Note [validate, then apply] in load.py): each optimizer given
paired with the saved record it loads, its class and its settings checked (Note [optimizer class]), and each
parameter's state planned where the current layout keeps it (Note [optimizer records] in optim_state.py): the
settings and scalars decoded, the tensors to read named. Nothing is written here; load.py applies the plan."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
from torch import Tensor

from shardwise.checkpoint.format.optim_state import (
    class_name,
    full_info,
    held_params,
    optimizer_names,
    placements,
)
from shardwise.checkpoint.format.records import OptimizerRecord
from shardwise.checkpoint.format.values import check_like, from_json, like_current, number_from_json
from shardwise.checkpoint.read.report import LoadReport
from shardwise.checkpoint.read.source_base import Source, SourceTensor
from shardwise.engine.layout.rows import num_rows
from shardwise.engine.optim.lowbit import check_parts, flatten_state
from shardwise.engine.optim.whole_step import StepShape, adopt_owners, owners_layout, step_shape, unwrapped
from shardwise.engine.unit.info import ShardInfo
from shardwise.errors import ShardwiseError


@dataclass
class StateRead:
    """One optimizer state tensor to load: a buffer of `shape` and `dtype`, into whose rows
    `info.row_start:info.row_end` (of the tensor `info.full_shape` describes) `source`'s rows go."""

    key: str
    source: SourceTensor
    info: ShardInfo
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class OptimizerLoad:
    """What one optimizer gets: each group's new settings (None: not loaded), and per param its
    state: (param, scalars or None for no state, [StateRead], device); by id(param), the loading class's
    state whose quantized tensors the loaded parts are made back into (Note [low-bit state])."""

    optim: torch.optim.Optimizer
    settings: list[dict] | None = None
    states: list = field(default_factory=list)
    prototypes: dict = field(default_factory=dict)


def pair_optimizers(source: Source, given: list, form: str, infos, pairs,
                    report: LoadReport) -> list[tuple[int, OptimizerRecord, object]]:
    """Each given optimizer (`named_optimizers`'s list, given in `form`) with the saved record it loads: by name
    when both sides have names, else by position; a different number of optimizers, other names or another
    class is refused. Then each pair's param groups are compared (`report.problems`: a strict load refuses)."""
    saved = source.optimizers
    if not given:
        return []
    if not saved:
        report.problems.append("the checkpoint holds no optimizer state (it was saved without optim=)")
        return []
    where = source.values_file or source.description
    kinds = [class_name(o) for _, o in given]  # each given optimizer's class, gathered once
    then = _show((r.name, r.class_name) for r in saved)
    now = _show((name, kind) for (name, _), kind in zip(given, kinds))
    if len(saved) != len(given):
        raise ShardwiseError(
            f"{where} holds the state of {len(saved)} optimizer(s) [{then}] and sw.load was given {len(given)} "
            f"[{now}]: pass the optimizers sw.save was given, as a list in the same order or a dict under the "
            "same names (sw.load(path, model, [muon, adamw]))")
    order = list(range(len(saved)))
    if form == "dict" and all(r.name is not None for r in saved):
        by_name = {r.name: i for i, r in enumerate(saved)}
        if set(by_name) != {name for name, _ in given}:
            raise ShardwiseError(f"{where} holds optimizers named [{then}], sw.load was given [{now}]: pass a dict "
                                 "with the names sw.save was given")
        order = [by_name[name] for name, _ in given]
    paired = []
    for number, (_, optim), kind in zip(order, given, kinds):
        record = saved[number]
        if not same_class(record.class_name, optim, kind):  # Note [optimizer class]
            label = f" ({record.name!r})" if record.name else f" (number {number})" if len(saved) > 1 else ""
            raise ShardwiseError(
                f"{where}: the optimizer state{label} was saved from {record.class_name} and would load into "
                f"{kind}: one optimizer class's state means nothing to another. Build the "
                f"{record.class_name} the checkpoint was saved with, or load the model alone (sw.load(path, model)) "
                "and start the new optimizer fresh")
        check_group_keys(record.groups, optim, kind, where)
        paired.append((number, record, optim))
    for number, record, optim in paired:
        _check_groups(record, optim, infos, pairs, report, f"optimizer {number}: " if len(paired) > 1 else "")
    return paired


def _show(records) -> str:
    return ", ".join(f"{name + ': ' if name else ''}{kind}" for name, kind in records)


def _check_groups(saved: OptimizerRecord, optim, infos, pairs, report: LoadReport, label: str) -> None:
    names = optimizer_names(optim, infos)
    if len(saved.groups) != len(optim.param_groups):
        report.problems.append(f"{label}the checkpoint has {len(saved.groups)} optimizer param groups, the "
                               f"optimizer {len(optim.param_groups)}; their settings were not loaded")
        return
    for index, (then, now) in enumerate(zip(saved.groups, optim.param_groups)):
        current = {pairs[n].name if n in pairs else n for n in (names[id(p)] for p in held_params(now))}
        if set(then.params) != current:
            differ = sorted(set(then.params) ^ current)
            report.problems.append(f"{label}optimizer param group {index} holds different parameters in the "
                                   f"checkpoint and in the optimizer (differing: {differ[:4]}"
                                   f"{'...' if len(differ) > 4 else ''})")


def plan_optimizer(source: Source, number: int, saved: OptimizerRecord, optim, infos, pairs) -> OptimizerLoad:
    """Each group's settings (decoded, and each of the type the current one has), then each param's
    state where the current layout keeps it (Note [optimizer records]): scalars from JSON, tensors from files."""
    load = OptimizerLoad(optim)
    names = optimizer_names(optim, infos)
    _adopt_recorded_owners(saved, optim, names, pairs)
    where_state = placements(optim, infos)
    _check_owners(source.values_file or source.description, saved, optim, names, pairs, where_state)
    shapes = StateShapes(optim)  # Note [optimizer class]
    same_groups = len(saved.groups) == len(optim.param_groups)
    if same_groups:
        load.settings = []
        for index, group in enumerate(optim.param_groups):
            settings = {}
            for key, value in saved.groups[index].options.items():
                where = f"{source.values_file}: optimizer param group {index}'s {key!r}"
                if key == "params":
                    raise ShardwiseError(f"{where}: a saved group's settings cannot replace its parameters; the "
                                         "checkpoint is damaged")
                decoded = from_json(value, where=where)
                check_like(decoded, group.get(key), where)
                settings[key] = like_current(decoded, group.get(key))
            load.settings.append(settings)
    for index, group in enumerate(optim.param_groups):
        settings = {**group, **(load.settings[index] if same_groups else {})}
        on_device = bool(settings.get("fused") or settings.get("capturable"))
        for param in held_params(group):
            name = names[id(param)]
            state = saved.state.get(pairs[name].name) if name in pairs else None
            place = where_state[id(param)]
            if state is None or not place.mine:
                load.states.append((param, None, None, None))  # none saved, or another rank owns it
                continue
            shapes.check(name, index, tuple(infos[name].full_shape), param.dtype, state, source.values_file)
            load.prototypes[id(param)] = shapes.prototype(index, tuple(infos[name].full_shape), param.dtype)
            for key, value in state.scalars.items():
                number_from_json(value, f"{source.values_file}: optimizer state {key!r} of {name!r}")
            info = infos[name] if place.owner is None else full_info(infos[name])
            shape = tuple(param.shape) if place.owner is None else tuple(info.full_shape)
            reads = []
            for key, record in state.tensors.items():
                tensor = source.optimizer_tensor(number, pairs[name].name, key)
                floating = tensor.dtype.is_floating_point and param.dtype.is_floating_point
                reads.append(StateRead(key, tensor, info, shape, param.dtype if floating else tensor.dtype))
            for key, record in state.whole.items():
                tensor = source.optimizer_tensor(number, pairs[name].name, key, whole=True)
                rows = num_rows(record.shape)
                reads.append(StateRead(key, tensor, ShardInfo(param, record.shape, 0, rows, ()), record.shape,
                                       record.dtype))
            load.states.append((param, state.scalars, reads, param.device if on_device else "cpu"))
    return load


def _adopt_recorded_owners(saved: OptimizerRecord, optim, names, pairs) -> None:
    """Note [recorded owners]: an optimizer without owners yet, under a shard group of the recorded size,
    takes the recorded map (whole_step.adopt_owners)."""
    layout = owners_layout(optim)
    if not saved.owners or layout is None or layout.shard_world != saved.owner_world:
        return
    recorded = {}
    for group in optim.param_groups:
        for param in held_params(group):
            name = names[id(param)]
            saved_name = pairs[name].name if name in pairs else name
            if saved_name in saved.owners:
                recorded[id(param)] = saved.owners[saved_name]
    adopt_owners(optim, recorded)


def _check_owners(where: str, saved: OptimizerRecord, optim, names, pairs, where_state) -> None:
    """Note [recorded owners] in optim_state.py: under a shard group of the recorded size, the owner map
    must be the recorded one; under another size each whole state simply goes to its new owner."""
    now = {}
    for group in optim.param_groups:
        for param in group["params"]:
            owner = where_state[id(param)].owner
            if owner is not None:
                name = names[id(param)]
                now[pairs[name].name if name in pairs else name] = owner
    world = owners_layout(optim).shard_world if now else 0
    if not saved.owners or world != saved.owner_world:
        return
    differ = [name for name, owner in saved.owners.items() if name in now and now[name] != owner]
    if differ:
        shown = ", ".join(f"{name!r} saved on rank {saved.owners[name]}, now rank {now[name]}" for name in differ[:4])
        raise ShardwiseError(
            f"{where}: the {saved.class_name}'s whole-tensor owners differ from the ones recorded at the same shard "
            f"group size ({world}): {shown}{'...' if len(differ) > 4 else ''}. Owners follow the order of the "
            "optimizer's param groups and its cost model: build the optimizer with the param groups it was saved "
            "with, in the same order (Note [recorded owners])")


# Note [optimizer class]: a checkpoint records the optimizer's class qualified by its module (`class_name`)
# (`torch.optim.adafactor.Adafactor`), and loads only into the same class: `transformers`' Adafactor
# and torch's share a name and nothing else (other group keys, other state). Two names are the same
# class when their top-level package and their qualified class name agree, so a class moved between
# modules of one package (torch.optim._adafactor -> torch.optim.adafactor) still loads; a name recorded
# bare (before this rule), or a class of a script (`__main__`, imported under its file's name elsewhere),
# matches by the bare name. Whatever the name, the saved param groups may hold no setting the loading
# optimizer's groups lack (`check_group_keys`), and a whole-tensor optimizer's state must have the
# shapes the loading class gives it (`StateShapes`).


def same_class(recorded: str, optim, kind: str) -> bool:
    """Whether a checkpoint's recorded optimizer class is `optim`'s, `kind` (its `class_name`) (Note [optimizer
    class])."""
    def key(name: str) -> tuple[str, str]:  # (top-level package, class name)
        return name.split(".")[0], name.rsplit(".", 1)[-1]
    names = {kind, f"{type(optim).__module__}.{type(optim).__qualname__}"}  # or the wrapper's own
    bare = {name.rsplit(".", 1)[-1] for name in names}
    if "." not in recorded or recorded.startswith("__main__.") or any(n.startswith("__main__.") for n in names):
        return recorded.rsplit(".", 1)[-1] in bare  # bare (saved before), or a script's class imported elsewhere
    return key(recorded) in {key(name) for name in names}


# Settings torch's LR schedulers add to an optimizer's param groups: a checkpoint saved after the
# scheduler was built holds them, an optimizer loaded before it is built has none yet.
SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr"})


def check_group_keys(saved_groups, optim, kind: str, where: str) -> None:
    """Refuse saved param-group settings the loading optimizer's groups do not have (Note [optimizer class]):
    loaded, they would be added to its groups and its step would misread or trip over them."""
    have = {key for group in optim.param_groups for key in group}
    unknown = sorted({key for group in saved_groups for key in group.options} - have - SCHEDULER_KEYS)
    if unknown:
        raise ShardwiseError(
            f"{where}: the saved param groups hold settings a {kind} does not have "
            f"({', '.join(unknown[:6])}{'...' if len(unknown) > 6 else ''}): the state was saved from another "
            "optimizer class, or another version of it. Build the optimizer the checkpoint was saved with, or "
            "load the model alone (sw.load(path, model)) and start the new optimizer fresh")


class StateShapes:
    """Note [optimizer class]: the shapes a whole-tensor optimizer's class gives one parameter's state,
    found by a dry step of a copy of the loading optimizer over a zero tensor of the parameter's full
    shape (on the meta device when the class steps there, else on the CPU), once per shape, dtype and
    group; a saved state of another shape is refused. A look-alike `Adafactor` saving `col_var` [C, C]
    where torch's has [1, C] would otherwise load and step with a broadcast. Elementwise classes
    (state shaped as the parameter by construction) and classes whose step cannot run dry (it needs a
    closure) are not checked."""

    def __init__(self, optim):
        self.optim = unwrapped(optim)
        self.checked = step_shape(self.optim) is not StepShape.ROWS
        self.found: dict[tuple, dict | None] = {}  # the dry step's state by (shape, dtype, group)

    def check(self, name: str, group_index: int, shape: tuple, dtype: torch.dtype, state, where: str) -> None:
        """Refuse saved state `state` (a StateRecord) of parameter `name` whose shapes differ from the class's."""
        if not self.checked:
            return
        saved = {**{k: shape for k in state.tensors}, **{k: r.shape for k, r in state.whole.items()}}
        prototype = self.prototype(group_index, shape, dtype)
        check_parts(prototype, saved, f"{where}: the optimizer state of {name!r}")  # Note [low-bit state]
        expected = None if prototype is None else {
            k: tuple(v.shape) for k, v in flatten_state(prototype, repr(name)).items() if isinstance(v, Tensor)}
        differ = {k: v for k, v in saved.items() if expected is not None and k in expected
                  and len(v) and tuple(v) != expected[k]}
        if differ:
            shown = ", ".join(f"{k!r} {list(v)} where a {class_name(self.optim)} has {list(expected[k])}"
                              for k, v in differ.items())
            raise ShardwiseError(
                f"{where}: the optimizer state of {name!r} (shape {list(shape)}) holds {shown}: it was saved from "
                "another optimizer class that shares the name, or edited. Build the optimizer the checkpoint "
                "was saved with, or load the model alone (sw.load(path, model)) and start the new optimizer fresh")

    def prototype(self, group_index: int, shape: tuple, dtype: torch.dtype) -> dict | None:
        """The state the loading class gives a parameter of `shape` in group `group_index` (its dry step's, on
        meta or the CPU: what a quantized state is made back into, Note [low-bit state]); None when not known."""
        if not self.checked:
            return None
        key = (tuple(shape), dtype, group_index)
        if key not in self.found:
            self.found[key] = self._dry_step(self.optim.param_groups[group_index], tuple(shape), dtype)
        return self.found[key]

    def _dry_step(self, group: dict, shape: tuple, dtype: torch.dtype) -> dict | None:
        for device in ("meta", "cpu"):
            kind = type(self.optim)
            clone = object.__new__(kind)
            # the instance's own attributes, but never one that reaches the original (a `step` patched on the
            # instance is bound to it: calling it stepped the real parameters)
            clone.__dict__.update({k: v for k, v in self.optim.__dict__.items() if not callable(v)})
            param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
            param.grad = torch.zeros_like(param)
            clone.state = collections.defaultdict(dict)
            clone.param_groups = [{**group, "params": [param]}]
            clone._optimizer_step_pre_hooks, clone._optimizer_step_post_hooks = {}, {}  # not the original's
            try:
                with torch.no_grad():
                    kind.step(clone)  # the class's step: an instance-level patch is the original's
            except Exception:  # noqa: BLE001 - meta has no .item(); a closure-only step cannot run dry
                continue
            return dict(clone.state[param])
        return None

"""The first phase of `sw.load` (Note [validate, then apply] in load.py): every check, every
byte it will read verified, every saved value decoded, and nothing written yet."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.checkpoint.format.names import clean_name, persistent_buffers
from shardwise.checkpoint.format.optim_state import (
    StateShapes,
    check_group_keys,
    class_name,
    full_info,
    held_params,
    optimizer_names,
    placements,
    same_class,
)
from shardwise.checkpoint.format.records import OptimizerRecord
from shardwise.checkpoint.format.values import check_like, check_rng, from_json, like_current
from shardwise.checkpoint.read.report import LoadReport, match
from shardwise.checkpoint.read.sources import Source, SourceTensor
from shardwise.engine.layout.rows import num_rows
from shardwise.engine.optim.whole_step import owners_layout
from shardwise.engine.unit.info import ShardInfo, row_view, shard_info
from shardwise.errors import ShardwiseError


@dataclass
class LoadJob:
    """One `sw.load` call on this rank: what it reads from, what it fills, and how."""

    source: Source
    model: nn.Module
    optimizers: list  # [(name or None, optimizer)], as optim_state.named_optimizers gives them
    form: str  # how they were given: "none", "one", "list", "dict"
    scheduler: object | None
    objects: dict  # keyword objects with load_state_dict (sampler=...)
    strict: bool
    restore_rng: bool | None  # None: restore when resuming (optim given)
    rank: int
    world: int
    infos: dict | None = None  # the rows this rank fills, when not `shard_info(model)`'s (load.load_view)


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


@dataclass
class LoadPlan:
    """What the apply phase writes, all of it checked: (name, source tensor, lo, hi, destination) reads,
    each optimizer's settings and state, decoded states, RNG states."""

    job: LoadJob
    report: LoadReport
    reads: list = field(default_factory=list)
    optimizers: list[OptimizerLoad] = field(default_factory=list)
    scheduler_state: dict | None = None
    object_states: dict = field(default_factory=dict)
    rng: tuple | None = None


def plan_load(job: LoadJob) -> LoadPlan:
    """Check everything `job` would load on this rank and verify every byte it would read; write nothing."""
    source, model = job.source, job.model
    infos = {clean_name(raw): info for raw, info in (job.infos or shard_info(model)).items()}
    buffers = persistent_buffers(model)
    plan = LoadPlan(job, LoadReport(source.description, extra=dict(source.extra), notes=list(source.notes)))
    report = plan.report
    targets = {name: (tuple(info.full_shape), [name, *map(clean_name, info.aliases)])
               for name, info in infos.items()}
    for name, buffer in buffers.items():
        targets.setdefault(name, (tuple(buffer.shape), [name]))
    pairs = match(source, targets, report)
    paired = _pair_optimizers(source, job, report)
    for number, saved, optim in paired:
        _check_groups(saved, optim, infos, pairs, report, f"optimizer {number}: " if len(paired) > 1 else "")
    if job.scheduler is not None and source.scheduler is None:
        report.problems.append("the checkpoint holds no scheduler state (it was saved without scheduler=)")
    for key in job.objects:
        if key not in source.objects:
            report.problems.append(f"the checkpoint holds no state for {key}= (pass it to sw.save as well)")
            continue
        try:
            state = source.object_state(key, job.objects[key], job.rank, job.world)
            plan.object_states[key] = from_json(state, where=f"{source.values_file}: the saved state of {key}=")
        except ShardwiseError as error:
            report.problems.append(str(error))
    if job.strict and not report.ok:
        raise ShardwiseError(f"{report}\nstrict=True refuses a partial load: fix the names (rename=...), or pass "
                             "strict=False to load what matches (fine-tuning a changed head).")
    for name, tensor in pairs.items():
        if name in infos:
            info = infos[name]
            lo, hi = info.row_start, info.row_end
            dest = row_view(info.param, info, lo, hi)
        else:
            buffer = buffers[name]
            lo, hi = 0, num_rows(buffer.shape)
            dest = buffer.reshape(-1) if buffer.dim() == 0 else buffer
        plan.reads.append((name, tensor, lo, hi, dest))
    _refuse_meta(plan.reads)
    _note_conversions(plan.reads, report)
    for number, saved, optim in paired:
        plan.optimizers.append(_plan_optimizer(plan, number, saved, optim, infos, pairs))
    if job.scheduler is not None and source.scheduler is not None:
        where = f"{source.values_file}: the saved scheduler state"
        plan.scheduler_state = from_json(source.scheduler, where=where)
        current = job.scheduler.state_dict()
        unknown = sorted(set(plan.scheduler_state) - set(current))
        if unknown:  # load_state_dict sets each as an attribute: `step` would replace the method
            raise ShardwiseError(f"{where} holds keys the scheduler's own state does not ({unknown[:4]}): the "
                                 "checkpoint was edited or saved from another scheduler. Load an earlier checkpoint.")
        check_like(plan.scheduler_state, current, where)
    wanted = bool(job.optimizers) if job.restore_rng is None else job.restore_rng
    plan.rng = _plan_rng(source, report, wanted, job.rank, job.world)
    needs = [(tensor, lo, hi) for _, tensor, lo, hi, _ in plan.reads]
    needs += [(read.source, read.info.row_start, read.info.row_end) for load in plan.optimizers
              for *_, reads, _ in load.states for read in reads or ()]
    source.verify(needs)
    return plan


def _refuse_meta(reads) -> None:
    """A destination on the meta device holds no memory: a copy into it does nothing, and the load would
    report tensors loaded that are not (a model built under sw.deferred_init() and never sharded)."""
    on_meta = [name for name, _, _, _, dest in reads if dest.device.type == "meta" and dest.numel()]
    if on_meta:
        raise ShardwiseError(
            f"{len(on_meta)} of the model's tensors are on the meta device ({', '.join(on_meta[:3])}"
            f"{', ...' if len(on_meta) > 3 else ''}): built under sw.deferred_init() and not materialized, they "
            "hold no memory to load into. Call sw.shard(model, strategy=...) first (it materializes each rank's "
            "rows), then sw.load; or build and load in one call with sw.from_pretrained(model_class, path)")


def _note_conversions(reads, report: LoadReport) -> None:
    """Say which stored dtypes the load converts to the model's (a bf16 file into fp32 parameters: exact; the
    reverse rounds to nearest, as `tensor.to(dtype)` and `from_pretrained(dtype=...)` do)."""
    converted: dict[tuple[torch.dtype, torch.dtype], int] = {}
    for _, tensor, _, _, dest in reads:
        if tensor.dtype != dest.dtype:
            converted[(tensor.dtype, dest.dtype)] = converted.get((tensor.dtype, dest.dtype), 0) + 1
    for (stored, held), count in converted.items():
        exact = stored.is_floating_point and held.is_floating_point and torch.finfo(held).bits >= \
            torch.finfo(stored).bits and torch.finfo(held).eps <= torch.finfo(stored).eps
        report.notes.append(f"{count} tensors stored as {stored} were converted to the model's {held} "
                            f"({'exactly' if exact else 'rounded to nearest'})")


def _show(records) -> str:
    return ", ".join(f"{name + ': ' if name else ''}{kind}" for name, kind in records)


def _pair_optimizers(source: Source, job: LoadJob, report: LoadReport) -> list[tuple[int, OptimizerRecord, object]]:
    """Each given optimizer with the saved record it loads: by name when both sides have names, else
    by position; a different number of optimizers, other names or another class is refused."""
    saved, given = source.optimizers, job.optimizers
    if not given:
        return []
    if not saved:
        report.problems.append("the checkpoint holds no optimizer state (it was saved without optim=)")
        return []
    where = source.values_file or source.description
    then = _show((r.name, r.class_name) for r in saved)
    now = _show((name, class_name(o)) for name, o in given)
    if len(saved) != len(given):
        raise ShardwiseError(
            f"{where} holds the state of {len(saved)} optimizer(s) [{then}] and sw.load was given {len(given)} "
            f"[{now}]: pass the optimizers sw.save was given, as a list in the same order or a dict under the "
            "same names (sw.load(path, model, [muon, adamw]))")
    order = list(range(len(saved)))
    if job.form == "dict" and all(r.name is not None for r in saved):
        by_name = {r.name: i for i, r in enumerate(saved)}
        if set(by_name) != {name for name, _ in given}:
            raise ShardwiseError(f"{where} holds optimizers named [{then}], sw.load was given [{now}]: pass a dict "
                                 "with the names sw.save was given")
        order = [by_name[name] for name, _ in given]
    paired = []
    for number, (_, optim) in zip(order, given):
        record = saved[number]
        if not same_class(record.class_name, optim):  # Note [optimizer class] in optim_state.py
            label = f" ({record.name!r})" if record.name else f" (number {number})" if len(saved) > 1 else ""
            raise ShardwiseError(
                f"{where}: the optimizer state{label} was saved from {record.class_name} and would load into "
                f"{class_name(optim)}: one optimizer class's state means nothing to another. Build the "
                f"{record.class_name} the checkpoint was saved with, or load the model alone (sw.load(path, model)) "
                "and start the new optimizer fresh")
        check_group_keys(record.groups, optim, where)
        paired.append((number, record, optim))
    return paired


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


def _check_owners(where: str, saved: OptimizerRecord, optim, names, pairs, where_state) -> None:
    """Note [recorded owners] (optim_state.py): under a shard group of the recorded size, the owner map
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


def _plan_optimizer(plan: LoadPlan, number: int, saved: OptimizerRecord, optim, infos, pairs) -> OptimizerLoad:
    """Each group's settings (decoded, and each of the type the current one has), then each param's
    state where the current layout keeps it (Note [optimizer records]): scalars from JSON, tensors from files."""
    source = plan.job.source
    load = OptimizerLoad(optim)
    names = optimizer_names(optim, infos)
    where_state = placements(optim, infos)
    _check_owners(source.values_file or source.description, saved, optim, names, pairs, where_state)
    shapes = StateShapes(optim)  # Note [optimizer class] in optim_state.py
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
                where = f"{source.values_file}: optimizer state {key!r} of {name!r}"
                _check_scalar(from_json(value, where=where), where)
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


def _check_scalar(value, where: str) -> None:
    """A per-parameter optimizer scalar (AdamW's `step`) is a number or a one-element tensor."""
    if type(value) in (bool, int, float) or value is None or isinstance(value, torch.Tensor) and value.numel() == 1:
        return
    raise ShardwiseError(f"{where} is {str(value)[:60]!r} in the checkpoint, not a number: the checkpoint was edited "
                         "or damaged. Load an earlier checkpoint.")


def _plan_rng(source: Source, report: LoadReport, wanted: bool, rank: int, world: int):
    """This rank's saved RNG states, read, verified and tried; None when they are not restored."""
    if not wanted:
        return None
    if source.world_size != world:
        report.notes.append("RNG states not restored: " + (
            "the source holds none" if source.world_size is None else
            f"saved by {source.world_size} ranks, loading on {world} (each rank's stream belongs to its rank)"))
        return None
    saved = source.rng_of(rank)
    if saved is None:
        report.notes.append("RNG states not restored: the checkpoint holds none for this rank")
        return None
    check_rng(*saved, f"{source.description}, rank {rank}")
    return saved


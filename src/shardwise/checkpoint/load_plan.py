"""The first phase of `sw.load` (Note [validate, then apply] in load.py): every check, every
byte it will read verified, every saved value decoded, and nothing written yet."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.checkpoint.names import clean_name, persistent_buffers
from shardwise.checkpoint.optim_state import optimizer_names
from shardwise.checkpoint.report import LoadReport, match
from shardwise.checkpoint.sources import Source
from shardwise.checkpoint.values import check_like, check_rng, from_json, like_current
from shardwise.engine.info import row_view, shard_info
from shardwise.errors import ShardwiseError


@dataclass
class LoadJob:
    """One `sw.load` call on this rank: what it reads from, what it fills, and how."""

    source: Source
    model: nn.Module
    optim: torch.optim.Optimizer | None
    scheduler: object | None
    objects: dict  # keyword objects with load_state_dict (sampler=...)
    strict: bool
    restore_rng: bool | None  # None: restore when resuming (optim given)
    rank: int
    world: int


@dataclass
class LoadPlan:
    """What the apply phase writes, all of it checked: (name, source tensor, lo, hi, destination) reads,
    each optimizer group's new settings, each param's optimizer state, decoded states, RNG states."""

    job: LoadJob
    report: LoadReport
    reads: list = field(default_factory=list)
    optim_settings: list[dict] | None = None
    optim_states: list = field(default_factory=list)  # (param, scalars or None, [(key, tensor, info)], device)
    scheduler_state: dict | None = None
    object_states: dict = field(default_factory=dict)
    rng: tuple | None = None


def plan_load(job: LoadJob) -> LoadPlan:
    """Check everything `job` would load on this rank and verify every byte it would read; write nothing."""
    source, model, optim = job.source, job.model, job.optim
    infos = {clean_name(raw): info for raw, info in shard_info(model).items()}
    buffers = persistent_buffers(model)
    plan = LoadPlan(job, LoadReport(source.description, extra=dict(source.extra)))
    report = plan.report
    targets = {name: (tuple(info.full_shape), [name, *map(clean_name, info.aliases)])
               for name, info in infos.items()}
    for name, buffer in buffers.items():
        targets.setdefault(name, (tuple(buffer.shape), [name]))
    pairs = match(source, targets, report)
    if optim is not None:
        _check_optimizer(source, optim, infos, pairs, report)
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
            lo, hi = 0, buffer.shape[0] if buffer.dim() else 1
            dest = buffer.reshape(-1) if buffer.dim() == 0 else buffer
        plan.reads.append((name, tensor, lo, hi, dest))
    if optim is not None and source.optimizer is not None:
        _plan_optimizer(plan, infos, pairs)
    if job.scheduler is not None and source.scheduler is not None:
        where = f"{source.values_file}: the saved scheduler state"
        plan.scheduler_state = from_json(source.scheduler, where=where)
        current = job.scheduler.state_dict()
        unknown = sorted(set(plan.scheduler_state) - set(current))
        if unknown:  # load_state_dict sets each as an attribute: `step` would replace the method
            raise ShardwiseError(f"{where} holds keys the scheduler's own state does not ({unknown[:4]}): the "
                                 "checkpoint was edited or saved from another scheduler. Load an earlier checkpoint.")
        check_like(plan.scheduler_state, current, where)
    wanted = optim is not None if job.restore_rng is None else job.restore_rng
    plan.rng = _plan_rng(source, report, wanted, job.rank, job.world)
    needs = [(tensor, lo, hi) for _, tensor, lo, hi, _ in plan.reads]
    needs += [(tensor, info.row_start, info.row_end) for *_, tensors, _ in plan.optim_states
              for _, tensor, info in tensors or ()]
    source.verify(needs)
    return plan


def _check_optimizer(source: Source, optim, infos, pairs, report: LoadReport) -> None:
    saved = source.optimizer
    if saved is None:
        report.problems.append("the checkpoint holds no optimizer state (it was saved without optim=)")
        return
    if saved.class_name != type(optim).__name__:
        report.problems.append(f"the optimizer state was saved from {saved.class_name}, not {type(optim).__name__}")
    names = optimizer_names(optim, infos)
    if len(saved.groups) != len(optim.param_groups):
        report.problems.append(f"the checkpoint has {len(saved.groups)} optimizer param groups, the "
                               f"optimizer {len(optim.param_groups)}; their settings were not loaded")
        return
    for index, (then, now) in enumerate(zip(saved.groups, optim.param_groups)):
        current = {pairs[n].name if n in pairs else n for n in (names[id(p)] for p in now["params"])}
        if set(then.params) != current:
            differ = sorted(set(then.params) ^ current)
            report.problems.append(f"optimizer param group {index} holds different parameters in the checkpoint "
                                   f"and in the optimizer (differing: {differ[:4]}{'...' if len(differ) > 4 else ''})")


def _plan_optimizer(plan: LoadPlan, infos, pairs) -> None:
    """Each group's settings (decoded, and each of the type the current one has), then each param's
    state: scalars from JSON, rows from files."""
    saved, optim, source = plan.job.source.optimizer, plan.job.optim, plan.job.source
    names = optimizer_names(optim, infos)
    same_groups = len(saved.groups) == len(optim.param_groups)
    if same_groups:
        plan.optim_settings = []
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
            plan.optim_settings.append(settings)
    for index, group in enumerate(optim.param_groups):
        settings = {**group, **(plan.optim_settings[index] if same_groups else {})}
        on_device = bool(settings.get("fused") or settings.get("capturable"))
        for param in group["params"]:
            name = names[id(param)]
            state = saved.state.get(pairs[name].name) if name in pairs else None
            if state is None:
                plan.optim_states.append((param, None, None, None))
                continue
            for key, value in state.scalars.items():
                where = f"{source.values_file}: optimizer state {key!r} of {name!r}"
                _check_scalar(from_json(value, where=where), where)
            tensors = [(key, source.optimizer_tensor(pairs[name].name, key), infos[name]) for key in state.tensors]
            plan.optim_states.append((param, state.scalars, tensors, param.device if on_device else "cpu"))


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


"""The first phase of `sw.load` (Note [validate, then apply] in load.py): every check, every
byte it will read verified, every saved value decoded, and nothing written yet."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.checkpoint.format.names import clean_name, persistent_buffers
from shardwise.checkpoint.format.values import check_like, check_rng, from_json
from shardwise.checkpoint.read.optim_plan import OptimizerLoad, pair_optimizers, plan_optimizer
from shardwise.checkpoint.read.report import LoadReport, match
from shardwise.checkpoint.read.source_base import Source
from shardwise.engine.layout.rows import num_rows
from shardwise.engine.unit.info import row_view, shard_info
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
    paired = pair_optimizers(source, job.optimizers, job.form, infos, pairs, report)
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
        plan.optimizers.append(plan_optimizer(source, number, saved, optim, infos, pairs))
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


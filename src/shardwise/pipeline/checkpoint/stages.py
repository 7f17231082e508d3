"""Checkpoints of sharded pipeline stages: one `sw.save` directory for the whole model, written by every
stage, that loads into any layout (flat zero1/2/3, one process, another pipe x shard) and back.

Note [stage checkpoints]: the format is sw.save's (checkpoint/write/save.py), by the model's full parameter
names, so what loads it does not need to know it was a pipeline. Each rank sees its stage's sharded module
through a view (`_named_view`: its shards registered under their model names), so the engine's rows of
each name (its shard coordinate's, Note [rows]) are what the rank writes and reads. A save is one
collective over the pipeline's group: every rank writes its file of its stage's rows, and rank 0's index
is the union over the stages (`_union`: every stage's names, shapes and optimizer param groups, gathered
as JSON), the stages holding disjoint names. A weight tied across stages (Note [ties across stages],
sharded.py) is one parameter: the first stage holding it writes it and its optimizer rows, the later ones
leave it out, so the index has one entry and the loader fills both copies from it. A load first matches
the checkpoint against the union of the stages' names and param groups on every rank (`_check_union`:
a name no stage holds, one missing, another shape, other param groups: a ShardwiseError on every rank,
nothing changed); then each stage loads its names through its view (sw.load over its stage's ranks,
the other stages' names left to them).

A `PipeTrainer`'s checkpoint also holds its frozen prefix and what it records of its run (resume.py).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardwise.checkpoint.format.crc import crc32
from shardwise.checkpoint.format.names import persistent_buffers
from shardwise.checkpoint.format.optim_state import held_params
from shardwise.checkpoint.format.ranks import all_gather_object
from shardwise.checkpoint.format.values import check_like, from_json, like_current, to_json
from shardwise.checkpoint.read.load import load_view
from shardwise.checkpoint.read.report import LoadReport, match
from shardwise.checkpoint.read.sources import open_source
from shardwise.checkpoint.write.save import complete, prepare
from shardwise.engine.layout.rows import num_rows, row_range
from shardwise.engine.protocol import ShardInfo, engine_of
from shardwise.engine.unit.info import row_view, shard_info
from shardwise.errors import ShardwiseError
from shardwise.pipeline.checkpoint.resume import PIPELINE_KEY, check_resume, frozen_prefix, run_record

STRATEGIES = ("zero1", "zero2", "zero3")


def save_stages(path, module: nn.Module, optim=None, *, names: dict[str, str], stage: int, group=None,
                scheduler=None, keep_last: int | None = None, durable: bool = True, whole=None, **extra) -> Path:
    """Save every stage of a sharded pipeline as one checkpoint (Note [stage checkpoints]); every rank of
    `group` (default: the world) calls it with its stage's module (sharded by sw.shard zero1/2/3), its
    optimizer, `names` (the module's parameter names -> the model's) and `stage` (its pipe rank).
    `whole`: {model name: tensor} held whole and alike by every rank of `group` outside the stages (a
    re-packed pipeline's frozen prefix, Note [the frozen prefix in a checkpoint])."""
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    _agree(lambda: _check_stage(module, optim, names, "save"), group, world)
    mine = [(names[n], p) for n, p in module.named_parameters()]
    holders = all_gather_object([stage, [n for n, _ in mine]], group, world)
    first = {}
    for held_on, held in holders:
        for name in held:
            first[name] = min(first.get(name, held_on), held_on)
    _check_one_value_per_name(mine, group, world)
    written = [(n, p) for n, p in mine if first[n] == stage]  # a tie: the first stage holding it writes it
    whole = {n: t for n, t in (whole or {}).items() if n not in first}  # a frozen tie: its stage's shard
    view = _named_view(written)
    optim_view = _without(optim, {id(p) for _, p in written}) if optim is not None else None
    described = _agree(lambda: _describe(written, optim_view, whole), group, world)
    union = _union(all_gather_object(described, group, world))  # the same on every rank: raises on all
    job = prepare(path, view, optim_view, scheduler, keep_last, durable, extra, group=group)
    job.infos.update(_whole_infos(whole, job.rank, job.world))
    if job.rank == 0:
        _fill_union(job, union)
    complete(job, group)
    return job.path


def load_stages(path, module: nn.Module, optim=None, *, names: dict[str, str], group=None,
                scheduler=None, whole=None) -> LoadReport:
    """Load a checkpoint (of any layout: a pipeline's, a flat model's, one process's) into every stage of a
    sharded pipeline; every rank of `group` calls it with what it gave `save_stages`. Each stage takes its
    names, the tie on every stage holding it; anything that cannot load is refused on every rank before
    any rank changes (Note [stage checkpoints]). Returns this rank's report."""
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    _agree(lambda: _check_stage(module, optim, names, "load"), group, world)
    mine = [(names[n], p) for n, p in module.named_parameters()]
    _check_one_value_per_name(mine, group, world)
    whole, own = dict(whole or {}), {m for m, _ in mine}
    view = _named_view(mine)
    outside = {n: t for n, t in whole.items() if n not in own}
    union = _union(all_gather_object(_agree(lambda: _describe(mine, optim, outside), group, world), group, world))
    by_name = dict((id(p), n) for n, p in mine)
    groups = None if optim is None else [[by_name[id(p)] for p in held_params(g)] for g in optim.param_groups]
    saved = _agree(lambda: _check_union(path, union, groups), group, world)
    settings = _agree(lambda: optim and _decode_settings(optim, saved, str(path)), group, world)
    shards = shard_info(view)  # a frozen tie's stage shard takes its rows from the whole copy, below
    infos = {**{n: i for n, i in shards.items() if n not in whole},
             **{n: ShardInfo(t, t.shape, 0, num_rows(t.shape), ()) for n, t in whole.items()}}
    report = _agree(lambda: load_view(path, view, infos, optim, scheduler, strict=False, restore_rng=False),
                    group, world)
    with torch.no_grad():
        for name in own & set(whole):
            info = shards[name]
            row_view(info.param, info, info.row_start, info.row_end).copy_(
                row_view(whole[name], infos[name], info.row_start, info.row_end))
    for param_group, values in zip(optim.param_groups if optim is not None else (), settings or ()):
        param_group.update(values)
    report.unexpected, report.closest = [], {}  # the other stages' names, loaded by their ranks
    report.problems = []  # each stage's own param groups are part of the saved union, checked above
    report.notes.append("a pipeline stage: this rank loaded its stage's names; RNG states are not restored")
    return report


def save_pipeline(path, trainer, scheduler=None, **extra) -> Path:
    """`save_stages` for a `PipeTrainer` with sharded stages (PipelineConfig(strategy=...)): the whole model,
    the frozen prefix included, and how many layers are frozen (Note [the frozen prefix in a checkpoint])."""
    _check_trainer(trainer)
    if PIPELINE_KEY in extra:
        raise ShardwiseError(f"{PIPELINE_KEY}= is the pipeline's own record in its checkpoints: pass your value "
                             "under another keyword")
    stage, whole = trainer.layout.coords(trainer.rank)[1], frozen_prefix(trainer)
    held = all_gather_object(sorted(trainer._local_names.values()), trainer.group, trainer.world_size)
    missing = sorted(set(trainer.chain.params) - set(whole) - {name for names in held for name in names})
    if missing:  # the same on every rank: a checkpoint of part of the model is never written
        raise ShardwiseError(f"internal: the pipeline's stages and frozen prefix do not hold {missing[:4]}: the "
                             "checkpoint would miss them, so nothing was written")
    return save_stages(path, trainer.stage_module, trainer.optimizer, names=trainer._local_names, stage=stage,
                       group=trainer.group, scheduler=scheduler, whole=whole, **{PIPELINE_KEY: run_record(trainer)},
                       **extra)


def load_pipeline(path, trainer, scheduler=None) -> LoadReport:
    """`load_stages` for a `PipeTrainer` with sharded stages, optimizer state included; a checkpoint saved
    with a frozen prefix freezes the same layers first, and one whose run drew other batches than this
    trainer's sampler is refused (Notes [the frozen prefix in a checkpoint], [data order across world sizes]
    in resume.py)."""
    _check_trainer(trainer)
    group, world = trainer.group, trainer.world_size
    num_frozen = _agree(lambda: check_resume(path, trainer), group, world)
    if num_frozen > trainer.layout.num_frozen:
        trainer.freeze(num_frozen)
    return load_stages(path, trainer.stage_module, trainer.optimizer, names=trainer._local_names,
                       group=group, scheduler=scheduler, whole=frozen_prefix(trainer))


def _check_one_value_per_name(mine: list[tuple[str, nn.Parameter]], group, world: int) -> None:
    """Note [one value per name]: a name several stages hold is one tied weight (Note [ties across stages]),
    written once and loaded into each; two stages calling different parameters by one name would lose one at
    the save and give both the other's values at the load. Every rank's full shape and dtype of each name
    must agree, and where two ranks hold the same rows of a name (a tie's stages, or replicas) a crc32 of
    those rows' bytes must too; anything else is refused, before anything is written or loaded."""
    info = shard_info(_named_view(mine))
    layout = {n: [list(i.full_shape), str(i.param.dtype).removeprefix("torch."), i.row_start, i.row_end]
              for n, i in info.items()}
    everyone = all_gather_object(layout, group, world)
    holders: dict[tuple, list[int]] = {}
    differ: dict[str, str] = {}
    for rank, entries in enumerate(everyone):
        for name, (shape, dtype, lo, hi) in entries.items():
            holders.setdefault((name, lo, hi), []).append(rank)
            first = next(r for r, e in enumerate(everyone) if name in e)
            if [shape, dtype] != everyone[first][name][:2]:
                differ.setdefault(name, f"ranks {first} and {rank}: {everyone[first][name][1]} "
                                        f"{tuple(everyone[first][name][0])} against {dtype} {tuple(shape)}")
    twice = sorted({name for (name, lo, hi), ranks in holders.items() if len(ranks) > 1 and hi > lo} - set(differ))
    if twice:
        crcs = all_gather_object({n: crc32(info[n].rows.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
                                  for n in twice if n in info}, group, world)
        for (name, _, _), ranks in sorted(holders.items()):
            other = next((r for r in ranks if name in twice and crcs[r][name] != crcs[ranks[0]][name]), None)
            if other is not None:
                differ.setdefault(name, f"ranks {ranks[0]} and {other}: other values")
    if differ:
        which = "; ".join(f"{name!r}, {how}" for name, how in sorted(differ.items()))
        raise ShardwiseError(f"several stages hold different tensors under one model name ({which}): a name held "
                             "by several stages is one "
                             "tied weight, saved once and loaded into each, so one of them would be lost. Give each "
                             "stage's parameters their own names in the whole model (names=, as shard_stage returns "
                             "them), or tie them as one parameter (Note [one value per name])")


def _agree(run, group, world: int):
    """`run()` on this rank, then one agreement over `group`: a ShardwiseError on every rank if it failed
    on any (a stage-local refusal must not leave the other stages waiting in the next collective)."""
    result, error = None, None
    try:
        result = run()
    except ShardwiseError as exc:
        error = str(exc)
    failed = [(rank, e) for rank, e in enumerate(all_gather_object(error, group, world)) if e is not None]
    if failed:
        raise ShardwiseError(failed[0][1] if error is None else error)
    return result


def _check_trainer(trainer) -> None:
    if trainer.config.strategy is None:
        raise ShardwiseError("pipeline checkpoints need sharded stages: build the PipeTrainer with "
                             "PipelineConfig(strategy='zero1', 'zero2' or 'zero3'). A strategy=None trainer has no "
                             "checkpoint of its own: trainer.full_parameters() brings every layer of the model it "
                             "was built from up to date on every rank, and sw.save(path, model) then saves its "
                             "parameters (no optimizer state)")


def _check_stage(module: nn.Module, optim, names: dict[str, str], what: str) -> None:
    engine = engine_of(module)
    if engine is None or engine.strategy not in STRATEGIES:
        raise ShardwiseError(f"pipeline checkpoints {what} a stage module sharded by sw.shard(module, "
                             "strategy='zero1', 'zero2' or 'zero3'); shard the stage first")
    unnamed = [n for n, _ in module.named_parameters() if n not in names]
    if unnamed:
        raise ShardwiseError(f"names= has no model name for the stage's parameters {unnamed[:4]}: pass every "
                             "parameter's name in the whole model (shard_stage returns them)")
    buffers = sorted(persistent_buffers(module))
    if buffers:
        raise ShardwiseError(f"this stage has persistent buffers {buffers[:4]}: pipeline checkpoints hold "
                             "parameters and optimizer state only. Register them with persistent=False (and "
                             "recompute them), or save the stage's buffers yourself")
    if optim is not None and any(isinstance(g.get("params"), dict) for g in optim.param_groups):
        raise ShardwiseError("a stage's optimizer must be one torch optimizer over the stage's parameters")


def _whole_infos(whole: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, ShardInfo]:
    """Rows of the whole tensors every rank holds alike: each rank writes an equal split of them."""
    return {n: ShardInfo(t, t.shape, 0, num_rows(t.shape), (), _SplitRows(*row_range(num_rows(t.shape), world, rank)))
            for n, t in whole.items()}


class _SplitRows:
    """The mesh of a whole tensor every rank of a save holds (ranks.rows_to_write asks it): this rank writes
    its equal part, so the rows are written once."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi

    def rows_to_write(self, lo: int, hi: int) -> tuple[int, int]:
        return self.lo, self.hi


def _named_view(named: list[tuple[str, nn.Parameter]]) -> nn.Module:
    """A module holding `named`'s parameters (this rank's shards) under their model names."""
    root = nn.Module()
    for name, param in named:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if part not in module._modules:
                try:
                    module.add_module(part, nn.Module())
                except KeyError as error:
                    raise ShardwiseError(f"parameter name {name!r} cannot be a module path ({error})") from None
            module = module._modules[part]
        module.register_parameter(leaf, param)
    return root


def _without(optim, kept: set[int]):
    """A shallow copy of `optim` whose param groups hold only the parameters in `kept` (its state shared)."""
    view = copy.copy(optim)
    view.param_groups = [{**group, "params": [p for p in group["params"] if id(p) in kept]}
                         for group in optim.param_groups]
    return view


def _describe(named: list[tuple[str, nn.Parameter]], optim, whole: dict[str, torch.Tensor]) -> dict:
    """This rank's part of the union (JSON): each name's full shape, dtype and requires_grad (the whole
    frozen prefix's too); each optimizer param group's names and settings."""
    by_id = {id(p): n for n, p in named}
    info = shard_info(_named_view(named))
    params = {n: [list(i.full_shape), str(i.param.dtype).removeprefix("torch."), bool(i.param.requires_grad)]
              for n, i in info.items()}
    params.update({n: [list(t.shape), str(t.dtype).removeprefix("torch."), False] for n, t in whole.items()})
    groups = None
    if optim is not None:
        groups = [{"params": [by_id[id(p)] for p in held_params(g) if id(p) in by_id],
                   "options": to_json({k: v for k, v in g.items() if k != "params"}, f"optimizer param group {i}")}
                  for i, g in enumerate(optim.param_groups)]
    return {"params": params, "groups": groups}


def _union(parts: list[dict]) -> dict:
    """Every rank's names and param groups as one model's: disjoint names (a tie once); a group of one
    stage and a group of another with the same settings are one group (a stage whose layers have no
    biases has no group for them: grouped_adamw leaves empty groups out). The groups' order is that of
    the rank with the most groups (a flat model's optimizer then lists them in the same order)."""
    params, groups = {}, []
    described = [part["groups"] for part in parts if part["groups"] is not None]
    for stage_groups in sorted(described, key=len, reverse=True):  # stable: the first rank with the most
        for group in stage_groups:
            union = next((u for u in groups if u["options"] == group["options"]), None)
            if union is None:
                groups.append(union := {"params": [], "options": group["options"]})
            union["params"] += [n for n in group["params"] if n not in union["params"]]
    for part in parts:
        params.update(part["params"])
    return {"params": params, "groups": groups if described else None}


def _fill_union(job, union: dict) -> None:
    """Rank 0's index describes every stage (Note [stage checkpoints]): the other stages' names as
    placeholders that write no rows here, and each optimizer's param groups over all of them."""
    mesh = next((info.mesh for info in job.infos.values()), None)
    for name, (shape, dtype, requires_grad) in union["params"].items():
        if name in job.infos:
            continue
        placeholder = torch.empty(shape, dtype=getattr(torch, dtype), device="meta").requires_grad_(requires_grad)
        job.infos[name] = ShardInfo(placeholder, torch.Size(shape), 0, 0, (), mesh)
    for plan in job.plans:
        plan["groups"] = union["groups"]


def _check_union(path, union: dict, mine: list[list[str]] | None) -> list[dict] | None:
    """Refuse, before any rank loads, a checkpoint that does not fit the stages together: names missing,
    unexpected or of another shape against the union of the stages' names; with an optimizer (`mine`: this
    rank's param groups by name), no optimizer state, or a group of this rank's whose parameters the saved
    optimizer has in several groups. Returns the saved settings of each of this rank's groups."""
    source = open_source(path, lambda name: name)
    try:
        report = LoadReport(source.description)
        match(source, {n: (tuple(shape), [n]) for n, (shape, _, _) in union["params"].items()}, report)
        if report.missing or report.unexpected or report.mismatched:
            raise ShardwiseError(f"{report}\nthe checkpoint does not hold this pipeline's model: its names and shapes "
                                 "differ from the union of the stages' (load it into the model it was saved from, "
                                 "or pass each stage's names as the whole model calls them)")
        if mine is None:
            return None
        saved = source.optimizers
        if not saved:
            raise ShardwiseError(f"{source.description} holds no optimizer state (saved without optim=): load the "
                                 "model alone (load_stages(path, module, None, names=...)) and start the optimizer "
                                 "fresh")
        if len(saved) != 1:
            raise ShardwiseError(f"{source.description} holds {len(saved)} optimizer states; a pipeline's stages "
                                 "load one (saved with optim= one optimizer; load the model alone with optim=None)")
        settings = []
        for index, names in enumerate(mine):
            found = {j for j, group in enumerate(saved[0].groups) for n in names if n in group.params}
            if len(found) > 1 or names and not found:
                raise ShardwiseError(f"{source.description}: this stage's optimizer param group {index} holds "
                                     f"parameters the saved optimizer has in {len(found) or 'no'} groups: build each "
                                     "stage's optimizer with the factory the checkpoint was saved with")
            settings.append(saved[0].groups[found.pop()].options if found else None)
        return settings
    finally:
        source.close()


def _decode_settings(optim, saved: list[dict | None], where: str) -> list[dict]:
    """Each of `optim`'s groups' saved settings (those of the saved group that holds its parameters: sw.load
    pairs groups by position, which a stage's fewer groups do not follow), decoded and checked against the
    current ones; applied after the load."""
    out = []
    for index, (group, options) in enumerate(zip(optim.param_groups, saved)):
        settings = {}
        for key, value in (options or {}).items():
            what = f"{where}: optimizer param group {index}'s {key!r}"
            decoded = from_json(value, where=what)
            check_like(decoded, group.get(key), what)
            settings[key] = like_current(decoded, group.get(key))
        out.append(settings)
    return out

"""`sw.load`: match names, check, then read each rank's rows into the model, its optimizer
state, scheduler, stateful objects and RNGs (save.py's docstring has the format)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardwise.checkpoint.names import Rename, clean_name, make_renamer, persistent_buffers
from shardwise.checkpoint.optim_state import optimizer_names
from shardwise.checkpoint.ranks import all_gather_object, group_of
from shardwise.checkpoint.report import LoadReport, match
from shardwise.checkpoint.sources import CheckpointDir, Source, open_source
from shardwise.checkpoint.values import from_json, like_current, restore_rng
from shardwise.engine.info import row_view, shard_info
from shardwise.errors import ShardwiseError


def load(path, model: nn.Module, optim: torch.optim.Optimizer | None = None, scheduler=None, *,
         strict: bool = True, rename: Rename = None, restore_rng: bool | None = None,
         **objects) -> LoadReport:
    """Load a checkpoint into `model` (and `optim`, `scheduler`) in place; every rank calls it.

    `path` is a checkpoint directory, a single `.safetensors` file (an export, a hub
    model) or a `torch.save`d state dict (read with `weights_only=True`). Any strategy
    and world size loads any checkpoint: each rank reads only the rows it holds.
    Names are matched after stripping wrapper prefixes (`module.`, `_orig_mod.`,
    `_fsdp_wrapped_module.`) on both sides and applying `rename` to the checkpoint's
    names (a dict of exact names, or a list of `(regex, replacement)` pairs).

    `strict=True` raises a ShardwiseError carrying the report when anything is missing,
    unexpected or shaped differently, before changing anything; `strict=False` loads
    what matches (fine-tuning a new head) and returns the report (`print(report)`).
    RNG states are restored when resuming (`optim` given, same world size) unless
    `restore_rng` says otherwise. Objects passed as keywords (`sampler=...`) get the
    state saved under the same keyword.
    """
    slicing = getattr(model, "_sw_slicing", None)  # sliced by sw.slice: load whole tensors (Note [unsliced view])
    if slicing is not None:
        view = slicing.checkpoint_view(model, optim, fill=False)
        report = load(path, view.model, view.optim, scheduler, strict=strict, rename=rename,
                      restore_rng=restore_rng, **objects)
        view.write_back()
        return report
    group, rank, world = group_of(model)
    source, report, error = None, None, None
    try:
        source = open_source(path, make_renamer(rename))
        report = _load_into(LoadJob(source, model, optim, scheduler, objects, strict, restore_rng, rank, world))
    except Exception as exc:  # noqa: BLE001 - every rank must reach the agreement below
        error = exc
    finally:
        if source is not None:
            source.close()
    # One agreement point: a rank that found a corrupt file makes every rank raise, none hangs.
    messages = all_gather_object(None if error is None else str(error), group, world)
    if error is not None:
        raise error
    failed = [(r, message) for r, message in enumerate(messages) if message is not None]
    if failed:
        raise ShardwiseError(f"rank {failed[0][0]} could not load {path}: {failed[0][1]}")
    return report


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


def _load_into(job: LoadJob) -> LoadReport:
    """Load `job.source` into the model (and the rest) on this rank; strict refusals happen before any write."""
    source, model, optim, scheduler, objects = job.source, job.model, job.optim, job.scheduler, job.objects
    infos = {clean_name(raw): info for raw, info in shard_info(model).items()}
    buffers = persistent_buffers(model)
    report = LoadReport(source.description, extra=dict(source.extra))
    targets = {name: (tuple(info.full_shape), [name, *map(clean_name, info.aliases)])
               for name, info in infos.items()}
    for name, buffer in buffers.items():
        targets.setdefault(name, (tuple(buffer.shape), [name]))
    pairs = match(source, targets, report)
    if optim is not None:
        _check_optimizer(source, optim, infos, pairs, report)
    if scheduler is not None and source.scheduler is None:
        report.problems.append("the checkpoint holds no scheduler state (it was saved without scheduler=)")
    object_states = {}
    for key in objects:
        if key not in source.objects:
            report.problems.append(f"the checkpoint holds no state for {key}= (pass it to sw.save as well)")
            continue
        try:
            object_states[key] = source.object_state(key, objects[key], job.rank, job.world)
        except ShardwiseError as error:
            report.problems.append(str(error))
    if job.strict and not report.ok:
        raise ShardwiseError(f"{report}\nstrict=True refuses a partial load: fix the names (rename=...), or pass "
                             "strict=False to load what matches (fine-tuning a changed head).")
    rows = {name: (infos[name].row_start, infos[name].row_end) if name in infos else
            (0, buffers[name].shape[0] if buffers[name].dim() else 1) for name in pairs}
    if isinstance(source, CheckpointDir):
        source.prepare([(pairs[name], *rows[name]) for name in pairs])
    with torch.no_grad():
        for name, tensor in pairs.items():
            if name in infos:
                info = infos[name]
                _read_into(tensor, *rows[name], row_view(info.param, info, *rows[name]))
            else:
                buffer = buffers[name]
                _read_into(tensor, *rows[name], buffer.reshape(-1) if buffer.dim() == 0 else buffer)
            report.loaded.append(name)
        if optim is not None and source.optimizer is not None:
            _load_optimizer(source, optim, infos, pairs)
    if scheduler is not None and source.scheduler is not None:
        scheduler.load_state_dict(from_json(source.scheduler))
    for key, state in object_states.items():
        objects[key].load_state_dict(from_json(state))
    wanted = optim is not None if job.restore_rng is None else job.restore_rng
    _maybe_restore_rng(source, report, wanted, job.rank, job.world)
    return report


def _read_into(tensor, lo: int, hi: int, dest: torch.Tensor) -> None:
    """Rows lo:hi of a source tensor into `dest` (a view of a parameter, buffer or state)."""
    direct = dest if dest.device.type == "cpu" and dest.is_contiguous() else None
    rows = tensor.read(lo, hi, direct)
    if rows is dest:
        # pread wrote the memory behind autograd's back: bump the version counter, which is
        # how zero1/zero2 notice that their full parameters must be re-gathered.
        torch.autograd.graph.increment_version(dest)
    else:
        dest.copy_(rows.reshape(dest.shape))


def _check_optimizer(source: Source, optim, infos, pairs, report: LoadReport) -> None:
    saved = source.optimizer
    if saved is None:
        report.problems.append("the checkpoint holds no optimizer state (it was saved without optim=)")
        return
    if saved["class"] != type(optim).__name__:
        report.problems.append(f"the optimizer state was saved from {saved['class']}, not {type(optim).__name__}")
    names = optimizer_names(optim, infos)
    if len(saved["param_groups"]) != len(optim.param_groups):
        report.problems.append(f"the checkpoint has {len(saved['param_groups'])} optimizer param groups, the "
                               f"optimizer {len(optim.param_groups)}; their settings were not loaded")
        return
    for index, (then, now) in enumerate(zip(saved["param_groups"], optim.param_groups)):
        current = {pairs[n].name if n in pairs else n for n in (names[id(p)] for p in now["params"])}
        if set(then["params"]) != current:
            differ = sorted(set(then["params"]) ^ current)
            report.problems.append(f"optimizer param group {index} holds different parameters in the checkpoint "
                                   f"and in the optimizer (differing: {differ[:4]}{'...' if len(differ) > 4 else ''})")


def _load_optimizer(source: Source, optim, infos, pairs) -> None:
    """Param group settings, then each param's state: scalars from JSON, rows from files."""
    saved = source.optimizer
    names = optimizer_names(optim, infos)
    same_groups = len(saved["param_groups"]) == len(optim.param_groups)
    for index, group in enumerate(optim.param_groups):
        if same_groups:
            for key, value in saved["param_groups"][index]["options"].items():
                group[key] = like_current(from_json(value), group.get(key))
        on_device = bool(group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            name = names[id(param)]
            saved_state = saved["state"].get(pairs[name].name) if name in pairs else None
            if saved_state is None:
                optim.state.pop(param, None)  # no state in the checkpoint: as a fresh optimizer
                continue
            info = infos[name]
            device = param.device if on_device else "cpu"
            new = {key: from_json(value, device) for key, value in saved_state["scalars"].items()}
            for key in saved_state["tensors"]:
                tensor = source.optimizer_tensor(pairs[name].name, key)
                floating = tensor.dtype.is_floating_point and param.dtype.is_floating_point
                buffer = torch.zeros(param.shape, dtype=param.dtype if floating else tensor.dtype, device=param.device)
                _read_into(tensor, info.row_start, info.row_end, row_view(buffer, info, info.row_start, info.row_end))
                new[key] = buffer
            optim.state[param] = new


def _maybe_restore_rng(source: Source, report: LoadReport, wanted: bool, rank: int, world: int) -> None:
    if not wanted:
        return
    if source.world_size != world:
        report.notes.append("RNG states not restored: " + (
            "the source holds none" if source.world_size is None else
            f"saved by {source.world_size} ranks, loading on {world} (each rank's stream belongs to its rank)"))
        return
    saved = source.rng_of(rank)
    if saved is None:
        report.notes.append("RNG states not restored: the checkpoint holds none for this rank")
        return
    restore_rng(*saved)
    report.rng_restored = True

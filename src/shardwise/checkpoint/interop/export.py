"""`sw.export`: one plain `model.safetensors` that loads without shardwise (`sw.save_pretrained`, a Hugging
Face directory, is in hf_save.py)."""

from __future__ import annotations

import os
import uuid
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from shardwise.checkpoint.format.files import TensorSpec
from shardwise.checkpoint.format.model_config import held_config, model_config, prepare_config, write_config
from shardwise.checkpoint.format.names import clean_name, persistent_buffers
from shardwise.checkpoint.format.ranks import broadcast_object, group_of, is_sharded
from shardwise.checkpoint.write.writer import FileWriter
from shardwise.engine.layout.rows import num_rows
from shardwise.engine.protocol import slicing_of
from shardwise.engine.unit.info import ShardInfo, shard_info
from shardwise.errors import ShardwiseError


def export(model: nn.Module, path, *, duplicate_tied: bool = False, replace_config: bool = False) -> Path:
    """Write the model's full parameters and buffers to one plain `model.safetensors`; every rank calls it.

    Streams one parameter at a time (a sharded model gathers each to rank 0, writes it
    and frees it), so no rank ever holds the whole model. The file loads without
    shardwise: `safetensors.torch.load_model(model, path)`, or
    `model.load_state_dict(safetensors.torch.load_file(path), strict=False)`. A tied
    weight is stored once, under its first name; the file's metadata maps each other
    name to it (safetensors' own convention), and loading into a model that ties them
    re-ties them. `duplicate_tied=True` stores every name (the tied bytes once per
    name), for a plain strict `load_state_dict`. A Hugging Face model's `config.json` is written
    beside `path` too (export to `DIR/model.safetensors` and `from_pretrained(DIR)` loads it), after
    its layer count and hidden size are checked against the tensors, without code references
    (`auto_map`), and never over a different config.json unless `replace_config=True` (Note [model
    config]); a model that only holds a Hugging Face model (a PeftModel, a wrapper) gets none, with a
    warning. Returns `path`.
    """
    slicing = slicing_of(model)  # sliced by sw.slice: whole tensors (Note [unsliced view])
    if slicing is not None:
        model = slicing.checkpoint_view(model).model
    group, rank, world = group_of(model)
    path = Path(path).absolute()
    sharded = is_sharded(model)
    specs, producers, metadata = [], [], {"format": "pt"}
    for raw, info in shard_info(model).items():
        name = clean_name(raw)
        produce = (lambda info=info: _gather_full(info, rank)) if sharded else \
            (lambda info=info: info.param)
        names = [name] + [clean_name(a) for a in info.aliases]
        for alias in names[1:] if not duplicate_tied else ():
            metadata[alias] = name
        for spec_name in names if duplicate_tied else names[:1]:
            specs.append(TensorSpec(spec_name, info.param.dtype, tuple(info.full_shape)))
            producers.append(produce)
    for name, buffer in persistent_buffers(model).items():
        specs.append(TensorSpec(name, buffer.dtype, tuple(buffer.shape)))
        producers.append(lambda buffer=buffer: buffer)
    partial = partial_name(path)
    writer, error, config = None, None, None
    if rank == 0:
        try:
            _warn_held_config(model)
            shapes = {spec.key: spec.shape for spec in specs}
            config, dropped = prepare_config(model_config(model), shapes, path.parent, replace=replace_config,
                                             where=f"{type(model).__name__}.config",
                                             aliases={k: v for k, v in metadata.items() if k != "format"})
            if dropped:
                warnings.warn(f"sw.export: {path.parent / 'config.json'} is written without {', '.join(dropped)} "
                              "(code references: Note [model config])", stacklevel=2)
            path.parent.mkdir(parents=True, exist_ok=True)
            writer = FileWriter(partial, specs, metadata)
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"
    for produce in producers:
        if not sharded and rank != 0:
            continue
        value = produce()  # a collective for a sharded model: every rank runs every one
        if writer is not None and error is None:
            try:
                writer.write_next(value)
            except Exception as exc:  # noqa: BLE001 - keep joining the gathers, report after
                error = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        try:
            if error is None:
                writer.close()
                os.replace(partial, path)
                if config is not None:
                    write_config(config, path.parent)
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"
        if error is not None:
            if writer is not None:
                writer.abort()
            partial.unlink(missing_ok=True)
    error = broadcast_object(error, group, rank, world)
    if error is not None:
        raise ShardwiseError(f"exporting to {path} failed: {error}")
    return path


def _warn_held_config(model: nn.Module) -> None:
    """Say why an export of a model holding a Hugging Face model writes no config.json (Note [model config])."""
    why = held_config(model)
    if why is not None:
        warnings.warn(f"sw.export: no config.json written: {type(model).__name__} {why}, which from_pretrained "
                      "would not load. Export the Hugging Face model itself (a PeftModel: merge_and_unload() first) "
                      "for a from_pretrained directory", stacklevel=3)


def partial_name(path: Path) -> Path:
    """Where an export to `path` is written until it is whole: a fresh hidden name beside it, created
    with O_EXCL | O_NOFOLLOW (FileWriter), so nothing planted in a shared directory is written through;
    the finished file then replaces `path` in one rename (a symlink at `path` is replaced, not followed)."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.partial")


# Note [sent tensors stay referenced]: gloo's worker thread may drop the last reference to a
# finished gather's input after `gather` returned. If Python had already dropped its own, that
# frees the Python object from the worker thread, which needs the GIL: at interpreter exit
# (a script ending with sys.exit(0) after sw.full_state_dict) the thread cannot take it and the
# process aborts ("terminate called without an active exception", exit -6, seen in a core dump).
# The inputs (aliases of the shards: no copy) are kept until the next full_state_dict call.
_SENT: list[torch.Tensor] = []


def _gather_full(info: ShardInfo, rank: int) -> torch.Tensor | None:
    """The full value of one sharded parameter on rank 0 of the model's group (None elsewhere): a collective."""
    rows = num_rows(info.full_shape)
    # Rows are chunked over the shard group (the whole group of a flat layout): each replica gathers its
    # own, and only the model group's rank 0, shard rank 0 of replica 0, keeps the result (Note [mesh info]).
    group, world, shard_rank = info.mesh.shard_group, info.mesh.shard_world, info.mesh.shard_rank
    if rows == 0:
        return torch.empty(info.full_shape, dtype=info.param.dtype)
    shard = info.param.detach().contiguous()
    _SENT.append(shard)  # Note [sent tensors stay referenced]
    per_rank = shard.shape[0]
    full = torch.empty((world * per_rank, *shard.shape[1:]), dtype=shard.dtype, device=shard.device) \
        if shard_rank == 0 else None
    parts = [full[i * per_rank : (i + 1) * per_rank] for i in range(world)] if shard_rank == 0 else None
    torch.distributed.gather(shard, parts, dst=torch.distributed.get_global_rank(group, 0), group=group)
    if rank != 0:
        return None
    return full[:rows].reshape(info.full_shape)


def full_state_dict(model: nn.Module, *, rank0_only: bool = True,
                    only: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict with plain full tensors, as an unsharded model's `state_dict()`
    gives it (every name of a tied weight, persistent buffers); every rank calls it.

    A sharded model's parameters are gathered one at a time to rank 0 (Note [state dict]);
    other ranks get an empty dict unless `rank0_only=False`, which gives every rank the
    whole state (one all-gather per parameter). `only(name)` keeps the parameters it is true
    for (and no buffers): a PEFT model's adapters, without gathering its base."""
    _SENT.clear()  # the previous call's gathers finished long ago
    slicing = slicing_of(model)  # sliced by sw.slice: whole tensors (Note [unsliced view])
    if slicing is not None:
        model = slicing.checkpoint_view(model).model
    group, rank, world = group_of(model)
    sharded = is_sharded(model)
    out: dict[str, torch.Tensor] = {}
    for raw, info in shard_info(model).items():
        if only is not None and not only(raw):
            continue
        if not sharded:
            value = info.param.detach()
        elif rank0_only:
            value = _gather_full(info, rank)
        else:
            value = _all_gather_full(info)
        if value is not None:
            for name in (raw, *info.aliases):
                out[clean_name(name)] = value
    if (rank == 0 or not rank0_only) and only is None:
        for name, buffer in persistent_buffers(model).items():
            out[name] = buffer.detach()
    return out


def _all_gather_full(info: ShardInfo) -> torch.Tensor:
    group, world = info.mesh.shard_group, info.mesh.shard_world  # the rows' own group (Note [mesh info])
    shard = info.param.detach().contiguous()
    gathered = torch.empty((world * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    torch.distributed.all_gather_single(gathered, shard, group=group)
    rows = num_rows(info.full_shape)
    return gathered[:rows].reshape(info.full_shape)

"""Who writes and reads which rows, and the small object collectives a save or load needs."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from shardwise.engine.info import ShardInfo, engine_of, unit_of_any_param


def group_of(model: nn.Module):
    """(group, rank, world_size) of the model's collectives; (None, 0, 1) without a process group."""
    if not dist.is_initialized():
        return None, 0, 1
    engine = engine_of(model)
    part = unit_of_any_param(model) if engine is None else None  # a submodule of a sharded model
    group = engine.group if engine is not None else part.mesh.group if part is not None else dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def is_sharded(model: nn.Module) -> bool:
    """True when each rank holds only its own rows (zero strategies); ddp and plain models replicate."""
    engine = engine_of(model)
    if engine is None:
        return unit_of_any_param(model) is not None  # a submodule of a zero-sharded model
    return engine.shards_rows


def gather_object(obj, group, rank: int, world: int) -> list | None:
    """Every rank's `obj` on rank 0 (None elsewhere); no collective when alone."""
    if group is None or world == 1:
        return [obj]
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(group, 0), group=group)
    return out


def broadcast_object(obj, group, rank: int, world: int):
    """Rank 0's `obj` on every rank."""
    if group is None or world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def all_gather_object(obj, group, world: int) -> list:
    if group is None or world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def rows_to_write(info: ShardInfo, rank: int, world: int, sharded: bool) -> tuple[int, int]:
    """Rows of the full tensor this rank writes: its own shard (once per mesh: the mesh's answer, Note
    [mesh info]), or an equal split of a replica."""
    if sharded:
        return info.mesh.rows_to_write(info.row_start, info.row_end)
    rows = info.full_shape[0] if len(info.full_shape) else 1
    per_rank = -(-rows // world)
    start = min(rank * per_rank, rows)
    return start, min(start + per_rank, rows)

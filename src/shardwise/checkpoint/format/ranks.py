"""Who writes and reads which rows, and the small JSON collectives a save or load needs (never pickle:
Note [no pickle on the wire] in wire/messages.py)."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from shardwise.engine.layout.rows import num_rows, row_range
from shardwise.engine.unit.info import ShardInfo, engine_of, unit_of_any_param
from shardwise.wire.messages import all_gather_json, broadcast_json, gather_json


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
    """Every rank's `obj` (JSON: Note [no pickle on the wire]) on rank 0 (None elsewhere); no collective alone."""
    if group is None or world == 1:
        return [obj]
    return gather_json(obj, group)


def broadcast_object(obj, group, rank: int, world: int):
    """Rank 0's `obj` (JSON) on every rank."""
    if group is None or world == 1:
        return obj
    return broadcast_json(obj, group)


def all_gather_object(obj, group, world: int) -> list:
    """Every rank's `obj` (JSON) on every rank."""
    if group is None or world == 1:
        return [obj]
    return all_gather_json(obj, group)


def rows_to_write(info: ShardInfo, rank: int, world: int, sharded: bool) -> tuple[int, int]:
    """Rows of the full tensor this rank writes: its own shard (once per mesh: the mesh's answer, Note
    [mesh info]), or an equal split of a replica."""
    if sharded:
        return info.mesh.rows_to_write(info.row_start, info.row_end)
    return row_range(num_rows(info.full_shape), world, rank)

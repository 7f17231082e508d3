"""Where one owned parameter lives in its unit's flat buffers: dim-0 chunks, padded per rank.
Uses: parallel_layout, rows, units.

A parameter of `rows` rows (a 0-D scalar counts as one) is cut into chunks of
`rows_per_rank = ceil(rows / shard_world)` rows (the mesh's answer: Note [mesh info]); shard rank r's
chunk sits at `offset` in that rank's shard segment, and the full padded value at
`shard_world * offset` in the full buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardwise.engine.layout.parallel_layout import ParallelLayout
from shardwise.engine.layout.rows import num_rows
from shardwise.engine.layout.rows import row_numel as row_numel_of
from shardwise.engine.unit.units import OwnedParam


@dataclass
class ParamLayout:
    """Where one owned parameter lives in the unit's flat buffers."""

    owned: OwnedParam
    shape: torch.Size  # the full shape users see
    rows: int  # dim-0 rows of the full value (1 for a 0-D scalar)
    row_numel: int  # elements per row
    rows_per_rank: int  # c: rows each rank holds, padding included
    offset: int  # start in one rank's shard segment
    # Derived once here, not per read: the hot path reads them for every parameter of every gather, reduce and
    # hand-out (a property was 600 Python calls a step on make demo's GPT: bench/overhead/step_counts.py).
    shard_numel: int = field(init=False)  # elements each rank holds, padding included
    shard_shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.shard_numel = self.rows_per_rank * self.row_numel
        self.shard_shape = (self.rows_per_rank, *self.shape[1:]) if len(self.shape) else (self.rows_per_rank,)


def lay_out(owned: list[OwnedParam], mesh: ParallelLayout) -> tuple[list[ParamLayout], int]:
    layouts, offset = [], 0
    for entry in owned:
        shape = entry.param.shape
        rows, row_numel = num_rows(shape), row_numel_of(shape)
        rows_per_rank = mesh.rows_per_rank(rows)
        layouts.append(ParamLayout(entry, shape, rows, row_numel, rows_per_rank, offset))
        offset += rows_per_rank * row_numel
    return layouts, offset

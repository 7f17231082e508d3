"""Which rows of a tensor each rank holds: the one place the row arithmetic is written.
Uses: nothing of the engine.

Note [rows]: a tensor is cut along dim 0 into `world` equal chunks of `ceil(rows / world)` rows,
rank r holding rows `r * per_rank : (r + 1) * per_rank` of the real ones (the last ranks hold zero
padding, or nothing real at all). A 0-D tensor counts as one row (`num_rows`), so a scalar is a
one-row chunk on rank 0 and padding elsewhere. The engine's units (param_layout.py), `shard_info`,
checkpoint row ranges, the estimator, `describe`, slicing's traffic model and the owner steps all
come from these functions, through the layout (parallel_layout.py) where a layout exists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def num_rows(shape: Sequence[int]) -> int:
    """Rows of a tensor of `shape`: its first dimension, 1 for a 0-D tensor (Note [rows])."""
    return shape[0] if len(shape) else 1


def row_numel(shape: Sequence[int]) -> int:
    """Elements in one row of a tensor of `shape` (1 for a 0-D or 1-D tensor)."""
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def rows_per_rank(rows: int, world: int) -> int:
    """Rows each of `world` ranks holds of a tensor of `rows` rows, padding included."""
    return math.ceil(rows / world)


def row_range(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The real rows `lo:hi` that `rank` of `world` holds of a tensor of `rows` rows (Note [rows])."""
    per_rank = rows_per_rank(rows, world)
    start = min(rank * per_rank, rows)
    return start, min(start + per_rank, rows)


def shard_numel(shape: Sequence[int], world: int) -> int:
    """Elements of one rank's chunk of a tensor of `shape` over `world` ranks, padding included."""
    return rows_per_rank(num_rows(shape), world) * row_numel(shape)


def padded_numel(shape: Sequence[int], world: int) -> int:
    """Elements of a tensor of `shape` padded to `world` equal chunks (what a gather fills)."""
    return world * shard_numel(shape, world)

"""`sw.describe(model)`: the unit plan as a table, the same wherever a plan is shown.
Uses: compat, protocol, rows, units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from shardwise.engine.compat import unwrap_compiled
from shardwise.engine.layout.rows import shard_numel
from shardwise.engine.protocol import engine_of
from shardwise.engine.unit.units import UnitSpec, build_units

MIB = 2**20


@dataclass(frozen=True)
class UnitRow:
    """One unit: its path ("" for the root), module class, parameter elements, full bytes,
    bytes per rank (this world size's padded rows), and the shared parameters it owns."""

    path: str
    kind: str
    numel: int
    full_bytes: int
    bytes_per_rank: int
    shared: tuple[str, ...]


@dataclass(frozen=True)
class UnitTable:
    """The rows of `describe`; `print()` shows them as a table."""

    rows: tuple[UnitRow, ...]
    world_size: int
    comm: str = ""  # a sharded model's collectives: strategies, reused buffers and their bound (Note [comm context])
    compression: str = ""  # a sharded model's quantized collectives (config.Compression.label), else ""
    layout: str = ""  # a sharded model's parallel layout, its dimensions' sizes ("replicate 1 x shard 2 x tensor 2")
    placement: str = ""  # offload="host": what lives in host memory and what on the device (Note [host offload])

    def __str__(self) -> str:
        total = sum(row.numel for row in self.rows) or 1
        lines = [f"{'unit':<32} {'module':<20} {'params':>12} {'share':>6} {'full MiB':>10} "
                 f"{'MiB/rank':>10}  shared or tied parameters it owns (world size {self.world_size})"]
        for row in self.rows:
            lines.append(f"{row.path or '<root>':<32} {row.kind:<20} {row.numel:>12,} {row.numel / total:>6.0%} "
                         f"{row.full_bytes / MIB:>10.2f} {row.bytes_per_rank / MIB:>10.2f}  {', '.join(row.shared)}")
        if self.layout:
            lines.append(f"layout: {self.layout}")
        if self.comm:
            lines.append(self.comm)
        if self.placement:
            lines.append(self.placement)
        if self.compression:  # opt-in and not exact: said wherever the plan is shown
            lines.append(f"compressed collectives: {self.compression}")
        return "\n".join(lines)


def describe(model: nn.Module, units: UnitSpec = "auto", world_size: int | None = None) -> UnitTable:
    """The units `shard(model, units=units)` makes (or made, for a sharded model) at `world_size`
    (default: the model's, else 1). Works on a model built under `torch.device("meta")`, and on the
    handle `torch.compile(model)` returns."""
    model = unwrap_compiled(model)
    engine = engine_of(model)
    if engine is not None and engine.shards_rows:
        plans = [(unit.module, unit.path, [layout.owned for layout in unit.layouts]) for unit in engine.units]
        world_size = world_size or engine.mesh.shard_world  # rows are chunked over the shard group
        sizes = {layout.owned.name: (layout.shape, unit.dtype.itemsize) for unit in engine.units
                 for layout in unit.layouts}
    else:
        plans = [(plan.module, plan.path, plan.params) for plan in build_units(model, units)]
        world_size = world_size or 1
        sizes = {owned.name: (owned.param.shape, owned.param.element_size()) for plan in plans for owned in plan[2]}
    rows = []
    for module, path, owned in plans:
        numel = full = per_rank = 0
        for entry in owned:
            shape, itemsize = sizes[entry.name]
            numel += math.prod(shape)
            full += math.prod(shape) * itemsize
            per_rank += shard_numel(shape, world_size) * itemsize
        shared = tuple(entry.name for entry in owned if len(entry.holders) > 1)
        rows.append(UnitRow(path, type(module).__name__, numel, full, per_rank, shared))
    comm = engine.comm.describe() if engine is not None and engine.comm is not None else ""
    compression = engine.compression.label if engine is not None and engine.compression is not None else ""
    layout = ""
    if engine is not None and engine.shards_rows:  # the dimensions beyond the flat 1 x N only when they exist
        dims = {name: size for name, size in engine.mesh.dims().items() if size > 1 or name == "shard"}
        layout = " x ".join(f"{name} {size}" for name, size in dims.items())
    return UnitTable(tuple(rows), world_size, comm, compression, layout, _placement(engine))


def _placement(engine) -> str:
    """offload="host" (Note [host offload]): this rank's master rows in host memory, full values on the device."""
    if engine is None or not engine.shards_rows or not any(unit.storage.host is not None for unit in engine.units):
        return ""
    host = sum(unit.shard_total * unit.dtype.itemsize for unit in engine.units)
    kept = sum(engine.policy.parameter_bytes(unit.numel_full, unit.shard_total, unit.full_flat.element_size(),
                                             unit.dtype.itemsize)[0] for unit in engine.units)
    device = f"{kept / MIB:.2f} MiB of kept full values" if kept else "the full values of the units in use only"
    return (f"offload='host': {host / MIB:.2f} MiB of master rows per rank in host memory, with their gradients and "
            f"the optimizer state (stepped on the CPU); on the device: {device} (sw.estimate counts both)")

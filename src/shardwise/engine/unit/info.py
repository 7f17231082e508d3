"""What a sharded model tells the layers above it: which rows this rank holds, full values.
Uses: compat, host_param, protocol, rows.

Checkpoints, exports and tests reach the engine through these functions only; they work
on an unsharded model too (every rank then holds every row).
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.engine.compat import unwrap_compiled
from shardwise.engine.layout.rows import num_rows
from shardwise.engine.memory.host_param import is_host_shared
from shardwise.engine.protocol import ShardInfo, engine_of, slicing_of
from shardwise.errors import ShardwiseError


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value under its original name, on every rank (a copy).

    For a sharded model this gathers the rows of all ranks, so it is a collective:
    call it on every rank. A sliced model's (`sw.slice`) slices are gathered over its tensor
    group too. Meant for tests and small models; checkpoints stream instead.
    """
    model = unwrap_compiled(model)  # the compiled handle too
    engine = engine_of(model)
    full = engine.full_parameters() if engine is not None else None
    if full is not None:  # the units' parameters; host-shared ones are whole on every rank
        full.update({name: p.detach().clone() for name, p in model.named_parameters() if is_host_shared(p)})
    else:
        full = {name: p.detach().clone() for name, p in model.named_parameters()}
    slicing = slicing_of(model)  # sliced by sw.slice: gather the slices too (a collective)
    return slicing.unslice(model, full) if slicing is not None else full


def shard_info(model: nn.Module) -> dict[str, ShardInfo]:
    """Every distinct parameter's shard on this rank, by its first name (as `named_parameters`).

    Host-shared frozen weights (`frozen="host"`, Note [host copy]) are left out: checkpoints and
    exports hold what the strategy trains; the frozen base is the file every rank maps."""
    model = unwrap_compiled(model)  # the compiled handle too
    if slicing_of(model) is not None:
        raise ShardwiseError("this model is sliced (sw.slice): its parameters hold slices, not rows of the full "
                             "tensors. sw.save, sw.load, sw.export and sw.full_state_dict handle sliced models; "
                             "other tools need sw.full_state_dict(model) first")
    engine = engine_of(model)
    info = engine.shard_info() if engine is not None else None
    if info is not None:
        return info
    if unit_of_any_param(model) is not None:
        return _part_shard_info(model)
    names_by_param = _names_by_param(model)
    info = {}
    for name, param in model.named_parameters():
        if is_host_shared(param):
            continue
        info[name] = ShardInfo(param, param.shape, 0, num_rows(param.shape), tuple(names_by_param[id(param)][1:]))
    return info


def module_paths(model: nn.Module) -> dict[int, list[str]]:
    """Every path of each module of `model`, by id (a module registered twice has two)."""
    paths: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(path)
    return paths


def units_shard_info(units, module_paths: dict[int, list[str]]) -> dict[str, ShardInfo]:
    """`shard_info` of a zero engine's units (flat_unit.FlatUnit), by each parameter's first name;
    its aliases are every other path it is registered under (a module shared under 3 names too)."""
    info = {}
    for unit in units:
        for layout, shard in zip(unit.layouts, unit.shard_params):
            names = [f"{prefix}.{attribute}" if prefix else attribute
                     for module, attribute in layout.owned.holders for prefix in module_paths[id(module)]]
            info[layout.owned.name] = ShardInfo(shard, layout.shape, *unit.mesh.row_range(layout.rows),
                                                tuple(dict.fromkeys(n for n in names if n != layout.owned.name)),
                                                unit.mesh)
    return info


def unit_of_any_param(model: nn.Module):
    """The zero unit holding one of `model`'s parameters when `model` is part of a sharded model
    (a submodule: the Hugging Face model inside a LightningModule), else None."""
    return next((p._sw_unit for p in model.parameters() if getattr(p, "_sw_unit", None) is not None), None)


def _part_shard_info(model: nn.Module) -> dict[str, ShardInfo]:
    """`shard_info` of a submodule of a sharded model, under its own names: each parameter's
    rows come from the unit that holds it (exporting it wrote one rank's rows as whole tensors)."""
    names_by_param = _names_by_param(model)
    info = {}
    for name, param in model.named_parameters():
        unit = param._sw_unit
        layout = next(lay for lay, shard in zip(unit.layouts, unit.shard_params) if shard is param)
        info[name] = ShardInfo(param, layout.shape, *unit.mesh.row_range(layout.rows),
                               tuple(names_by_param[id(param)][1:]), unit.mesh)
    return info


def _names_by_param(model: nn.Module) -> dict[int, list[str]]:
    """Every name each parameter is registered under, in `named_parameters` order, by id."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def as_dtensor(tensor: torch.Tensor, info: ShardInfo, device_type: str):
    """This rank's real rows of `tensor` (the shard, or optimizer state shaped like it) as a
    `Shard(0)` DTensor of the full shape over its shard group (`(Replicate(), Shard(0))` on a 2-D
    mesh: Note [mesh info]), without a copy.

    Note [dcp rows]: the engine's dim-0 chunks are torch.chunk's (ceil(rows / N) rows per
    rank, the last ranks short or empty), which is exactly DTensor's `Shard(0)` layout. A 0-D
    parameter, which the engine holds as one row, is exposed with shape (1,).

    Note [lazy dtensor]: torch.distributed.tensor costs about as much to import as the rest of
    shardwise together (0.8 s of CPU here), and a run that never asks for a `state_dict()` or a
    DCP checkpoint never needs it; so it is imported here, on first use, and a check for a DTensor
    elsewhere asks `sys.modules` first (a value cannot be a DTensor before that module is loaded)."""
    from torch.distributed.tensor import DTensor

    rows = row_view(tensor, info, info.row_start, info.row_end)
    shape = tuple(info.full_shape) or (1,)
    stride = torch.empty(shape, device="meta").stride()
    mesh, placements = info.mesh.dtensor_placements(device_type)
    return DTensor.from_local(rows, mesh, placements, run_check=False, shape=shape, stride=stride)


def row_view(tensor: torch.Tensor, info: ShardInfo, lo: int, hi: int) -> torch.Tensor:
    """Rows lo:hi of the full tensor, as a view of `tensor` (the registered param or a state
    tensor shaped like it); a 0-D tensor counts as one row and comes back 1-D."""
    local = lo - info.row_start
    flat = tensor.detach()
    if len(info.full_shape) == 0:
        flat = flat.reshape(-1)
    return flat[local : local + (hi - lo)]

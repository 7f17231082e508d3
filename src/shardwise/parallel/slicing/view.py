"""Checkpoints of a sliced (and sharded) model: an unsliced view that the checkpoint code reads
and writes like any sharded model.

Note [unsliced view]: a checkpoint holds whole tensors in their own layout (rows of the full
tensor, any world size loads them). A sliced parameter's rows are not rows of the full tensor
(a row-sliced weight holds some columns of every row; a fused q/k/v slice is three runs), so
`sw.save`, `sw.load`, `sw.export` and `sw.full_state_dict` run on a view instead: a module
whose "engine" reports, for every parameter, rows `w*c : (w+1)*c` of the *full* tensor on
world rank `w` of `W` (c = ceil(rows / W): torch.chunk's layout, the engine's own), and an
optimizer view whose state is the same rows of each state tensor. Building it gathers one
parameter at a time (its data-axis shards, then its tensor-axis slices: one full parameter
is the peak) and keeps this rank's rows, 1/W of the model, like its shards. After a load,
`write_back` does the reverse: every rank's rows gathered, one parameter at a time, and this
rank's slice of them, then its shard rows, copied into the model and its optimizer state.
The view spans every rank (the mesh is the whole world); any layout, a plain model included,
loads what it writes, and it loads what any layout wrote.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardwise.engine import engine_of
from shardwise.engine.layout.parallel_layout import ParallelLayout
from shardwise.engine.layout.rows import num_rows
from shardwise.engine.protocol import Engine, attach_engine, slice_record, slicing_of
from shardwise.engine.unit.info import ShardInfo
from shardwise.errors import ShardwiseError
from shardwise.parallel.slicing.full import unslice


class _ViewEngine(Engine):
    """What the checkpoint code asks of the view's engine (Note [engine protocol]): the rows, the group."""

    strategy = "zero3"
    shards_rows = True  # each rank holds its own rows

    def __init__(self, infos: dict[str, ShardInfo], group) -> None:
        self.infos, self.group = infos, group

    def shard_info(self) -> dict[str, ShardInfo]:
        return self.infos


class _ViewOptimizer:
    """An optimizer's param groups and state over the view's row tensors (named like the real one)."""

    def __init__(self, param_groups: list[dict], state: dict) -> None:
        self.param_groups, self.state = param_groups, state


class UnslicedView:
    """Note [unsliced view]. `model` and `optim` are what the checkpoint functions get."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer | None, *, fill: bool) -> None:
        self.real, self.real_optim = model, optim
        self.group = dist.group.WORLD
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mesh = ParallelLayout.flat(self.group)  # its rows: flat over the world (Note [mesh info])
        engine = engine_of(model)
        data = dist.get_world_size(engine.group) if engine is not None else 1
        tensor_ranks = slicing_of(model).world_size
        if data * tensor_ranks != self.world:
            raise ShardwiseError(
                f"a checkpoint of a sliced model spans the whole world ({self.world} ranks), but this model's mesh "
                f"is {data} data x {tensor_ranks} tensor ranks. Slice over the tensor axis and "
                "sw.shard over the data axis of one mesh that holds every rank (Note [unsliced view])")
        sharded = engine is not None and engine.shards_rows  # zero: rows of each slice; ddp: whole slices
        self.engine_infos = engine.shard_info() if sharded else None
        # the rows of a slice are spread over the shard group; replicas hold copies (Note [sliced mesh])
        self.data_group = engine.mesh.shard_group if sharded else None
        names = _first_names(model)
        self.params = [(name, p) for name, p in model.named_parameters()]
        self.by_name = dict(self.params)
        infos, rows_of = {}, {}
        for name, param in self.params:
            full_shape = _full_shape(param, self.engine_infos, name)
            value = self._rows(self._whole(param, name), full_shape) if fill else None
            infos[name], rows_of[id(param)] = self._info(value, full_shape, param.dtype, names[id(param)][1:])
        self.infos = infos
        self.model = nn.Module()
        attach_engine(self.model, _ViewEngine(infos, self.group))
        for name, buffer in _persistent(model).items():  # buffers are whole on every rank: the model's own
            _attach(self.model, name, buffer)
        self.optim = self._view_optimizer(rows_of, fill) if optim is not None else None

    # ---- reading the model: whole tensors, this rank's rows of them ---------------------

    def _whole(self, tensor: Tensor, name: str) -> Tensor:
        """The full value of `tensor` (the parameter, or optimizer state shaped like its shard)."""
        param = self.by_name[name]
        local = tensor.detach()
        if self.engine_infos is not None:  # gather the data axis: the local slice, whole
            info = self.engine_infos[name]
            world = dist.get_world_size(self.data_group)
            gathered = local.new_empty((world * local.shape[0], *local.shape[1:]))
            dist.all_gather_single(gathered, local.contiguous(), group=self.data_group)
            local = gathered[: num_rows(info.full_shape)].reshape(info.full_shape)
        record = slice_record(param)
        return unslice(local, record) if record is not None else local.clone()

    def _rows(self, full: Tensor, full_shape) -> Tensor:
        rows = num_rows(full_shape)
        per_rank = self.mesh.rows_per_rank(rows)
        start, _ = self.mesh.row_range(rows)
        flat = full.reshape(rows, *full_shape[1:])
        out = flat.new_zeros((per_rank, *full_shape[1:]))
        out[: max(0, min(start + per_rank, rows) - start)] = flat[start : start + per_rank]
        return out

    def _info(self, value, full_shape, dtype, aliases) -> tuple[ShardInfo, Tensor]:
        if value is None:
            value = torch.zeros((self.mesh.rows_per_rank(num_rows(full_shape)), *full_shape[1:]), dtype=dtype)
        return ShardInfo(value, full_shape, *self.mesh.rows_of(full_shape), tuple(aliases), self.mesh), value

    def _view_optimizer(self, rows_of: dict[int, Tensor], fill: bool) -> _ViewOptimizer:
        real = self.real_optim
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [rows_of[id(p)] for p in g["params"]]}
                  for g in real.param_groups]
        state = {}
        for name, param in self.params:
            saved = real.state.get(param) if fill else None
            if not saved:
                continue
            view = {}
            for key in sorted(saved):
                value = saved[key]
                if isinstance(value, Tensor) and value.shape == param.shape and value.dim() > 0:
                    view[key] = self._rows(self._whole(value, name), self.infos[name].full_shape)
                else:
                    view[key] = value
            state[rows_of[id(param)]] = view
        # The checkpoint records the real optimizer's class, qualified (Note [optimizer class], checkpoint/).
        kind = type(real)
        cls = type(kind.__name__, (_ViewOptimizer,), {"__module__": kind.__module__, "__qualname__": kind.__qualname__})
        return cls(groups, state)

    # ---- after a load: the rows back into slices and shards -------------------------------

    def write_back(self) -> None:
        """Note [unsliced view]: the loaded rows into the model's slices and shards (a collective)."""
        with torch.no_grad():
            for name, param in self.params:
                param.copy_(self._mine(self.infos[name].param, name, param))
            if self.optim is None:
                return
            for view_group, group in zip(self.optim.param_groups, self.real_optim.param_groups):
                group.update({k: v for k, v in view_group.items() if k != "params"})
            for name, param in self.params:
                view = self.optim.state.get(self.infos[name].param)
                if view is None:
                    self.real_optim.state.pop(param, None)
                    continue
                state = {}
                for key in sorted(view):
                    value = view[key]
                    tensor_like = isinstance(value, Tensor) and value.shape == self.infos[name].param.shape
                    state[key] = self._mine(value, name, param).to(value.dtype) if tensor_like and \
                        value.dim() > 0 and key != "step" else value
                self.real_optim.state[param] = state

    def _mine(self, rows: Tensor, name: str, param: Tensor) -> Tensor:
        """This rank's part of a full tensor given as every rank's `rows`: its slice, then its shard rows."""
        full_shape = self.infos[name].full_shape
        gathered = rows.new_empty((self.world * rows.shape[0], *rows.shape[1:]))
        dist.all_gather_single(gathered, rows.contiguous(), group=self.group)
        full = gathered[: num_rows(full_shape)].reshape(full_shape)
        record = slice_record(param)
        local = record.take(full) if record is not None else full
        if self.engine_infos is None:
            return local
        info = self.engine_infos[name]
        rows = (local.reshape(-1) if local.dim() == 0 else local)[info.row_start : info.row_end]
        out = torch.zeros(param.shape, dtype=local.dtype)  # the shard: its rows, then padding
        out.view(-1)[: rows.numel()] = rows.reshape(-1)
        return out


def _full_shape(param: Tensor, engine_infos, name: str) -> torch.Size:
    record = slice_record(param)
    if record is not None:
        return record.full_shape
    return engine_infos[name].full_shape if engine_infos is not None else param.shape


def _first_names(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def _attach(root: nn.Module, dotted: str, buffer: Tensor) -> None:
    """Register `buffer` on `root` under the dotted name it has in the real model."""
    *path, leaf = dotted.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    module.register_buffer(leaf, buffer)


def _persistent(model: nn.Module) -> dict[str, Tensor]:
    out = {}
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                out.setdefault(f"{module_name}.{name}" if module_name else name, buffer)
    return out

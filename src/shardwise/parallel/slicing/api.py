"""`sw.slice(model, plan, group=...)`: cut layers into slices across a tensor group, in place.

Note [slice then shard]: slicing comes first and works on whole tensors; `sw.shard(model,
strategy="zero3", process_group=<data group>)` then shards each rank's slices across the
ranks that hold the same slices (a column of a data x tensor mesh). The order is checked
both ways: slicing a sharded model is refused here, and `shard()` asks the slicing
(`slicing_of(model).check_data_group`) to refuse a process group that mixes ranks of one
tensor group, whose different slices the engine would otherwise overwrite with rank 0's.

Note [one model everywhere]: every rank of the tensor group slices the same full values:
rank 0's are broadcast first (as DDP and `shard()` do), so a rank that built its model with
another seed still holds its slice of the same model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_flatten

from shardwise.engine import engine_of
from shardwise.engine.protocol import attach_slicing, slicing_of
from shardwise.engine.schedule.consistency import differs_across_ranks
from shardwise.errors import ShardwiseError
from shardwise.parallel.slicing.auto import auto_plan
from shardwise.parallel.slicing.clip import clip_sliced_grad_norm_
from shardwise.parallel.slicing.full import unslice_values
from shardwise.parallel.slicing.hf_loss import use_sliced_loss
from shardwise.parallel.slicing.layers import slice_module
from shardwise.parallel.slicing.plan import Slice, resolve
from shardwise.parallel.slicing.view import UnslicedView
from shardwise.wire.messages import all_gather_json


@dataclass(eq=False)
class Slicing:
    """What `sw.slice` attaches to the model (`attach_slicing`; found by `slicing_of`, engine/protocol.py)."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    plan: dict[str, Slice]  # module name -> its slice, as resolved

    def unslice(self, model: nn.Module, values: dict) -> dict:
        """`values` by name with every sliced parameter whole (full.py; a collective over the tensor group)."""
        return unslice_values(model, values)

    def checkpoint_view(self, model: nn.Module, optim=None, *, fill: bool = True) -> UnslicedView:
        """Note [unsliced view]: what sw.save / sw.load / sw.export read and write for this model (a
        collective over every rank). `fill=False` (a load) skips gathering the current values."""
        return UnslicedView(model, optim, fill=fill)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0):
        """`sw.clip_grad_norm_` for this model: the whole gradients' norm (clip.py, Note [sliced norm])."""
        return clip_sliced_grad_norm_(model, self, max_norm, norm_type)

    def check_data_group(self, data_group) -> None:
        """Refuse a data-parallel group that is not one rank per tensor slice (Note [slice then shard])."""
        mine = (self.rank, tuple(dist.get_process_group_ranks(self.group)))
        everyone = all_gather_json(mine, data_group)  # JSON, never a pickle between ranks
        positions = {position for position, _ in everyone}
        groups = [tuple(ranks) for _, ranks in everyone]
        if len(positions) != 1 or len(set(groups)) != len(groups):
            raise ShardwiseError(
                "sw.shard(process_group=...) on a sliced model needs the data-parallel group: ranks that hold the "
                f"same slices, one from each tensor group. This group's ranks hold slices {sorted(positions)} of "
                f"tensor groups {groups}. With a DeviceMesh (data, tensor) pass mesh['data'].get_group().")


def tensor_group_of(group) -> dist.ProcessGroup:
    """A ProcessGroup from what `sw.slice(group=...)` accepts: None (the world), a group, or a
    DeviceMesh (1-D, or with a dimension named "tensor")."""
    if group is None:
        return dist.group.WORLD
    if isinstance(group, DeviceMesh):
        names = group.mesh_dim_names or ()
        if group.ndim == 1:
            return group.get_group()
        if "tensor" not in names:
            raise ShardwiseError(f"a {group.ndim}-D DeviceMesh with dimensions {names} was given; name one "
                                 "dimension 'tensor' (mesh_dim_names=('data', 'tensor')) or pass mesh['tensor']")
        return group["tensor"].get_group()
    return group


def slice(model: nn.Module, plan: dict | str = "auto", *, group=None) -> nn.Module:  # noqa: A001 - the verb
    """Slice `model`'s layers across the ranks of `group` in place, and return it.

    `plan` maps module-name patterns (`*` is one name component) to "colwise", "rowwise",
    "vocab", "divide(attr)" or `sw.Slice(...)` (plan.py); "auto" finds it from the model
    (auto.py: `model.slice_plan()`, or Hugging Face Llama-style and GPT-2 blocks). `group` is
    the tensor group: a ProcessGroup, a DeviceMesh (its "tensor" dimension), or None for every
    rank. Every rank of the group calls it; a misuse raises a ShardwiseError on every rank.
    Call it before `sw.shard(..., process_group=<data group>)` and before building the
    optimizer (Note [slice then shard]).
    """
    if not dist.is_initialized():
        raise ShardwiseError("no process group: call `sw.init()` before `sw.slice(...)`")
    tensor_group = tensor_group_of(group)
    rank, world = dist.get_rank(tensor_group), dist.get_world_size(tensor_group)
    error, resolved = None, []
    try:
        if engine_of(model) is not None:
            raise ShardwiseError("this model is already sharded: call sw.slice(model, ...) before sw.shard(model, "
                                 "...), on a fresh model (Note [slice then shard])")
        if slicing_of(model) is not None:
            raise ShardwiseError("this model is already sliced; slice a fresh model once")
        meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
        if meta:
            raise ShardwiseError(f"{meta[0]} is on the meta device (sw.deferred_init()): sw.slice needs real values; "
                                 "build the model eagerly (sw.shard's deferred init shards whole tensors only)")
        resolved = resolve(model, auto_plan(model) if plan == "auto" else plan)
    except ShardwiseError as exc:
        error = str(exc)
    _agree(error, tensor_group, world)
    _broadcast_values(model, tensor_group)
    for name, module, spec in resolved:
        slice_module(name, module, spec, rank, world, tensor_group)
    if any(spec.kind == "vocab" for _, _, spec in resolved):
        use_sliced_loss(model)  # Note [hf loss]: model(..., labels=...) on the slices
    attach_slicing(model, Slicing(tensor_group, rank, world, {name: spec for name, _, spec in resolved}))
    model.register_state_dict_post_hook(_refuse_state_dict)
    if world > 1:
        model.register_forward_pre_hook(_same_inputs_check(tensor_group), with_kwargs=True)
    return model


def _same_inputs_check(group):
    """Note [same inputs]: every rank of a tensor group must feed the model the same inputs (each
    computes its slice of the same step). Ranks that take different data (a sampler split over
    the tensor ranks, not over the data axis) would train on a mix of the batches, silently. So
    each forward compares a fingerprint of the inputs across the group (one all-reduce of four
    float64 numbers: the max and the negated min of two sums; equal inputs give equal bits)."""
    def hook(module, args, kwargs):
        if differs_across_ranks([t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)], group):
            raise ShardwiseError("the ranks of a tensor group were given different inputs: each holds a slice of "
                                 "the same layers, so all must see the same batch. Split the batch over the data "
                                 "axis only: rows for mesh['data'].get_local_rank(), the same on every tensor rank")
    return hook


def _refuse_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """Note [sliced parameters]: a sliced model's `state_dict()` would hold this rank's slices under
    the full tensors' names, which a file or another tool would take for the whole model."""
    raise ShardwiseError("model.state_dict() of a sliced model (sw.slice) would hold this rank's slices as if "
                         "they were whole tensors. Use sw.full_state_dict(model) for whole tensors, or "
                         "sw.save(path, model, optim) for a checkpoint (both work at any layout)")


def _agree(error: str | None, group, world: int) -> None:
    """Raise on every rank if any rank found a problem (every rank raises, none hangs)."""
    errors = all_gather_json(error, group)  # JSON, never a pickle between ranks
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise ShardwiseError(error if error is not None else f"tensor rank {failed[0][0]}: {failed[0][1]}")


def _broadcast_values(model: nn.Module, group) -> None:
    """Note [one model everywhere]."""
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=source, group=group)

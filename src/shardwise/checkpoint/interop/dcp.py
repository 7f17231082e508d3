"""`sw.dcp_state_dict`: a sharded model's state as DTensors, for `torch.distributed.checkpoint`.

Each shard's real rows (Note [dcp rows] in engine/unit/info.py) become a DTensor's local
tensor as they are, no copy, and DCP can save them and load them back *in place*, at another world size or strategy
(DCP reads the overlapping chunks). A 0-D parameter, which the engine holds as one
row, is exposed as shape (1,): DCP with shardwise's own keys both ways.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.checkpoint.format.names import clean_name
from shardwise.checkpoint.format.optim_state import (
    class_name,
    optimizer_names,
    placements,
    scalar_state_keys,
    split_state,
)
from shardwise.checkpoint.format.ranks import is_sharded
from shardwise.engine.unit.info import ShardInfo, as_dtensor, shard_info
from shardwise.errors import ShardwiseError


def dcp_state_dict(model: nn.Module, optim: torch.optim.Optimizer | None = None) -> dict:
    """`{"model": {name: tensor}, "optim": {name: {key: tensor}}}` for `torch.distributed.checkpoint`.

    For the zero strategies every tensor is a DTensor (`Shard(0)`) whose local part is a
    view of this rank's rows, so `dcp.save(sd, checkpoint_id=...)` writes each rank's rows
    and `dcp.load(sd, checkpoint_id=...)` fills the live parameters and optimizer state
    in place, whatever world size or strategy saved them (Note [dcp rows]). For ddp and
    unwrapped models the tensors are the replicated parameters themselves. Optimizer state
    is included for parameters that have some (as with DCP's own helpers, take a step
    before loading into a fresh optimizer). Every rank calls it.
    """
    sharded = is_sharded(model)
    device_type = _device_type(model)
    infos = shard_info(model)

    def wrap(tensor: torch.Tensor, info: ShardInfo) -> torch.Tensor:
        return as_dtensor(tensor, info, device_type) if sharded else tensor.detach()

    out: dict = {"model": {clean_name(name): wrap(info.param, info) for name, info in infos.items()}}
    if optim is not None:
        names = optimizer_names(optim, infos)
        if any(place.owner is not None for place in placements(optim, infos).values()):
            raise ShardwiseError(
                f"sw.dcp_state_dict of a {class_name(optim)}'s state on a sharded model is not supported: it steps "
                "whole tensors on one owner rank each (Note [whole-tensor step]), which a Shard(0) DTensor cannot "
                "describe. Use sw.save / sw.load, which save that state and give it to the owners at any world size.")
        by_name = {clean_name(name): info for name, info in infos.items()}
        scalar_keys = scalar_state_keys(optim)
        out["optim"] = {}
        for param, state in optim.state.items():
            name = names[id(param)]
            rows, _, _ = split_state(name, param.shape, state, scalar_keys, whole_allowed=not sharded)
            entry = {key: wrap(value, by_name[name]) for key, value in rows.items()}
            entry.update({key: value for key, value in state.items()
                          if key not in rows and isinstance(value, torch.Tensor)})
            out["optim"][name] = entry
    return out


def _device_type(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"

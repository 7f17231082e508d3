"""`model.state_dict()` and `model.load_state_dict()` on a sharded model: never shards that look whole.
Uses: info.

Note [state dict]: a registered parameter of a zero model is this rank's padded rows, so
torch's own `state_dict()` would hand out `wte.weight` as [250, 64] where the model has
[500, 64], and `save_pretrained()` would write that. Two module hooks keep the
ecosystem's convention instead:
- `state_dict()` holds each parameter (under every name it is registered under) as a DTensor
  with a `Shard(0)` placement over the units' shard group (Note [mesh info]), whose local part is a view of
  this rank's real rows (Note [dcp rows]): `torch.distributed.checkpoint` saves and reshards
  it directly, `.full_tensor()` gives the whole value (a collective), and shapes are the full
  shapes. `sw.full_state_dict(model)` gives plain full tensors on rank 0 for an export.
- `load_state_dict()` takes full tensors or DTensors of the full shape (any world size) and
  keeps this rank's rows; a wrong shape is reported under the full shapes. Every rank calls
  it, as every rank calls `state_dict()` (a DTensor of another layout is gathered: a collective).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from shardwise.engine.unit.info import ShardInfo, as_dtensor


def install_state_dict_hooks(model: nn.Module, engine) -> None:
    """Register the two hooks of Note [state dict] on `model` for `engine` (a ZeroEngine)."""
    def names_and_infos(prefix: str):
        for name, info in engine.shard_info().items():
            for alias in (name, *info.aliases):
                yield prefix + alias, info

    def to_dtensors(module, state_dict, prefix, local_metadata):
        for key, info in names_and_infos(prefix):
            if key in state_dict:
                # The mesh on the rows' own device, never the compute device: under offload="host" the rows are host
                # memory and a mesh of the accelerator makes `from_local` hand out device copies, which
                # `dcp.load(model.state_dict())` would fill while the rows stayed as they were (Note [host offload]).
                state_dict[key] = as_dtensor(info.param, info, info.param.device.type)

    def from_full_values(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                         error_msgs):
        for key, info in names_and_infos(prefix):
            if key in state_dict:
                state_dict[key] = _own_rows(key, state_dict[key], info, error_msgs)

    model.register_state_dict_post_hook(to_dtensors)
    model.register_load_state_dict_pre_hook(from_full_values)


def _own_rows(key: str, value, info: ShardInfo, error_msgs: list[str]) -> torch.Tensor:
    """This rank's rows of a full value, padded to the registered shard's shape, which torch's
    loader then copies into the shard (bumping its version: Note [writes the engine must see])."""
    shard = info.param
    dtensor = sys.modules.get("torch.distributed.tensor")  # not loaded: no value is a DTensor (Note [lazy dtensor])
    if dtensor is not None and isinstance(value, dtensor.DTensor):
        value = value.full_tensor()
    full_shape = tuple(info.full_shape)
    if tuple(value.shape) != full_shape and not (full_shape == () and tuple(value.shape) == (1,)):
        error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                          f"checkpoint, the shape in current model is {full_shape}.")
        return shard.detach()  # keep the current rows; the message above makes strict loading fail
    rows = value.detach().reshape(-1) if full_shape == () else value.detach()
    rows = rows[info.row_start : info.row_end].to(shard.dtype)
    padded = torch.zeros(shard.shape, dtype=shard.dtype, device=shard.device)
    padded.view(-1)[: rows.numel()] = rows.reshape(-1)
    return padded

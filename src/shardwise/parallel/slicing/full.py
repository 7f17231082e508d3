"""Whole tensors from sliced ones: every rank's slice gathered over the tensor group and put
back where it came from (Note [sliced parameters] in layers.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardwise.engine.protocol import is_sliced_param, slice_record


def unslice_values(model: nn.Module, values: dict[str, Tensor]) -> dict[str, Tensor]:
    """`values` (this rank's slices by parameter name, e.g. from the engine's full_parameters) with every
    sliced parameter's value replaced by the whole tensor. A collective over each tensor group:
    every rank calls it, with the same names."""
    records = {name: slice_record(p) for name, p in model.named_parameters() if is_sliced_param(p)}
    out = dict(values)
    for name in values:
        record = records.get(name)
        if record is not None:
            out[name] = unslice(values[name], record)
    return out


def unslice(local: Tensor, record) -> Tensor:
    """The whole tensor from this rank's slice `local` of it (a collective over `record.group`)."""
    group, sizes = record.group, record.sizes
    if len(sizes) == 1:
        return local.clone()
    biggest = max(sizes)
    pad = list(local.shape)
    pad[record.dim] = biggest - local.shape[record.dim]
    padded = torch.cat([local, local.new_zeros(pad)], dim=record.dim) if pad[record.dim] else local
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return record.place([part.narrow(record.dim, 0, size) for part, size in zip(parts, sizes)])

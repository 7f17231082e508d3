"""Ranks agree on the model before anything is sharded: same parameters, same starting values."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from shardwise.engine.flat_unit import FlatUnit
from shardwise.errors import ShardwiseError


def check_same_model_on_every_rank(model: nn.Module, group) -> None:
    """Fail at shard() — not with a hang mid-step — when ranks built different models.

    Ranks first compare a hash of (name, shape, dtype) of every parameter: one small
    all-gather. Only when the hashes differ are the full lists exchanged, to name the
    first differing parameter (all_gather_object costs ~4 MB of RSS on first use)."""
    mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    digest = hashlib.sha256(repr(mine).encode()).digest()
    signature = torch.tensor([int.from_bytes(digest[:7], "little")], dtype=torch.int64)
    signatures = [torch.zeros_like(signature) for _ in range(dist.get_world_size(group))]
    dist.all_gather(signatures, signature, group=group)
    if all(torch.equal(s, signatures[0]) for s in signatures):
        return
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        for index in range(max(len(theirs), len(reference))):
            a = reference[index] if index < len(reference) else None
            b = theirs[index] if index < len(theirs) else None
            if a != b:
                raise ShardwiseError(
                    f"ranks 0 and {rank} built different models: parameter #{index} is "
                    f"{_describe(a)} on rank 0 but {_describe(b)} on rank {rank}. Build the model "
                    "from the same code and config on every rank (only the data should differ)."
                )


def _describe(entry) -> str:
    if entry is None:
        return "absent"
    name, shape, dtype = entry
    return f"{name!r} shape {list(shape)} {dtype}"


def broadcast_from_rank0(unit: FlatUnit, group) -> None:
    """Every rank starts from rank 0's values (as DDP does), one unit at a time."""
    with torch.no_grad():
        for layout in unit.layouts:
            dist.broadcast(layout.owned.param.data, src=dist.get_global_rank(group, 0), group=group)

"""Small reports between ranks (an error, a file's record, a host name) as JSON in uint8 tensors.
Uses: nothing of the engine (it sits below it).

Note [no pickle on the wire]: torch's object collectives (`broadcast_object_list`,
`all_gather_object`, `gather_object`) pickle what they send and unpickle what they receive, so a
process that gets into the group (the store is unauthenticated: Note [what a job trusts] in
dist.py) runs code in every rank that receives from it. shardwise sends JSON instead: the bytes of
`json.dumps(obj)` in a uint8 tensor, after their length in an int64 one. What arrives is parsed by
`json.loads`, which builds only dicts, lists, strings, numbers, booleans and None; a tuple sent
arrives as a list. A length over MAX_MESSAGE_BYTES, or bytes that do not parse, is a
ShardwiseError, never an allocation or a traceback.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from shardwise.errors import ShardwiseError
from shardwise.wire.backends import host_values_device

MAX_MESSAGE_BYTES = 2**30  # a save's per-rank record (its crcs) is under 1 MiB per TiB of data


def _encode(obj, device) -> torch.Tensor:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else \
        torch.empty(0, dtype=torch.uint8, device=device)


def _decode(data: torch.Tensor, size: int):
    try:
        return json.loads(bytes(data[:size].cpu().numpy()))
    except (ValueError, RecursionError):
        raise ShardwiseError("a rank sent a report that is not JSON (Note [no pickle on the wire]): a process that "
                             "is not one of this job's ranks may have joined its group") from None


def _sizes(size: int, group, world: int, device) -> list[int]:
    mine = torch.tensor([size], dtype=torch.int64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    sizes = [int(s.item()) for s in everyone]
    if any(not 0 <= s <= MAX_MESSAGE_BYTES for s in sizes):
        raise ShardwiseError(f"a rank announced a report of {max(sizes)} bytes, more than {MAX_MESSAGE_BYTES} (Note "
                             "[no pickle on the wire]): a process that is not one of this job's ranks may have "
                             "joined its group")
    return sizes


def all_gather_json(obj, group) -> list:
    """Every rank's `obj` (JSON), on every rank."""
    world = dist.get_world_size(group)
    device = host_values_device(group)  # Note [group backends]: the CPU wherever gloo serves it
    data = _encode(obj, device)
    sizes = _sizes(data.numel(), group, world, device)
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [_decode(t, s) for t, s in zip(out, sizes)]


def gather_json(obj, group, dst: int = 0) -> list | None:
    """Every rank's `obj` (JSON) on group rank `dst`; None on the others."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = host_values_device(group)  # Note [group backends]: the CPU wherever gloo serves it
    data = _encode(obj, device)
    sizes = _sizes(data.numel(), group, world, device)
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    out = [torch.empty_like(padded) for _ in range(world)] if rank == dst else None
    dist.gather(padded, out, dst=dist.get_global_rank(group, dst), group=group)
    return [_decode(t, s) for t, s in zip(out, sizes)] if rank == dst else None


def broadcast_json(obj, group, src: int = 0):
    """Group rank `src`'s `obj` (JSON), on every rank (the others pass anything, e.g. None)."""
    rank = dist.get_rank(group)
    device = host_values_device(group)  # Note [group backends]: the CPU wherever gloo serves it
    data = _encode(obj if rank == src else None, device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    source = dist.get_global_rank(group, src)
    dist.broadcast(size, src=source, group=group)
    if not 0 <= int(size.item()) <= MAX_MESSAGE_BYTES:
        raise ShardwiseError(f"rank {src} announced a report of {int(size.item())} bytes (Note [no pickle on the "
                             "wire]): a process that is not one of this job's ranks may have joined its group")
    buffer = data if rank == src else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=source, group=group)
    return _decode(buffer, int(size.item()))

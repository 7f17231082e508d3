"""Collectives of the pipeline outside the schedule: moving parameters and optimizer state between
ranks when the layout changes. Gradients are the engine's to reduce (Note [whole replicas],
engine/optim/replica_grads.py; Note [sharded stages], sharded.py): nothing here averages them.

Kept apart from the trainer so that what crosses the wire, and in which order, reads in
one place. Every function here is called by all ranks of the groups it names, in the
same order on each (a rank in two groups meets each group's peers in the same order).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardwise.errors import ShardwiseError
from shardwise.wire.messages import broadcast_json

State = dict[str, dict[str, Any]]  # parameter name -> that parameter's optimizer state


def broadcast_entries(
    params: dict[str, nn.Parameter],
    names: list[str],
    optimizer: torch.optim.Optimizer | None,
    src: int,
    group: dist.ProcessGroup,
    with_state: bool,
) -> State:
    """Send parameters `names` (and their optimizer state, if `with_state`) from global rank
    `src` to every rank of `group`; write the values into `params` and return the state.

    The state's layout (which keys, shapes, dtypes) travels first as JSON (Note [no pickle on the
    wire] in wire/messages.py: a pickle from the wire would run the sender's code here), then
    the tensors as one flat buffer per dtype.
    """
    me = dist.get_rank()
    states: State = {}
    if me == src and with_state and optimizer is not None:
        for name in names:
            states[name] = dict(optimizer.state.get(params[name], {}))
    try:
        layouts = [[name, {k: _spec(name, k, v) for k, v in states.get(name, {}).items()}] for name in names]
    except ShardwiseError as error:  # sent, so that every rank raises it rather than waiting for tensors
        layouts = {"error": str(error)}
    if with_state:
        layouts = broadcast_json(layouts, group, src=dist.get_group_rank(group, src))
    if isinstance(layouts, dict):
        raise ShardwiseError(str(layouts.get("error")))
    tensors: list[Tensor] = []  # in meta's order: each parameter, then its state tensors
    for name, layout in layouts:
        tensors.append(params[name].data)  # received in place on the other ranks
        received = states.setdefault(name, {})
        for key, spec in layout.items():
            if spec["kind"] == "value":
                received[key] = spec["value"]
                continue
            if me != src:
                received[key] = torch.empty(spec["shape"], dtype=_dtype(spec["dtype"]))
            tensors.append(received[key])
    broadcast_flat(tensors, src, group, me == src)
    # Copies: the optimizer that loads them must not share tensors with the one that sent them.
    return {name: {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in s.items()}
            for name, s in states.items()}


def _spec(name: str, key: str, value) -> dict:
    """A state entry's layout as JSON: a tensor's shape and dtype, or a plain value itself."""
    if isinstance(value, Tensor):
        return {"kind": "tensor", "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"kind": "value", "value": value}
    raise ShardwiseError(f"the optimizer state of {name} holds {key}={type(value).__name__}: the pipeline moves "
                         "tensors and plain numbers, strings or booleans between ranks, nothing else")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ShardwiseError(f"a rank sent optimizer state of dtype {name!r}, which is not a torch dtype (Note [no "
                             "pickle on the wire]): a process that is not one of this job's ranks may have joined")
    return dtype


def broadcast_flat(tensors: list[Tensor], src: int, group: dist.ProcessGroup, is_src: bool) -> None:
    """Send `tensors` from global rank `src` into the same-shaped `tensors` of every rank of `group`."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        group_tensors = by_dtype[dtype]
        flat = torch.cat([t.reshape(-1) for t in group_tensors]) if is_src else \
            torch.empty(sum(t.numel() for t in group_tensors), dtype=dtype)
        dist.broadcast(flat, src=src, group=group)
        if not is_src:
            offset = 0
            for t in group_tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

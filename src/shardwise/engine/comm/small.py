"""The small collectives of a step beside the units' own: headers and tags gathered from every rank, norms
and flags reduced over a group, set-up's broadcast of rank 0's values. Uses: collectives.

Note [comm context] (context.py): nothing outside comm/ calls torch.distributed's collectives, so what
the engine exchanges, and on which group, reads from this package. These move a few bytes each (a
header, one norm per tensor, a flag): no buffers to reuse, no form to pick.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from shardwise.engine.comm.collectives import named_failure


def host_values_to(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A step's few host values (a header, a tag, used flags) on `device` without blocking the host: staged in
    pinned memory where `device` is an accelerator, as a `non_blocking` copy from pageable memory is a blocking
    one (the fake accelerator's checks count it: tests/helpers/fake_gpu.py)."""
    host = torch.tensor(values, dtype=dtype)
    return (host if device.type == "cpu" else host.pin_memory()).to(device, non_blocking=True)


def wait_for_copy(passed) -> None:
    """Before the host reads a copy that event `passed` follows: a query first (in a step's settle the copy has
    long passed, and the host goes on without a wait), a blocking wait only where it has not."""
    if not passed.query():
        passed.synchronize()


def all_reduce_max(tensor: Tensor, group, what: str = "an all-reduce") -> Tensor:
    """`tensor` in place: the element-wise maximum over `group`'s ranks."""
    with named_failure(what):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def all_reduce_sum(tensor: Tensor, group, what: str = "an all-reduce") -> Tensor:
    """`tensor` in place: the element-wise sum over `group`'s ranks."""
    with named_failure(what):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def start_all_reduce_max(tensor: Tensor, group):
    """Issue the element-wise maximum of `tensor` over `group`'s ranks, in place, async: the torch work handle,
    waited by the caller inside its own `named_failure`."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)


def start_all_gather_rows(received: Tensor, sent: Tensor, group):
    """Issue the gather of every rank's `sent` into `received` (rank-major), async: the torch work handle,
    waited by the caller inside its own `named_failure`."""
    return dist.all_gather_single(received, sent, group=group, async_op=True)


def all_gather_list(outputs: list[Tensor], tensor: Tensor, group) -> list[Tensor]:
    """Every rank's `tensor` into `outputs` (one per rank), waited."""
    dist.all_gather(outputs, tensor, group=group)
    return outputs


def broadcast_from(tensor: Tensor, src_rank_in_group: int, group) -> Tensor:
    """`tensor` in place: the value of `group`'s rank `src_rank_in_group` on every rank."""
    dist.broadcast(tensor, src=dist.get_global_rank(group, src_rank_in_group), group=group)
    return tensor

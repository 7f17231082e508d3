"""Every process group the library makes, made here: the engine's reduce and host groups, the
pipeline's stage and replica groups, the checkpoint's own group. Uses: nothing of the engine.

Note [one maker of groups]: a process group is a collective to create (every member calls
`new_group` in the same order) and a resource to close (Note [exit teardown]); making them in one
place (`make_group`, the one caller of torch's `new_group`) keeps both rules in one place, and
gives a group made beside another the other's timeout (the bound `sw.init(timeout=...)` set), so a
hang anywhere is bounded alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from shardwise.teardown import close_group_at_exit
from shardwise.wire.backends import device_of, has_host_backend


def make_group(ranks: Sequence[int], *, like=None, backend: str | None = None, local: bool = False,
              what: str | None = None) -> dist.ProcessGroup:
    """A new group of global `ranks`. `like`: a group whose timeout it keeps; `local`: only the members
    call this (torch's `use_local_synchronization`), else every rank of the world does; `what`: names the
    group for the exit teardown, which then destroys it unless it is gone by then (Note [exit teardown])."""
    kwargs = {"timeout": timeout_of(like)} if like is not None else {}
    group = dist.new_group(list(ranks), backend=backend, use_local_synchronization=local, **kwargs)
    return close_group_at_exit(group, what) if what is not None else group


def timeout_of(group):
    """`group`'s timeout (the bound sw.init(timeout=...) sets), for a group made beside it; None (torch's
    default) for a backend that does not say."""
    try:
        return group._get_backend(device_of(group)).options._timeout
    except (AttributeError, RuntimeError):
        return None


def new_reduce_group(group) -> dist.ProcessGroup:
    """A second group of `group`'s ranks, for the reduce-scatters alone (Note [collective order], zero.py).

    Only `group`'s members call this (local synchronization), so a user's subgroup gets its own
    reduce group as the world does; it keeps `group`'s timeout."""
    return make_group(dist.get_process_group_ranks(group), like=group, backend=dist.get_backend(group), local=True,
                     what="a reduce group")


def new_node_group(group, ranks_per_node: int) -> dist.ProcessGroup:
    """The group of this rank's node among `group`'s ranks: `group`'s ranks cut into consecutive runs of
    `ranks_per_node` (torchrun numbers ranks node by node). Only a node's members make its group (local
    synchronization), each node its own; it keeps `group`'s timeout (Note [secondary shards], secondary.py)."""
    ranks = dist.get_process_group_ranks(group)
    node = ranks.index(dist.get_rank()) // ranks_per_node
    return make_group(ranks[node * ranks_per_node : (node + 1) * ranks_per_node], like=group,
                      backend=dist.get_backend(group), local=True, what="a node group")


# Note [host values]: some decisions of a step are made on host values: whether the ranks agree on a
# forward or backward (agreement.py) and which parameters any rank used (unit_grads.py, Note [unused
# params]). Reading a device tensor for them would stall a GPU's stream, so they travel on a CPU
# group: the gloo group itself on CPU, a gloo group of the same ranks beside an NCCL one.
def host_group_of(group) -> dist.ProcessGroup:
    """A group of `group`'s ranks whose collectives take CPU tensors (Note [host values])."""
    return group if has_host_backend(group) else new_host_group(group)


def new_host_group(group) -> dist.ProcessGroup:
    """A new gloo group of `group`'s ranks (Note [host values]): a channel of its own, whose collectives
    pair only with each other (Note [agreement rides the traffic], agreement.py)."""
    return make_group(dist.get_process_group_ranks(group), like=group, backend="gloo", local=True,
                     what="a host group")

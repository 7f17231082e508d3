"""hpZ's secondary shard: a zero3 unit's full values kept after forward in chunks over the ranks of one
node, so that backward's re-gather stays inside the node. Uses: context.

Note [secondary shards]: under zero3 a unit's full values are gathered over the shard group in forward,
freed, and gathered again over the shard group in backward: twice a step over links that, on many nodes,
leave the node. With `reshard_after_forward=N` (DeepSpeed ZeRO++'s hpZ, `zero_hpz_partition_size=N`;
FSDP2's `reshard_after_forward=N`) each rank keeps, when a unit is freed after its forward, its chunk of the
unit's full buffer cut over the N ranks of its node (the layout's node group: consecutive ranks, torchrun's
numbering), 1/N of the unit; backward's re-gather is then an all-gather of those chunks over the node group
straight into the unit's full buffer (whose length is padded to a multiple of N). Every rank of a node holds
the same full values after forward (each gathered the whole unit), so the chunks join into exactly the
values the shard group's gather would give: the result is unchanged, bitwise.

Lifetime: a chunk is cut at the first free of the unit in a forward with grad and kept until the next
forward begins, the window closes (after backward, or after a forward no backward can follow) or an
optimizer writes the unit's rows, whichever comes first; it is never read across a step, whose update would
make it stale. Dropping it when a forward begins, even inside an open window (a second forward before one
backward, or a loss kept alive across a `sw.load`), makes each forward gather the rows as they are now over
the shard group, as plain zero3 does, and backward use the last forward's values: rows written between two
forwards (a load, a user's write) are never hidden by a chunk cut before them, and ranks that differ in
whether their window is still open (one kept its loss, one dropped it) still pick the same group. Whether
a unit holds one is decided by the units it ran, which every rank agrees on under zero3 (Note [gather
tags]), so all ranks pick the same group for the same gather. Cost: 1/N of each unit's full values from its
forward to the end of backward (counted by sw.estimate: estimate/core.py's secondary chunks).
"""

from __future__ import annotations

import torch
from torch import Tensor

from shardwise.engine.comm.context import CommContext


class SecondaryShard:
    """One zero3 unit's chunk of its full values over this rank's node (Note [secondary shards])."""

    def __init__(self, node_group, node_rank: int, node_world: int) -> None:
        self.group, self.rank, self.world = node_group, node_rank, node_world
        self.chunk: Tensor | None = None  # this rank's 1/world of the full buffer, while held

    @property
    def held(self) -> bool:
        return self.chunk is not None

    def cut(self, full_flat: Tensor) -> None:
        """Keep this rank's chunk of `full_flat` (gathered now), unless one is held already this window."""
        if self.chunk is None:
            with torch.no_grad():
                self.chunk = full_flat.view(self.world, -1)[self.rank].clone()

    def gather_into(self, comm: CommContext, full_flat: Tensor, what: str):
        """Issue the node group's gather of the chunks into `full_flat`: the handle (collectives.Pending)."""
        return comm.gather_into([self.chunk], [full_flat], self.world, self.group, what,
                                exact=True)  # forward's own values, never re-quantized (Note [quantized collectives])

    def drop(self) -> None:
        self.chunk = None

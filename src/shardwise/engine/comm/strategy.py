"""Which form each of a unit's collectives takes on a backend: gloo's or NCCL's, decided once per group.
Uses: buffers, collectives.

Note [comm strategies]: a unit's rows become full values by a gather and its gradients become rows by a
reduce-scatter; *how* is a strategy object, picked per process group when the engine is built
(`strategy_for`), so no hot-path call asks the backend again. Both strategies share the code of
collectives.py and differ in the form they ask for: gloo's broadcasts straight into place and its
all-to-all summed here (Note [gloo collectives], Note [gathered in place]), NCCL's own all-gather and
reduce-scatter into one rank-major buffer. A group of one rank (a pipeline stage's shard group of one,
a world of one) issues no collective at all: its rows are the whole tensor (`OneRankForms`). A new
form (a quantized gather: Note [where the next capabilities land], parallel_layout.py) is one more
strategy with the same three methods, whose `Pending.wait()` leaves full values in place.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

import shardwise.engine.comm.collectives as coll
from shardwise.engine.comm.buffers import BufferPool


class TorchForms:
    """NCCL's forms (and any backend but gloo): torch's all-gather and reduce-scatter, one call each."""

    name = "nccl"
    gloo = False

    def gather_into(self, rows: list[Tensor], regions: list[Tensor], world_size: int, group, async_op: bool, what: str,
                    own_in_place: bool, pool: BufferPool | None) -> coll.Pending:
        """Every rank's rows of each parameter into its padded full region (collectives.gather_into)."""
        return coll.gather_into(rows, regions, world_size, group, async_op, what, own_in_place, gloo=self.gloo,
                                pool=pool)

    def reduce_scatter_avg(self, packed: Tensor, world_size: int, group, async_op: bool, what: str,
                           out: Tensor | None, pool: BufferPool | None) -> coll.Pending:
        """The average of a rank-major buffer over the ranks; this rank's rows (collectives.reduce_scatter_avg)."""
        return coll.reduce_scatter_avg(packed, world_size, group, async_op, what, out, gloo=self.gloo, pool=pool)

    def all_reduce_avg(self, tensor: Tensor, group, what: str) -> coll.Pending:
        """Average `tensor` in place over `group`, issued async: the handle's wait lands it."""
        return coll.all_reduce_avg_async(tensor, group, what)


class GlooForms(TorchForms):
    """gloo's forms: broadcasts into place, all-to-all summed here (Note [gloo collectives])."""

    name = "gloo"
    gloo = True


class OneRankForms(TorchForms):
    """A group of one rank (a pipeline stage's shard group of one, a world of one): its rows are the whole
    tensor, so a gather is a copy into the region (none where the rows already are the region's own chunk).
    No collective: on gloo each gather was a broadcast to itself and a wait per unit per micro-batch (a zero3
    stage of one rank stepped 1.4x a whole-copy stage). Its reduce is collectives.reduce_scatter_avg's own
    mean of one copy; the replicas' all-reduce never meets a group of one (a mesh with one replica is not
    hybrid: UnitGrads.land)."""

    name = "one rank"

    def gather_into(self, rows: list[Tensor], regions: list[Tensor], world_size: int, group, async_op: bool, what: str,
                    own_in_place: bool, pool: BufferPool | None) -> coll.Pending:
        if not own_in_place:
            for part, region in zip(rows, regions):
                region.view(-1).copy_(part.reshape(-1))
        return coll.Pending([], regions[0] if regions else torch.empty(0), what)


def strategy_for(group) -> TorchForms:
    """The strategy of `group`'s size and backend (Note [comm strategies])."""
    if dist.get_world_size(group) == 1:
        return OneRankForms()
    return GlooForms() if dist.get_backend(group) == "gloo" else TorchForms()

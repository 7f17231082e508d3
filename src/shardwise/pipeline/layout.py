"""Which rank runs which layers: a `Layout` (frozen prefix, stages, replicas) and how to plan
one. Its process groups are the engine layout's (`Layout.grid` -> `ParallelLayout.pipelined`).

Ranks are numbered replica-major: rank = replica * num_stages + stage, so each replica's
pipeline is a run of consecutive ranks and re-packing to fewer stages turns the freed
ranks into whole new replicas (PipeTransformer's AutoPipe + AutoDP).

Note [cache across re-packs]: a rank that is a first stage both before and after a
re-pack from S to S' stages gets a subset of the samples it had: its replica's homes
(StickySampler, H homes, W ranks) start at home rank * H / W in both layouts, and number
H * S' / W <= H * S / W. So its activation cache is carried forward (only the newly
frozen layers run over what it holds) instead of recomputed (trainer._update_cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from shardwise.errors import ShardwiseError
from shardwise.pipeline.balance import partition, stage_costs
from shardwise.pipeline.layers import LayerChain


@dataclass(frozen=True)
class Layout:
    """Layers `[0, num_frozen)` are frozen (run before the pipeline, or read from the cache);
    stage s runs layers `[bounds[s][0], bounds[s][1])`; `num_replicas` copies of that pipeline
    train on equal slices of each global batch."""

    num_frozen: int
    bounds: tuple[tuple[int, int], ...]
    num_replicas: int

    @property
    def num_stages(self) -> int:
        """Pipeline length."""
        return len(self.bounds)

    @property
    def world_size(self) -> int:
        """Ranks the layout uses."""
        return self.num_stages * self.num_replicas

    def coords(self, rank: int) -> tuple[int, int]:
        """(replica, stage) of group rank `rank`."""
        return divmod(rank, self.num_stages)

    def rank_of(self, replica: int, stage: int) -> int:
        """Group rank of `stage` in `replica`."""
        return replica * self.num_stages + stage

    def grid(self, global_ranks: Sequence[int], shards: int) -> list[list[list[int]]]:
        """`grid[stage][replica][shard]` of global ranks for sharded stages (Note [pipe dimension] in
        engine/layout/parallel_layout.py): the data coordinate q = replica * shards + shard of a rank is
        its pipeline copy, so each copy stays a run of consecutive ranks as above."""
        return [[[global_ranks[self.rank_of(r * shards + k, s)] for k in range(shards)]
                 for r in range(self.num_replicas // shards)] for s in range(self.num_stages)]

    def stage_of_layer(self, layer: int) -> int | None:
        """The stage running `layer`, or None for a frozen layer."""
        for stage, (start, end) in enumerate(self.bounds):
            if start <= layer < end:
                return stage
        return None

    def stages_holding(self, chain: LayerChain, name: str) -> tuple[int, ...]:
        """The stages whose layers hold parameter `name` (more than one for a tied parameter)."""
        stages = {self.stage_of_layer(i) for i, names in enumerate(chain.names) if name in names}
        return tuple(sorted(s for s in stages if s is not None))


def plan_layout(
    costs: Sequence[float],
    *,
    num_frozen: int,
    world_size: int,
    num_stages: int,
    repack: bool,
    budget: float,
) -> Layout:
    """Balance the active layers (those from `num_frozen` on) over stages.

    Without `repack` the pipeline keeps `num_stages` stages. With it, the pipeline takes
    the fewest stages (a divisor of `world_size`, at most `num_stages`) whose most
    expensive stage costs no more than `budget` (the original layout's most expensive
    stage: what one rank was already running), and the freed ranks become replicas.
    Frozen layers count as free: with the cache they cost nothing per step.
    """
    active = list(costs[num_frozen:])
    if world_size % num_stages != 0:
        raise ShardwiseError(f"num_stages={num_stages} must divide the world size {world_size}")
    chosen = num_stages
    if repack:
        fits = [
            s for s in range(1, num_stages + 1)
            if world_size % s == 0 and s <= len(active)
            and max(stage_costs(active, partition(active, s))) <= budget * (1 + 1e-9)
        ]
        chosen = min(fits) if fits else min(num_stages, len(active))
        while world_size % chosen != 0:  # fewer active layers than stages and no fit: shrink to a divisor
            chosen -= 1
    if chosen > len(active):
        raise ShardwiseError(
            f"{len(active)} active layers cannot fill {chosen} stages; freeze fewer layers or allow re-packing"
        )
    bounds = tuple((num_frozen + a, num_frozen + b) for a, b in partition(active, chosen))
    return Layout(num_frozen, bounds, world_size // chosen)

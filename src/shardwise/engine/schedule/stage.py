"""What a zero stage keeps between uses: the one object the units and the engine ask, in place of
flags tested in each method. Uses: nothing of the engine.

Note [stages]: the three zero strategies are one mechanism (flat_unit.py) under three policies:

| stage | full params kept | full grads kept until the step | gathers in flight |
|-------|------------------|--------------------------------|-------------------|
| zero1 | yes              | yes (reduced at the end)       | 1 (re-gathers after a step) |
| zero2 | yes              | no: reduce-scattered per unit  | 1 |
| zero3 | no: per use      | no                             | 2 (the current unit and one prefetched) |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.config import ShardConfig


@dataclass(frozen=True)
class Stage:
    """A zero stage's policy (Note [stages])."""

    name: str
    keeps_full_params: bool
    keeps_full_grads: bool

    @classmethod
    def of(cls, config: ShardConfig) -> Stage:
        return cls(config.strategy, config.keeps_full_params, config.keeps_full_grads)

    @property
    def gathers_in_flight(self) -> int:
        """All-gathers the engine keeps issued ahead of use: zero3 prefetches one unit; zero1/zero2
        one as well, though their full buffers exist anyway (Note [eager re-gathers])."""
        return 1 if self.keeps_full_params else 2

    def aliases_shards(self, compute_dtype: torch.dtype, master_dtype: torch.dtype) -> bool:
        """Whether a shard *is* its rows of the kept full buffer (zero1/zero2 at full precision);
        with a lower compute dtype the fp32 master rows need storage of their own."""
        return self.keeps_full_params and compute_dtype == master_dtype


# Note [eager re-gathers]: zero1/zero2 could issue every re-gather at once, or from the optimizer's
# post-step hook before zero_grad and the next forward's agreement. Tried and not taken (bench GPT,
# 2 ranks, gloo, 3 interleaved rounds, step time of each form over the window of one: at once
# zero2 0.98/1.03/0.99 and zero1 1.04/0.98/0.99; post-step zero2 0.99/1.01/1.06 and zero1
# 1.07/0.97/1.03; `python bench/phases.py --configs zero1,zero2 --against OTHER/src` with the form
# patched into one tree). On two busy cores the gathers' CPU moves, it does not shrink, and the
# post-step form would need the next forward's agreement to check that every rank issued the same
# gathers. Worth measuring again on NCCL, where the gathers leave the CPU.

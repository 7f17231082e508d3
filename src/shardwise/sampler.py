"""`ResumableSampler`: each rank's share of a seeded, per-epoch shuffled order, resumable mid-epoch.

Like torch's `DistributedSampler`, but its position is state: `state_dict()` says
which epoch and how far into it the ranks are, so a checkpoint resumes with the very
next batch (`sw.save(..., sampler=sampler)` then `sw.load(..., sampler=sampler)`).

The epoch's order is one global list (a permutation drawn from `seed + epoch`, padded
by wrapping around, or cut, to a multiple of the world size); rank r takes global
positions r, r + W, r + 2W, ... The saved position is global (samples all ranks have
taken), so a checkpoint also resumes at another world size: the remaining samples are
the same, dealt to the ranks differently.
"""

from __future__ import annotations

import torch
from torch.utils.data import Sampler

from shardwise.dist import get_rank, get_world_size
from shardwise.errors import ShardwiseError


class ResumableSampler(Sampler[int]):
    """Distributed sampler whose position in the epoch is saved and restored.

    `data`: a dataset (anything with `len()`) or its length. `shuffle`: a new permutation
    per epoch from `seed + epoch` (else 0..n-1). `drop_last`: cut the tail so every rank
    gets the same count instead of wrapping around. `rank` / `world_size` default to the
    process group's. When an iteration runs to its end the next epoch begins by itself;
    `set_epoch(e)` jumps to epoch `e` (from its start, unless it is the current epoch).

    The position counts indices handed out. With `DataLoader(num_workers=0)` that is
    exactly the batches consumed; worker processes prefetch ahead, so with them save
    `state_dict(consumed=...)` with the count your loop actually used. Give the
    DataLoader its own `generator=torch.Generator()`: creating a DataLoader iterator
    otherwise draws from torch's global RNG, and a resumed run creates one where the
    uninterrupted run did not, so its random stream would shift.
    """

    state_is_global = True  # its position is over the global order: sw.load re-deals it to any world size

    def __init__(self, data, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 rank: int | None = None, world_size: int | None = None):
        self.num_samples_total = data if isinstance(data, int) else len(data)
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.rank = get_rank() if rank is None else rank
        self.world_size = get_world_size() if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ShardwiseError(f"rank={self.rank} is outside 0..{self.world_size - 1}")
        self.epoch = 0
        self.start = 0  # global position the current epoch resumes from
        self.taken = 0  # indices this rank handed out since `start`

    @property
    def total_size(self) -> int:
        """Global positions per epoch: a multiple of the world size."""
        if self.drop_last:
            return self.num_samples_total // self.world_size * self.world_size
        return -(-self.num_samples_total // self.world_size) * self.world_size

    def __len__(self) -> int:
        """Indices this rank still hands out in the current epoch."""
        return max(0, (self.total_size - self.start - self.rank + self.world_size - 1) // self.world_size)

    def order(self, epoch: int) -> list[int]:
        """The global order of `epoch` (the same on every rank)."""
        n = self.num_samples_total
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            indices = torch.randperm(n, generator=generator).tolist()
        else:
            indices = list(range(n))
        total = self.total_size
        while len(indices) < total:  # wrap around, as DistributedSampler pads
            indices += indices[: total - len(indices)]
        return indices[:total]

    def __iter__(self):
        order = self.order(self.epoch)
        self.taken = 0
        for position in range(self.start + self.rank, len(order), self.world_size):
            self.taken += 1
            yield order[position]
        self.epoch, self.start, self.taken = self.epoch + 1, 0, 0

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its beginning (keeps the position if it is the current epoch)."""
        if epoch != self.epoch:
            self.epoch, self.start, self.taken = epoch, 0, 0

    def state_dict(self, consumed: int | None = None) -> dict:
        """Epoch and global position; `consumed` overrides the indices this rank has used."""
        taken = self.taken if consumed is None else consumed
        return {"epoch": self.epoch, "position": self.start + taken * self.world_size, "seed": self.seed,
                "num_samples": self.num_samples_total, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Resume where `state_dict()` was taken: the next iteration starts at the saved position."""
        _check_state(state)
        if state["num_samples"] != self.num_samples_total:
            raise ShardwiseError(
                f"the saved sampler walked a dataset of {state['num_samples']} samples, this one has "
                f"{self.num_samples_total}: resuming would repeat or skip data. Use the same dataset."
            )
        self.seed, self.shuffle, self.drop_last = state["seed"], state["shuffle"], state["drop_last"]
        self.epoch, self.start, self.taken = state["epoch"], state["position"], 0


def _check_state(state) -> None:
    """Refuse a saved state that would fail later, while iterating (a seed torch cannot take)."""
    kinds = {"epoch": int, "position": int, "seed": int, "num_samples": int, "shuffle": bool, "drop_last": bool}
    bad = [key for key, kind in kinds.items() if not isinstance(state, dict) or type(state.get(key)) is not kind]
    if not bad and not (0 <= state["epoch"] < 2**62 and 0 <= state["position"] < 2**62
                        and -(2**63) <= state["seed"] and state["seed"] + state["epoch"] < 2**64):
        bad = ["epoch, position or seed (out of range)"]
    if bad:
        raise ShardwiseError(f"the saved ResumableSampler state is damaged ({', '.join(bad)}): "
                             f"{str(state)[:120]}. Load an earlier checkpoint.")

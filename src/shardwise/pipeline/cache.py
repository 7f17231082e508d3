"""The activation cache (PipeTransformer's AutoCache) and the sampler it owns.

Once layers [0, k) are frozen their output for a sample never changes, so it is computed
once (the first epoch after the freeze) and read back in every later epoch: the frozen
prefix then costs neither backward (freezing already saves that) nor forward.

The cache lives on each replica's first-stage rank and is keyed by sample index. For it
to hit, a sample must come back to the same replica every epoch, which an ordinary
distributed sampler (a fresh shuffle dealt round-robin) does not do: hence
`StickySampler`, which shuffles within fixed per-replica "homes". Entries go to memory
up to a byte budget, then to a memory-mapped file (`torch.from_file`, any dtype).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable

import torch
from torch import Tensor

from shardwise.errors import ShardwiseError


class StickySampler:
    """Global batches of sample indices in which each sample always lands on the same replica.

    The first `num_homes * (num_samples // num_homes)` samples are dealt to `num_homes`
    homes (sample i to home i % num_homes). Every epoch each home is shuffled from
    (seed, epoch); global batch t is home 0's t-th chunk, then home 1's, and so on.
    Replica r of R takes the contiguous slice r of each global batch, i.e. homes
    [r*H/R, (r+1)*H/R). The global batches depend on (seed, epoch, num_homes) only, never
    on R, so a run that re-packs to more replicas trains on the very same batches.
    """

    def __init__(self, num_samples: int, global_batch_size: int, *, num_homes: int, seed: int = 0,
                 num_replicas: int = 1):
        if num_homes % num_replicas != 0:  # a re-pack's replicas divide the world: each takes whole homes
            raise ShardwiseError(f"num_homes={num_homes} must be a multiple of the {num_replicas} ranks (each "
                                 "replica takes whole homes)")
        if num_homes < 1 or global_batch_size % num_homes != 0:
            raise ShardwiseError(
                f"global_batch_size={global_batch_size} must be a multiple of num_homes={num_homes} "
                "(each home gives every batch the same number of samples)"
            )
        self.num_homes, self.seed = num_homes, seed
        self.global_batch_size = global_batch_size
        self.per_home = num_samples // num_homes
        self.chunk = global_batch_size // num_homes
        if self.per_home < self.chunk:
            raise ShardwiseError(
                f"{num_samples} samples make no full batch of {global_batch_size} over {num_homes} homes"
            )

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per epoch (a home's leftover samples wait for the next shuffle)."""
        return self.per_home // self.chunk

    def batches(self, epoch: int) -> list[Tensor]:
        """Every global batch of `epoch`, as index tensors of `global_batch_size`."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        homes = [
            torch.randperm(self.per_home, generator=generator) * self.num_homes + h for h in range(self.num_homes)
        ]
        return [
            torch.cat([home[t * self.chunk : (t + 1) * self.chunk] for home in homes])
            for t in range(self.steps_per_epoch)
        ]

    def replica_slice(self, batch: Tensor, replica: int, num_replicas: int) -> Tensor:
        """Replica `replica`'s contiguous, equal slice of a global batch."""
        if self.num_homes % num_replicas != 0:
            raise ShardwiseError(f"num_replicas={num_replicas} must divide num_homes={self.num_homes}")
        size = self.global_batch_size // num_replicas
        return batch[replica * size : (replica + 1) * size]

    def replica_of(self, indices: Tensor, num_replicas: int) -> Tensor:
        """The replica each sample index goes to when there are `num_replicas`."""
        return (indices % self.num_homes) // (self.num_homes // num_replicas)

    def samples_per_replica(self, num_replicas: int) -> int:
        """Distinct samples one replica sees (its homes' samples): the most one cache holds."""
        return self.per_home * (self.num_homes // num_replicas)


class ActivationCache:
    """Outputs of the frozen prefix per sample index, in memory up to `memory_bytes`,
    then in a memory-mapped file under `directory` (a fresh temporary directory if None).

    `reset(depth, capacity)` starts over for a prefix of `depth` layers (cached outputs
    of a shorter prefix are not outputs of the longer one); `advance` turns them into
    outputs of a longer prefix by running only the layers frozen since;
    `fetch(indices, compute)` returns every sample's output, computing only the misses.
    """

    def __init__(self, sampler: StickySampler, *, memory_bytes: int, directory: str | None = None):
        if memory_bytes < 0:
            raise ShardwiseError(f"ActivationCache memory_bytes must be >= 0, got {memory_bytes}")
        self.sampler = sampler
        self.memory_bytes = memory_bytes
        self._parent = directory
        self._dir: str | None = None
        self.depth = 0
        self.capacity = 0
        self.hits = self.misses = 0  # samples served from the cache / computed, since it was made
        self._slot_of = self._no_slots()
        self._num_cached = 0
        self._memory: Tensor | None = None
        self._disk: Tensor | None = None

    def reset(self, depth: int, capacity: int) -> None:
        """Forget everything; from now on hold outputs of a `depth`-layer prefix for up to
        `capacity` samples."""
        self.close()
        self.depth, self.capacity = depth, capacity

    def advance(self, depth: int, capacity: int, run_new_layers: Callable[[Tensor], Tensor],
                keep: Callable[[Tensor], Tensor] | None = None, chunk: int = 256) -> None:
        """Hold outputs of a longer, `depth`-layer prefix without recomputing the old one:
        every held output goes through `run_new_layers` (the layers frozen since) and is
        stored again, `chunk` samples at a time; samples for which `keep(indices)` is False
        (another replica's after a re-pack) are dropped."""
        held = torch.nonzero(self._slot_of >= 0).flatten()
        if keep is not None:
            held = held[keep(held)]
        old_slot_of, old_memory, old_disk, old_dir = self._slot_of, self._memory, self._disk, self._dir
        self._dir = None  # the old file stays until everything is read out of it
        self.close()
        self.depth, self.capacity = depth, capacity
        for part in held.split(chunk):
            self._store(part, run_new_layers(_read_slots(old_slot_of[part], old_memory, old_disk)))
        if old_dir is not None:
            shutil.rmtree(old_dir, ignore_errors=True)

    @property
    def num_cached(self) -> int:
        """Samples held."""
        return self._num_cached

    @property
    def bytes_in_memory(self) -> int:
        """Bytes of the in-memory part."""
        return 0 if self._memory is None else self._memory.numel() * self._memory.element_size()

    @property
    def bytes_on_disk(self) -> int:
        """Bytes of the memory-mapped file."""
        return 0 if self._disk is None else self._disk.numel() * self._disk.element_size()

    def lookup(self, indices: Tensor) -> tuple[Tensor | None, Tensor]:
        """(the cached outputs of the hits in order, or None if none hit; a bool mask of hits)."""
        slots = self._slot_of[indices]
        hit = slots >= 0
        if not bool(hit.any()):
            return None, hit
        return _read_slots(slots[hit], self._memory, self._disk), hit

    def fetch(self, indices: Tensor, compute: Callable[[Tensor], Tensor]) -> Tensor:
        """Outputs for `indices`: cached ones read back, the others `compute(missing)`d and stored."""
        cached, hit = self.lookup(indices)
        n_hit = int(hit.sum())
        self.hits += n_hit
        self.misses += len(indices) - n_hit
        if n_hit == len(indices):
            return cached
        missing = indices[~hit]
        fresh = compute(missing)
        self._store(missing, fresh)
        if cached is None:
            return fresh
        out = torch.empty((len(indices), *fresh.shape[1:]), dtype=fresh.dtype)
        out[hit], out[~hit] = cached, fresh
        return out

    def close(self) -> None:
        """Drop every entry and delete the file."""
        self._slot_of, self._num_cached = self._no_slots(), 0
        self._memory, self._disk = None, None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # ---- storage -------------------------------------------------------------

    def _no_slots(self) -> Tensor:
        # Slot of every sample index the sampler can hand out; -1: not cached.
        return torch.full((self.sampler.per_home * self.sampler.num_homes,), -1, dtype=torch.long)

    def _store(self, indices: Tensor, values: Tensor) -> None:
        if self._memory is None:
            self._allocate(values.shape[1:], values.dtype)
        if self.num_cached + len(indices) > self.capacity:
            raise ShardwiseError(
                f"the cache holds {self.capacity} samples and was asked for more: indices must come "
                "from its sampler's slice for this replica"
            )
        slots = torch.arange(self._num_cached, self._num_cached + len(indices))
        self._slot_of[indices] = slots
        self._num_cached += len(indices)
        n_memory = len(self._memory)
        in_memory = slots < n_memory
        self._memory[slots[in_memory]] = values[in_memory]
        self._disk[slots[~in_memory] - n_memory] = values[~in_memory]

    def _allocate(self, sample_shape: torch.Size, dtype: torch.dtype) -> None:
        sample_bytes = max(1, sample_shape.numel() * torch.empty((), dtype=dtype).element_size())
        n_memory = min(self.capacity, self.memory_bytes // sample_bytes)
        self._memory = torch.empty((n_memory, *sample_shape), dtype=dtype)
        n_disk = self.capacity - n_memory
        if n_disk > 0:
            self._dir = tempfile.mkdtemp(prefix="shardwise-cache-", dir=self._parent)
            path = os.path.join(self._dir, f"depth{self.depth}.bin")
            # shared=True maps the file itself (created at this size): writes go to the
            # page cache and on to disk, not to anonymous memory.
            flat = torch.from_file(path, shared=True, size=n_disk * sample_shape.numel(), dtype=dtype)
            self._disk = flat.view(n_disk, *sample_shape)
        else:
            self._disk = torch.empty((0, *sample_shape), dtype=dtype)


def _read_slots(slots: Tensor, memory: Tensor, disk: Tensor) -> Tensor:
    # Slots below len(memory) are in memory, the rest in the file, in slot order.
    n_memory = len(memory)
    in_memory = slots < n_memory
    if bool(in_memory.all()):
        return memory[slots]
    out = torch.empty((len(slots), *memory.shape[1:]), dtype=memory.dtype)
    out[in_memory] = memory[slots[in_memory]]
    out[~in_memory] = disk[slots[~in_memory] - n_memory]
    return out

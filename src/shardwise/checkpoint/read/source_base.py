"""What every `sw.load` source is: `Source` (its tensors, by name, each a `SourceTensor` able to read
any row range; its optimizer, scheduler and object states where it has them) and `SourceNames` (the names
its tensors take, two that become one refused). The sources themselves are in sources.py and hf_dir.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from shardwise.checkpoint.format.records import OptimizerRecord, SliceRecord
from shardwise.errors import ShardwiseError


@dataclass
class SourceTensor:
    """One tensor a source can provide: `read(lo, hi, out)` returns rows lo:hi (into `out` when it can);
    `read_flat(start, stop)`, where the source has it, elements start:stop of the flattened tensor
    (unchecked: `Source.verify` the rows first), so that a row larger than memory is read in parts."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    aliases: tuple[str, ...]
    read: Callable[[int, int, Tensor | None], Tensor]
    slices: tuple[SliceRecord, ...] | None = None  # a checkpoint directory's row slices
    read_flat: Callable[[int, int], Tensor] | None = None


class Source:
    """Base: a source with tensors only (no optimizer, scheduler, RNG or extras)."""

    description = ""
    values_file = ""  # the file its saved settings and states come from (errors name it)
    world_size: int | None = None
    strategy: str | None = None

    def __init__(self) -> None:
        self.tensors: dict[str, SourceTensor] = {}
        self.optimizers: tuple[OptimizerRecord, ...] = ()  # as saved: one, or several (`several`)
        self.several = False
        self.scheduler: dict | None = None
        self.objects: dict = {}
        self.extra: dict = {}
        self.notes: list[str] = []  # what the load report says of the source (LoadReport.notes)

    def optimizer_tensor(self, number: int, name: str, key: str, *, whole: bool = False) -> SourceTensor:
        """Optimizer `number`'s state tensor `key` of parameter `name` (a whole record with `whole`)."""
        raise NotImplementedError

    def rng_of(self, rank: int):
        return None

    def may_be_absent(self, name: str) -> bool:
        """True for a model tensor this source may lack without the load being partial (a Hugging Face
        model's `_keys_to_ignore_on_load_missing`): it keeps its value, the report's notes name it."""
        return False

    def object_state(self, key: str, obj, rank: int, world: int):
        """The saved state of keyword object `key` for `rank` of `world` (Note [object states])."""
        if self.world_size not in (None, world) and not getattr(obj, "state_is_global", False):
            raise ShardwiseError(
                f"{key}= was saved at world size {self.world_size} and is loaded at {world}: its state (a "
                f"{type(obj).__name__}'s) may count positions over each rank's own samples, which another number "
                f"of ranks deals differently. Resume at world size {self.world_size}, or leave {key}= out of "
                "sw.load (its epoch then restarts), or use sw.ResumableSampler, which re-deals the remaining "
                "samples to any number of ranks.")
        by_rank = getattr(self, "objects_by_rank", None)
        if by_rank is None or all(states.get(key) == self.objects[key] for states in by_rank):
            return self.objects[key]
        if rank >= len(by_rank) or key not in by_rank[rank]:
            raise ShardwiseError(f"{self.values_file}: objects_by_rank holds no state of {key}= for rank {rank}: the "
                                 "checkpoint is damaged or was edited. Load an earlier checkpoint, or leave "
                                 f"{key}= out of sw.load.")
        return by_rank[rank][key]

    def verify(self, needs: list[tuple[SourceTensor, int, int]]) -> None:
        """Check, before any of them, that the reads in `needs` will succeed (a checkpoint directory
        reads and checks their chunks); the other sources were checked when opened."""

    def close(self) -> None:
        pass


class SourceNames:
    """The names a source's tensors take after wrapper prefixes are dropped and `rename` applied: two
    source names that become one are refused, naming both (Note [wrapper prefixes] in names.py)."""

    def __init__(self, where) -> None:
        self.where, self.origin = where, {}

    def add(self, name: str, original: str) -> str:
        first = self.origin.setdefault(name, original)
        if first != original:
            raise ShardwiseError(f"{self.where}: {first!r} and {original!r} both become {name!r} once wrapper "
                                 "prefixes (module., _orig_mod., ...) are dropped and rename= applied, so one would "
                                 "silently replace the other. Pass a rename= that keeps them apart, or remove one.")
        return name

    def add_all(self, names: dict[str, str]) -> dict[str, str]:
        """`add` each of `names` ({original: name}) in their order; the same dict back."""
        for original, name in names.items():
            self.add(name, original)
        return names

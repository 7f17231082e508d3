"""What index.json says, as typed records: a checkpoint's tensors, files, optimizers and RNG states.
Reading and checking the file that holds them is schema.py's (Note [index records]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardwise.engine.layout.rows import num_rows

INDEX = "index.json"
FORMAT = "shardwise-checkpoint"
VERSION = 2  # 2: the index carries its digest (Note [index digest])


@dataclass(frozen=True)
class SliceRecord:
    """Rows lo:hi of a tensor, stored as tensor `key` of `file`, with a crc32 per `chunk` rows."""

    file: str
    key: str
    lo: int
    hi: int
    chunk: int
    crcs: tuple[int, ...]


@dataclass(frozen=True)
class TensorRecord:
    """A parameter, buffer or optimizer-state tensor: full shape, dtype, and the slices holding it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    slices: tuple[SliceRecord, ...]
    aliases: tuple[str, ...] = ()
    requires_grad: bool | None = None

    @property
    def rows(self) -> int:
        return num_rows(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class FileRecord:
    nbytes: int
    digest: str


@dataclass(frozen=True)
class GroupRecord:
    params: tuple[str, ...]
    options: dict  # JSON (values.from_json turns it into values)


@dataclass(frozen=True)
class StateRecord:
    """One parameter's optimizer state (Note [optimizer records] in optim_state.py): JSON scalars,
    param-shaped tensors stored as rows, and whole tensors of other shapes (row/column factors, scales)."""

    scalars: dict  # JSON
    tensors: dict[str, TensorRecord]
    whole: dict[str, TensorRecord] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimizerRecord:
    class_name: str
    groups: tuple[GroupRecord, ...]
    state: dict[str, StateRecord]
    name: str | None = None  # its key when several were saved as a dict
    owners: dict[str, int] = field(default_factory=dict)  # whole-tensor owners by name (Note [recorded owners])
    owner_world: int = 0  # the shard group's size the owners were chosen for; 0: none recorded


@dataclass(frozen=True)
class RngRecord:
    """One rank's RNG states: tensors in `file` ({key: (chunk, crcs)}) and JSON scalars."""

    file: str
    tensors: dict[str, tuple[int, tuple[int, ...]]]
    scalars: dict


@dataclass(frozen=True)
class Index:
    path: Path  # the checkpoint directory
    id: str
    saved_at: float
    shardwise_version: str
    torch_version: str
    strategy: str
    world_size: int
    files: dict[str, FileRecord]
    params: dict[str, TensorRecord]
    buffers: dict[str, TensorRecord]
    optimizers: tuple[OptimizerRecord, ...]  # none, one, or several (saved as a list or a dict)
    several: bool  # saved as a list or a dict ("optimizers"), not as one ("optimizer")
    scheduler: dict | None
    rng: tuple[RngRecord, ...]
    objects: dict
    objects_by_rank: tuple[dict, ...] | None
    extra: dict
    order: tuple[int, int] | None = None  # (step, save counter): Note [newest]
    model_config: dict | None = None  # a Hugging Face model's config.json (Note [model config] in model_config.py)
    compression: dict | None = None  # the run's quantized collectives (config.Compression.record), if it used any

    @property
    def newness(self) -> tuple:
        """What orders checkpoints, newest last (Note [newest]): the saver's sequence; `saved_at`
        only between checkpoints saved before shardwise wrote one."""
        return (*(self.order or (-1, -1)), self.saved_at)

"""What the layers above may ask of a sharded model: its `Engine`, its `Sliced` view, and where
each is found. Uses: guards.

Note [engine protocol]: checkpoints, exports, slicing, the estimator and the gradient helpers
reach a model's engine through `engine_of(model)` and ask it only what `Engine` declares; they
never test for an attribute to guess which engine it is (tests/test_layout.py checks that no
module outside engine/ does). A strategy that lands later implements this class and nothing
above the engine changes. Slicing (`sw.slice`, parallel/slicing) is the other thing a model may
carry; the engine and the checkpoints ask it only what `Sliced` declares, found by `slicing_of`.
Both live on the model as plain attributes (not modules: not in `state_dict()`), as FSDP2 keeps
its state beside the module and finds it with `_get_module_fsdp_state`. A sliced parameter's own
record (`SlicedParam`: its dimension, every rank's segments, its full shape) is kept beside the
tensor too, in a table keyed by the parameter object (`record_slice` / `slice_record`), not stamped
on it: the record lives as long as the parameter, follows it through `param.data = ...` and the
engine's in-place class change, and stays with the module's parameter object when torch's
`swap_tensors` moves a tensor's `__dict__` to another object.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from shardwise.engine.guards import NoCopies

if TYPE_CHECKING:
    import torch.distributed as dist

_ENGINE_ATTRIBUTE = "_shardwise"
_SLICING_ATTRIBUTE = "_sw_slicing"


@dataclass(frozen=True)
class ShardInfo:
    """Which rows of a parameter this rank holds, for checkpoints and exports.

    `param` is the registered tensor (for a sharded model: this rank's chunk, padded to
    `rows_per_rank` rows; a 0-D scalar is a 1-row chunk). Rows `row_start:row_end` of
    the full tensor are `param[: row_end - row_start]`; the rest is padding.
    `aliases` are every other name the same parameter is registered under (ties).
    `mesh` (a sharded parameter's) is its unit's parallel_layout.ParallelLayout: its placements, and which of
    its rows a checkpoint writes (Note [mesh info]); None for a whole tensor.
    """

    param: torch.Tensor
    full_shape: torch.Size
    row_start: int
    row_end: int
    aliases: tuple[str, ...]
    mesh: object = None

    @property
    def rows(self) -> torch.Tensor:
        """This rank's real rows (a view of `param`), shaped like the full tensor's rows."""
        if len(self.full_shape) == 0:
            return self.param.reshape(-1)[: self.row_end - self.row_start].reshape(
                () if self.row_end > self.row_start else (0,))
        return self.param[: self.row_end - self.row_start]


class Engine(NoCopies):
    """What every strategy's engine answers (Note [engine protocol]). The defaults are a
    replicating engine's (ddp): whole tensors on every rank, no units."""

    strategy: str  # "ddp", "zero1", "zero2" or "zero3"
    group: dist.ProcessGroup  # the data-parallel group its collectives run on
    shards_rows: bool = False  # True: each rank holds only its rows of each parameter (zero)
    units: tuple = ()  # zero: its units (flat_unit.FlatUnit), root first; ddp: none
    mesh = None  # zero: its ParallelLayout (rows, shard and replicate groups: Note [mesh info]); ddp: none
    store = None  # zero3 with offload="disk:...": the offload.DiskStore holding the master shards
    comm = None  # zero: its comm.context.CommContext (Note [comm context]); ddp: torch's DDP reducer, none here
    compression = None  # zero with compression=: its config.Compression (Note [quantized collectives]); else none

    def no_sync(self) -> AbstractContextManager:
        """A block whose backwards accumulate locally, without the reduce."""
        return nullcontext()

    def keep_gathered(self) -> AbstractContextManager:
        """A block whose units, once gathered, stay whole until a synced backward ends (zero3 across the
        micro-batches of a pipeline step; the other strategies keep whole values anyway)."""
        return nullcontext()

    def shard_info(self) -> dict[str, ShardInfo] | None:
        """This rank's rows of every trainable-strategy parameter; None: whole tensors (info.py's
        generic path)."""
        return None

    def full_parameters(self) -> dict[str, torch.Tensor] | None:
        """Every unit parameter's full value, gathered (a collective); None: the parameters are whole."""
        return None

    def steps_in_backward(self) -> bool:
        """Whether sw.optimizer_in_backward steps the units during backward."""
        return False

    def settle_agreement(self) -> None:
        """Before values leave the engine (a checkpoint): every agreement still in flight compared, the last
        step's included, and the same ShardwiseError on every rank where the ranks differed (Note [headers on
        the device]); nothing where every agreement was confirmed at its phase."""


class Sliced(Protocol):
    """What `sw.slice` attaches (parallel/slicing/api.Slicing), as the engine and checkpoints see it."""

    group: dist.ProcessGroup  # the tensor group the slices span
    rank: int
    world_size: int

    def check_data_group(self, data_group) -> None: ...

    def unslice(self, model: nn.Module, values: dict) -> dict: ...

    def checkpoint_view(self, model: nn.Module, optim=None, *, fill: bool = True): ...

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0): ...


def engine_of(model: nn.Module) -> Engine | None:
    """The engine `shard()` attached, or None for an unsharded model."""
    return model.__dict__.get(_ENGINE_ATTRIBUTE)


def attach_engine(model: nn.Module, engine: Engine) -> None:
    object.__setattr__(model, _ENGINE_ATTRIBUTE, engine)  # a plain attribute: not a module, not state


def slicing_of(model: nn.Module) -> Sliced | None:
    """What `sw.slice` attached to `model`, or None when it is not sliced."""
    return model.__dict__.get(_SLICING_ATTRIBUTE)


# parameter -> its SlicedParam, by identity (a tensor's == is elementwise: weakref's WeakKeyDictionary cannot key on it)
_SLICE_RECORDS = WeakIdKeyDictionary()


def record_slice(param, record) -> None:
    """Keep `sw.slice`'s record of how `param` was cut (slicing's `SlicedParam`) beside it."""
    _SLICE_RECORDS[param] = record


def slice_record(param):
    """The record `sw.slice` kept for `param` (parallel/slicing's `SlicedParam`), or None if it is whole."""
    return _SLICE_RECORDS.get(param)


def is_sliced_param(param) -> bool:
    """Whether `sw.slice` cut `param` across a tensor group."""
    return slice_record(param) is not None


def attach_slicing(model: nn.Module, slicing: Sliced) -> None:
    object.__setattr__(model, _SLICING_ATTRIBUTE, slicing)

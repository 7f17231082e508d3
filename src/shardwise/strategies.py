"""`shard(model, strategy=...)`: the one entry point that applies a strategy in place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.deferred import is_deferred, materialize
from shardwise.precision import MixedPrecision
from shardwise.units import UnitSpec

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def shard(
    model: nn.Module,
    *,
    strategy: str,
    units: UnitSpec = None,
    precision: str | MixedPrecision | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    checkpoint_activations: bool = False,
    offload: str | None = None,
    process_group: dist.ProcessGroup | None = None,
    find_unused_parameters: bool = False,
) -> nn.Module:
    """Apply `strategy` to `model` in place and return the same model object.

    `strategy` is one of "ddp", "zero1", "zero2", "zero3"; changing it changes memory,
    never the result. `units` (zero strategies) sets the grain of communication: a
    module class, a tuple of classes, a callable `module -> bool`, or None for each
    child of the largest `nn.ModuleList`; the root is always a unit. After it,
    `model.named_parameters()` yields this rank's shards under the original names, so
    any torch optimizer with ordinary param groups steps only shards.
    `precision` (zero strategies): "fp32" (default), "bf16", "fp16" or a
    `MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)`; shards stay fp32 masters.
    A model built under `sw.deferred_init()` is materialized here, one parameter at a
    time, each rank keeping its rows; its values equal eager init with the same seed.
    `init_fn(model)`, if given, initializes it further (recorded and replayed the same way).
    `checkpoint_activations` (zero strategies) recomputes each non-root unit's forward in
    backward instead of keeping its activations; results are unchanged.
    `offload="disk:PATH"` (zero3) keeps the fp32 master shards and the optimizer state
    in memory-mapped files under PATH and steps the optimizer one unit at a time. `process_group` defaults to the group `sw.init()` formed.
    `find_unused_parameters` (ddp only) must be True when some trainable parameter
    gets no gradient in some step (an unused branch); shardwise raises a clear error
    at the next step when it was needed and not given.
    """
    if strategy not in STRATEGIES:
        raise ShardwiseError(f"strategy={strategy!r} is not one of {STRATEGIES}")
    if getattr(model, "_shardwise", None) is not None:
        raise ShardwiseError(
            f"this model is already sharded with strategy={model._shardwise.strategy!r}; "
            "build a fresh model (or load a checkpoint into one) to change strategy"
        )
    if not dist.is_initialized():
        raise ShardwiseError("no process group: call `sw.init()` before `sw.shard(...)`")
    if strategy == "ddp":
        from shardwise._ddp import apply_ddp

        if precision not in (None, "fp32"):
            raise ShardwiseError(
                "precision is a zero-strategy option; with strategy='ddp' use torch.autocast around the forward"
            )
        if offload is not None:
            raise ShardwiseError("offload needs strategy='zero3'; ddp keeps everything in memory")
        if checkpoint_activations:
            raise ShardwiseError("checkpoint_activations needs units: use a zero strategy, or "
                                 "torch.utils.checkpoint inside the model with ddp")
        if is_deferred(model):
            materialize(model, init_fn)  # ddp holds the full model anyway
        state = apply_ddp(model, process_group, find_unused_parameters)
    else:
        from shardwise._zero import apply_zero

        if find_unused_parameters:
            raise ShardwiseError(
                "find_unused_parameters is a ddp option; the zero strategies handle unused parameters themselves"
            )
        state = apply_zero(model, strategy, units, process_group, precision, init_fn, checkpoint_activations,
                           offload)
    model._shardwise = state  # a plain attribute: not a module, so not in state_dict()
    return model


def state_of(model: nn.Module):
    """The strategy state `shard()` attached, or None for an unsharded model."""
    return getattr(model, "_shardwise", None)


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value under its original name, on every rank (a copy).

    For a sharded model this gathers the rows of all ranks, so it is a collective:
    call it on every rank. Meant for tests and small models; checkpoints stream instead.
    """
    state = state_of(model)
    if state is not None and hasattr(state, "full_parameters"):
        return state.full_parameters()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@dataclass(frozen=True)
class ShardInfo:
    """Which rows of a parameter this rank holds, for checkpoints and exports.

    `param` is the registered tensor (for a sharded model: this rank's chunk, padded to
    `rows_per_rank` rows; a 0-D scalar is a 1-row chunk). Rows `row_start:row_end` of
    the full tensor are `param[: row_end - row_start]`; the rest is padding.
    `aliases` are every other name the same parameter is registered under (ties).
    """

    param: torch.Tensor
    full_shape: torch.Size
    row_start: int
    row_end: int
    aliases: tuple[str, ...]

    @property
    def rows(self) -> torch.Tensor:
        """This rank's real rows (a view of `param`), shaped like the full tensor's rows."""
        if len(self.full_shape) == 0:
            return self.param.reshape(-1)[: self.row_end - self.row_start].reshape(
                () if self.row_end > self.row_start else (0,))
        return self.param[: self.row_end - self.row_start]


def shard_info(model: nn.Module) -> dict[str, ShardInfo]:
    """Every distinct parameter's shard on this rank, by its first name (as `named_parameters`)."""
    state = state_of(model)
    if state is not None and hasattr(state, "shard_info"):
        return state.shard_info()
    names_by_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_param.setdefault(id(param), []).append(name)
    info = {}
    for name, param in model.named_parameters():
        rows = param.shape[0] if param.dim() else 1
        info[name] = ShardInfo(param, param.shape, 0, rows, tuple(names_by_param[id(param)][1:]))
    return info

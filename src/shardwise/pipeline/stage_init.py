"""Only your stage's layers: a pipeline built under `sw.deferred_init()` materializes, on each rank, its
own stage's layers and only its rows of them.

Note [stage init]: a model built under `sw.deferred_init()` holds meta parameters and a recorded log of
its initialization (Note [init replay], engine/init/deferred.py). Each rank shards its stage's module with
`sw.shard`, which replays that log on real tensors and hands each parameter of the stage to the engine as
soon as its final value exists; the engine keeps this rank's rows and lets the rest go. The other stages'
parameters are never delivered: their initializing operations run (every random draw happens in the
eager order, so the values equal eager init with the same seed, at any layout), each on one tensor that is
freed at its last use, and their parameters stay on the meta device. So a rank's peak while the pipeline
is built is its stage's shards plus one tensor (the parameter being made real, of its stage or another),
not the model: a model that fits only across the ranks is built without ever existing whole on one.

Every rank replays the same log from the same random state, so the values agree without the broadcast
from rank 0 that an eagerly built pipeline starts with (the same seed on every rank, as for `sw.shard`).
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.engine import shard
from shardwise.errors import ShardwiseError


def deferred_stages(params: dict[str, nn.Parameter], strategy: str | None, balance) -> bool:
    """Whether the chain's `params` were built under `sw.deferred_init()` (all of them on meta), refusing
    what such a pipeline cannot do: some parameters real and others not, a whole copy on every rank
    (strategy None), and balancing by measured time (the layers have no values to run)."""
    meta = [name for name, p in params.items() if p.device.type == "meta"]
    if not meta:
        return False
    if len(meta) != len(params):
        real = sorted(set(params) - set(meta))[:3]
        raise ShardwiseError(f"the pipeline's model is partly on the meta device ({len(meta)} of {len(params)} "
                             f"parameters; real: {real}): build the whole model inside `sw.deferred_init()`, "
                             "or none of it")
    if strategy is None:
        raise ShardwiseError("a model built under `sw.deferred_init()` needs sharded stages: strategy=None keeps a "
                             "whole copy of every layer on every rank. Pass PipelineConfig(strategy='zero1', "
                             "'zero2' or 'zero3'), or build the model eagerly")
    if balance == "time":
        raise ShardwiseError("PipelineConfig(balance='time') measures each layer's forward and backward, which a "
                             "model built under `sw.deferred_init()` cannot run before it is sharded: use "
                             "balance='params' or give per-layer costs")
    return True


def stage_device(params: dict[str, nn.Parameter]) -> torch.device:
    """Where the stages run: the model's device, or the CPU for a model still on meta (Note [stage init])."""
    device = next(iter(params.values())).device
    return torch.device("cpu") if device.type == "meta" else device


def shard_stage_module(module: nn.Module, strategy: str, units: list[nn.Module], shard_arguments: dict,
                       shard_options: dict) -> None:
    """Shard this rank's stage `module` (its layers `units`) in place; built under `sw.deferred_init()`, only
    its rows of the stage's layers become real (Note [stage init])."""
    deferred = any(p.device.type == "meta" for p in module.parameters())
    shard(module, strategy=strategy, units=units, **shard_arguments, **shard_options)
    if deferred:
        left = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.device.type == "meta"]
        if left:
            raise ShardwiseError(f"the stage's {left[:3]} stayed on the meta device after sharding: the model's "
                                 "recorded initialization never wrote them (build them inside "
                                 "`sw.deferred_init()` with the rest of the model)")

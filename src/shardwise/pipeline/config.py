"""How a pipeline runs (`PipelineConfig`), what an epoch reports (`EpochStats`), and the optimizer
factory the trainer calls for each rank's parameters (`grouped_adamw`), and the ranks' agreement on
how (`check_same_pipeline`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from shardwise.engine.schedule.consistency import check_same_options
from shardwise.errors import ShardwiseError
from shardwise.wire.canonical import PER_RANK

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}

# Builds a rank's optimizer from its trainable parameters, as (model name, parameter).
OptimizerFactory = Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]


@dataclass(frozen=True)
class PipelineConfig:
    """How to run the pipeline.

    `num_stages`: pipeline length at the start (must divide the world size; the other
    factor is the number of data-parallel replicas). `num_microbatches` per replica per
    step at the start; a re-packed, shorter pipeline keeps the micro-batch size (its
    bubble shrinks with it), so it runs num_microbatches x new / old stages of them.
    `schedule`: "gpipe" or "1f1b". `balance`: cut stages by "params" (parameter count),
    "time" (measured forward + backward per layer), or a list of per-layer costs.
    `repack`: when the frozen prefix grows, run the active layers on fewer stages and
    use the freed ranks as replicas. `cache`: keep the frozen prefix's outputs per sample
    (`cache_memory_bytes` in memory per rank, the rest in a file under `cache_dir`).
    `strategy`: None keeps a whole copy of every layer on every rank (freezing and re-packing move whole
    layers); "zero1", "zero2" or "zero3" shards each stage's layers over the stage's data-parallel ranks
    with the engine (Note [sharded stages], sharded.py), and a re-pack re-cuts their rows and optimizer rows
    over the new layout (Note [re-pack through the layout], repack.py; with repack=False sharded layers
    freeze in place, without the cache). `shards`: ranks each stage's layers are cut over
    (None: all of the stage's ranks; fewer: replicas of `shards` ranks each, replicate x shard).
    `keep_gathered` (zero3): a unit stays gathered across a step's micro-batches (one gather per unit per
    step) rather than gathered again for each (less memory).
    """

    num_stages: int
    num_microbatches: int = 4
    schedule: str = "1f1b"
    balance: str | tuple[float, ...] = "params"
    repack: bool = True
    cache: bool = True
    cache_memory_bytes: int = 1 << 30
    cache_dir: str | None = field(default=None, metadata={PER_RANK: True})  # a rank's own disk may hold it
    strategy: str | None = None
    shards: int | None = None
    keep_gathered: bool = True

    def __post_init__(self) -> None:
        for name in ("num_stages", "num_microbatches", "cache_memory_bytes", "shards"):
            value = getattr(self, name)
            if (value is not None or name != "shards") and (isinstance(value, bool) or not isinstance(value, int)):
                raise ShardwiseError(f"PipelineConfig.{name}={value!r} must be an int")
        if self.cache_memory_bytes < 0:
            raise ShardwiseError(f"PipelineConfig.cache_memory_bytes={self.cache_memory_bytes} must be >= 0 (bytes of "
                                 "cached activations kept in memory per rank; 0 keeps them all in the file)")
        if not isinstance(self.balance, str) and not all(
                isinstance(cost, (int, float)) and not isinstance(cost, bool) and math.isfinite(cost) and cost >= 0
                for cost in self.balance):
            raise ShardwiseError(f"PipelineConfig.balance={self.balance!r}: per-layer costs are finite numbers >= 0 "
                                 "(or use 'params' or 'time')")
        if self.num_stages < 1:
            raise ShardwiseError(f"PipelineConfig.num_stages must be >= 1, got {self.num_stages}")
        if self.schedule not in SCHEDULES:
            raise ShardwiseError(f"PipelineConfig.schedule must be one of {sorted(SCHEDULES)}, got {self.schedule!r}")
        if self.schedule == "1f1b" and self.num_microbatches < self.num_stages:
            raise ShardwiseError(
                f"PipelineConfig: 1f1b needs num_microbatches ({self.num_microbatches}) >= num_stages "
                f"({self.num_stages}); raise num_microbatches or use schedule='gpipe'"
            )
        if self.num_microbatches < 1:
            raise ShardwiseError(f"PipelineConfig.num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.strategy not in (None, "zero1", "zero2", "zero3"):
            raise ShardwiseError(f"PipelineConfig.strategy must be None (whole layers on every rank), 'zero1', "
                                 f"'zero2' or 'zero3', got {self.strategy!r}")
        if self.shards is not None and (self.strategy is None or self.shards < 1):
            raise ShardwiseError(f"PipelineConfig.shards={self.shards!r} needs a zero strategy and is >= 1 (the "
                                 "ranks each stage's layers are cut over)")
        if isinstance(self.balance, str) and self.balance not in ("params", "time"):
            raise ShardwiseError(
                f"PipelineConfig.balance must be 'params', 'time' or per-layer costs, got {self.balance!r}"
            )


def check_same_pipeline(arguments: dict, group) -> None:
    """Refuse, on every rank alike and naming the field and each rank's value, ranks whose `PipeTrainer` was
    built with different `arguments` (every one, its `PipelineConfig` field by field: Note [options by
    construction], wire/canonical.py). Ranks with another num_stages, schedule or num_microbatches raised a
    ValueError on one rank while the other's peer closed, or hung until the group's timeout."""
    layers = {id(layer): f"layer {i}" for i, layer in enumerate(arguments["chain"].layers)}
    group_ranks = [dist.get_global_rank(group, rank) for rank in range(dist.get_world_size(group))]
    check_same_options("PipeTrainer options", {**arguments, "group": f"ranks {group_ranks}"}, group,
                       {"config": "Build the same PipelineConfig on every rank (from the same code and arguments)",
                        "chain": "Build the same model and LayerChain on every rank"}, layers)


@dataclass
class EpochStats:
    """One epoch: mean loss over its steps, wall seconds (including any freeze and
    re-pack at its end), and the layout it ran under."""

    epoch: int
    loss: float
    seconds: float
    num_frozen: int
    num_stages: int
    num_replicas: int
    cache_hits: int = 0
    cache_misses: int = 0
    losses: list[float] = field(default_factory=list, repr=False)


def grouped_adamw(lr: Sequence[float] = (1e-2, 3e-3), weight_decay: Sequence[float] = (0.1, 0.0),
                  eps: float = 1e-8) -> OptimizerFactory:
    """An `OptimizerFactory`: AdamW with matrices (ndim >= 2) in a decayed group and the rest
    (biases, norms) in an undecayed one, each with its own lr."""

    def make(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        decay = [p for _, p in named if p.ndim >= 2]
        rest = [p for _, p in named if p.ndim < 2]
        groups = [{"params": decay, "lr": lr[0], "weight_decay": weight_decay[0]},
                  {"params": rest, "lr": lr[1], "weight_decay": weight_decay[1]}]
        return torch.optim.AdamW([g for g in groups if g["params"]], eps=eps)

    return make

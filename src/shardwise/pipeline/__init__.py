"""Pipeline training with progressive layer freezing (PipeTransformer): stages over ranks
with GPipe / 1F1B micro-batch schedules (torch.distributed.pipelining), a freeze policy,
an activation cache for the frozen prefix, and re-packing of the active layers onto fewer
stages with the freed ranks as data-parallel replicas.

Read in this order: layers.py (a model as a chain of layers, tied parameters), layout.py
(which rank runs what; balance.py cuts the stages), trainer.py (one step; freeze and
re-pack), config.py, sharded.py (stages sharded by the engine), repack.py (re-packing them),
checkpoint/ (their checkpoints, in any layout, and what they record of the run), _moves.py (the
collectives outside the schedule), freeze.py, cache.py.
"""

from shardwise.pipeline.balance import measure_layer_times, param_costs, partition
from shardwise.pipeline.cache import ActivationCache, StickySampler
from shardwise.pipeline.checkpoint import load_pipeline, load_stages, save_pipeline, save_stages
from shardwise.pipeline.config import EpochStats, PipelineConfig, grouped_adamw
from shardwise.pipeline.freeze import FreezePolicy
from shardwise.pipeline.layers import LayerChain, chain_layers
from shardwise.pipeline.layout import Layout, plan_layout
from shardwise.pipeline.sharded import ShardedStage
from shardwise.pipeline.trainer import PipeTrainer

__all__ = [
    "ActivationCache",
    "EpochStats",
    "FreezePolicy",
    "LayerChain",
    "Layout",
    "PipeTrainer",
    "PipelineConfig",
    "ShardedStage",
    "StickySampler",
    "chain_layers",
    "load_pipeline",
    "load_stages",
    "grouped_adamw",
    "measure_layer_times",
    "param_costs",
    "partition",
    "plan_layout",
    "save_pipeline",
    "save_stages",
]

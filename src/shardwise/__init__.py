"""shardwise: sharded data-parallel training that keeps parameter sharing exact.

Public API only; see README.md for the files to read in order.
"""

from shardwise.dist import get_rank, get_world_size, init, is_main, shutdown
from shardwise.errors import ShardwiseError
from shardwise.estimate import MemoryEstimate, estimate, plan
from shardwise.grads import clip_grad_norm_, no_sync
from shardwise.deferred import deferred_init
from shardwise.precision import LossScaler, MixedPrecision
from shardwise.strategies import STRATEGIES, ShardInfo, full_parameters, shard, shard_info
from shardwise.checkpoint import LoadReport, export, latest, load, save
from shardwise._ckpt_dcp import dcp_state_dict
from shardwise.sampler import ResumableSampler

__version__ = "0.1.0"

__all__ = [
    "LossScaler",
    "MixedPrecision",
    "LoadReport",
    "MemoryEstimate",
    "ResumableSampler",
    "STRATEGIES",
    "ShardInfo",
    "ShardwiseError",
    "clip_grad_norm_",
    "dcp_state_dict",
    "estimate",
    "deferred_init",
    "export",
    "full_parameters",
    "get_rank",
    "get_world_size",
    "init",
    "is_main",
    "latest",
    "load",
    "no_sync",
    "plan",
    "save",
    "shard",
    "shard_info",
    "shutdown",
]

"""shardwise: sharded data-parallel training that keeps parameter sharing exact.

Public API only; see docs/index.md ("Reading the code") for the files to read in order. The tree is the
architecture: config.py (the options, each rule once) → engine/ (shard() and what it
drives) → checkpoint/, estimate/, pipeline/ (built on the engine) → cli/ and demo.py.
"""

from shardwise._version import __version__
from shardwise.checkpoint import (
    LoadReport,
    PendingSave,
    dcp_state_dict,
    export,
    from_pretrained,
    full_state_dict,
    latest,
    load,
    save,
    save_async,
    save_pretrained,
)
from shardwise.config import (
    STRATEGIES,
    Compression,
    DiskOffload,
    HostFrozen,
    HostOffload,
    MixedPrecision,
    ShardConfig,
)
from shardwise.dist import get_rank, get_world_size, init, is_main, shutdown
from shardwise.ema import EMA
from shardwise.engine import ShardInfo, full_parameters, shard, shard_info
from shardwise.engine.describe import UnitTable, describe
from shardwise.engine.init.deferred import deferred_init
from shardwise.engine.memory.precision import LossScaler
from shardwise.engine.optim.grads import clip_grad_norm_, grad_norms, no_sync, param_norms
from shardwise.engine.optim.step_in_backward import optimizer_in_backward
from shardwise.errors import ShardwiseError, ShardwiseWarning
from shardwise.estimate import MemoryEstimate, estimate, estimate_pipe, max_model, plan
from shardwise.parallel import HogwildResult, Slice, SlicedLogits, gather_logits, hogwild, slice, sliced_cross_entropy
from shardwise.sampler import ResumableSampler

__all__ = [
    "Compression",
    "DiskOffload",
    "EMA",
    "HogwildResult",
    "HostFrozen",
    "HostOffload",
    "LoadReport",
    "PendingSave",
    "LossScaler",
    "MemoryEstimate",
    "MixedPrecision",
    "ResumableSampler",
    "STRATEGIES",
    "ShardConfig",
    "ShardInfo",
    "ShardwiseError",
    "ShardwiseWarning",
    "Slice",
    "SlicedLogits",
    "UnitTable",
    "__version__",
    "clip_grad_norm_",
    "dcp_state_dict",
    "deferred_init",
    "describe",
    "estimate",
    "estimate_pipe",
    "export",
    "from_pretrained",
    "full_parameters",
    "full_state_dict",
    "gather_logits",
    "grad_norms",
    "get_rank",
    "get_world_size",
    "hogwild",
    "init",
    "is_main",
    "latest",
    "load",
    "max_model",
    "no_sync",
    "optimizer_in_backward",
    "param_norms",
    "plan",
    "save",
    "save_async",
    "save_pretrained",
    "shard",
    "shard_info",
    "shutdown",
    "slice",
    "sliced_cross_entropy",
]

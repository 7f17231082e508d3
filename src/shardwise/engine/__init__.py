"""The engine: `shard()` and everything below it (units, flat units, the zero and ddp
policies, collectives, precision, offload, deferred init, gradient helpers).

Read in this order: api.py (the entry point) → units.py (who owns a shared parameter)
→ flat_unit.py (one unit's shards and its lifecycle) → zero.py (the hooks that drive
it) → collectives.py. The engine imports nothing from checkpoint, estimate, pipeline,
models, cli or demo (tests/test_layout.py).
"""

from shardwise.engine.api import shard
from shardwise.engine.info import ShardInfo, engine_of, full_parameters, shard_info

__all__ = ["ShardInfo", "engine_of", "full_parameters", "shard", "shard_info"]

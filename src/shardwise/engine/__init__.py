"""The engine: `shard()` and everything below it (units, flat units, the zero and ddp
policies, collectives, precision, offload, deferred init, gradient helpers).

Read in this order: api.py (the entry point) → protocol.py (what the layers above may ask of
an engine, Note [engine protocol]) → units.py (who owns a shared parameter) → stage.py (what
each zero stage keeps) → flat_unit.py (one unit's shards and its lifecycle) → unit_grads.py
(its gradients) → zero.py (the hooks that drive it) → gather_schedule.py and reducer.py (the
order of its collectives) → collectives.py. Each module's docstring names the engine modules
it uses (tests/test_layout.py). The engine imports nothing from checkpoint, estimate,
pipeline, models, cli or demo (tests/test_layout.py).
"""

from shardwise.engine.api import shard
from shardwise.engine.info import ShardInfo, full_parameters, shard_info
from shardwise.engine.protocol import Engine, engine_of, slicing_of

__all__ = ["Engine", "ShardInfo", "engine_of", "full_parameters", "shard", "shard_info", "slicing_of"]

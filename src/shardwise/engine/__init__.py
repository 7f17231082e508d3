"""The engine: `shard()` and everything below it, in subpackages by concept.

Read in this order: api.py (the entry point) → protocol.py (what the layers above may ask of
an engine, Note [engine protocol]) → layout/ (the parallel layout: ranks, groups, rows) →
unit/ (units, their flat shards, lifecycle and stage policies) → schedule/ (the window, the
order of gathers and reduces, the agreement) → zero.py (the step driver: the hooks that call
them) → comm/ (the collectives) → optim/ (the optimizer's side) → memory/ (precision, offload,
host copies) → init/ (set-up: the units built, deferred init). ddp.py delegates to torch's DDP;
describe.py and state_dict.py are the user-facing views; phase.py is the engine's clock. Each
package's docstring gives its reading order; each module's names the engine modules it uses
(tests/test_layout.py). Imports between the subpackages point down only, in the order
compat/guards/phase → protocol → layout → comm → memory → unit → schedule → optim → init →
state_dict/describe/ddp → zero → api (SUBPACKAGE_ORDER, tests/test_layout.py). The engine imports
nothing from checkpoint, estimate, pipeline, models, cli or demo (tests/test_layout.py).
"""

from shardwise.engine.api import shard
from shardwise.engine.protocol import Engine, engine_of, slicing_of
from shardwise.engine.unit.info import ShardInfo, full_parameters, shard_info

__all__ = ["Engine", "ShardInfo", "engine_of", "full_parameters", "shard", "shard_info", "slicing_of"]

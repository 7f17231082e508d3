"""Parallel training beyond the data-parallel strategies: Hogwild (lock-free updates of shared parameters).

The host-shared frozen weights (`shard(..., frozen="host")`) live in the engine
(engine/host_copy.py), since `shard()` applies them before any strategy.
"""

from shardwise.parallel.hogwild import HogwildResult, hogwild

__all__ = ["HogwildResult", "hogwild"]

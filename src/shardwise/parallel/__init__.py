"""Parallel training beyond the data-parallel strategies: slicing layers across ranks (tensor
parallelism, slicing/), and Hogwild (lock-free updates of shared parameters).

The host-shared frozen weights (`shard(..., frozen="host")`) live in the engine
(engine/memory/host_copy.py), since `shard()` applies them before any strategy.
"""

from shardwise.parallel.hogwild import HogwildResult, hogwild
from shardwise.parallel.slicing import Slice, SlicedLogits, gather_logits, slice, sliced_cross_entropy

__all__ = ["HogwildResult", "Slice", "SlicedLogits", "gather_logits", "hogwild", "slice", "sliced_cross_entropy"]

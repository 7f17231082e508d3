"""Slicing (tensor parallelism): layers cut across the ranks of a tensor group, composable with
zero3 over a data group on a 2-D mesh.

Read in this order: api.py (`sw.slice`, Note [slice then shard]) → plan.py (the plan format,
Note [dealing a dimension]) → layers.py (one module sliced, Note [sliced parameters]) →
comm.py (Note [f and g]) → loss.py (Note [sliced logits]) → auto.py (plans found from the
model) → full.py (unsliced values) → traffic.py (bytes moved per step).
"""

from shardwise.parallel.slicing.api import Slicing, slice
from shardwise.parallel.slicing.loss import SlicedLogits, gather_logits, sliced_cross_entropy
from shardwise.parallel.slicing.plan import Slice

__all__ = ["Slice", "SlicedLogits", "Slicing", "gather_logits", "slice", "sliced_cross_entropy"]

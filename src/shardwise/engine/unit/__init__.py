"""A unit: the grain of communication, its parameters as flat shards and its lifecycle.

Read in this order: units.py (who owns a shared parameter) → unit_choice.py (which modules are
units by default) → flat_unit.py (one unit's shards, full views, gather and free) → residency.py
(its lifecycle) → freshness.py (zero1/zero2: which parameters to re-gather) → shard_storage.py
(where the master rows live at each precision) → shard_param.py (what a registered shard is) →
unit_grads.py (its gradients) → param_layout.py (where each parameter's rows sit in the flat buffers) →
stage.py (the zero1/zero2/zero3 policies that pick the parts above) → info.py (what `sw.shard_info` reports).
How a model's units are built is set-up's (init/sharding.py).
"""

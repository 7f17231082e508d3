"""Set-up: a model's parameters turned into units of shards, one unit at a time, and deferred
(meta-device) initialization, a model built without memory and materialized by `shard()`.

Read in this order: sharding.py (the units built; eager values from rank 0 or the init replayed) →
deferred.py (recording and replaying a model's init).
"""

"""Deferred (meta-device) initialization: a model built without memory, materialized one unit
at a time by `shard()`.

Read: deferred.py.
"""

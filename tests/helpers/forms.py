"""Forcing the engine's collective forms inside a rank, restored afterwards: rank processes are
pooled across tests, so a module constant left changed would switch the form of later tests."""

from __future__ import annotations

import contextlib

import shardwise.engine.comm.collectives as coll


@contextlib.contextmanager
def coll_threshold(bytes_per_rank: int, in_place_from: int | None = None):
    """Reduces whose rows per rank reach `bytes_per_rank` take gloo's form (an all-to-all each rank sums;
    zero1's into its kept gradients), 0: all of them (Note [gloo collectives]); gathers broadcast a
    parameter's rows straight into place from `in_place_from` bytes per rank (the same when None;
    Note [gathered in place])."""
    in_place_from = bytes_per_rank if in_place_from is None else in_place_from
    previous = coll.GLOO_FORMS_FROM_BYTES, coll.GLOO_IN_PLACE_FROM_BYTES
    coll.GLOO_FORMS_FROM_BYTES, coll.GLOO_IN_PLACE_FROM_BYTES = bytes_per_rank, in_place_from
    try:
        yield
    finally:
        coll.GLOO_FORMS_FROM_BYTES, coll.GLOO_IN_PLACE_FROM_BYTES = previous

"""Shared fixtures: one pool of real gloo ranks for the whole session (see helpers/harness.py)."""

import pytest

from helpers.harness import RankPool


@pytest.fixture(scope="session")
def ranks():
    """`ranks.run(fn, world_size, *args, timeout=...)` runs `fn` on real gloo ranks."""
    pool = RankPool(size=4)
    yield pool
    pool.close()

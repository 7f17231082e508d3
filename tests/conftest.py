"""Shared fixtures: one pool of real gloo ranks for the whole session (see helpers/harness.py)."""

import pytest

from helpers.harness import RankPool

pytest_plugins = ["helpers.damage"]  # the `small` checkpoint of the hostile and fuzz tests


@pytest.fixture(scope="session")
def ranks():
    """`ranks.run(fn, world_size, *args, timeout=...)` runs `fn` on real gloo ranks."""
    pool = RankPool(size=4)
    yield pool
    pool.close()

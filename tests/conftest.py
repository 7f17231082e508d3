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


@pytest.fixture(autouse=True)
def no_group_left_behind():
    """Each test's default process group ends with it. A test that calls sw.init() in this process
    (a one-rank group) and never shuts down left the group to whichever test ran next, whose own
    init_process_group then failed ("initialize the default process group twice"): in that order
    only (tests/test_cli_grammar.py before tests/test_compat.py). tests/test_harness.py runs that order."""
    import torch.distributed as dist

    had_group = dist.is_initialized()
    yield
    if not had_group and dist.is_initialized():
        from shardwise.dist import shutdown

        shutdown()

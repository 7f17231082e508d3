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


# The longest files first (their share of a full run, most first), so that under `make test`'s two
# workers (pytest-xdist, whole files each) neither is left running one long file after the other ends:
# in alphabetical order the last 4.5 of 18.5 minutes ran on one worker. Tests inside a file keep their order.
LONGEST_FIRST = ("test_doc_blocks.py", "test_examples.py", "test_zero_parity.py", "test_restarts.py",
                 "test_compile.py", "test_hogwild.py", "test_lightning.py", "test_trainer.py",
                 "test_accelerate.py", "test_checkpoint_fuzz.py", "test_slicing.py", "test_pipe_stages.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order

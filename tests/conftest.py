"""Shared fixtures: one pool of real gloo ranks for the whole session (see helpers/harness.py)."""

import os

import pytest

from helpers.harness import RankPool

# Every rank and every launched job poisons the memory a zero3 gather is about to fill (Note [poisoned
# memory], engine/comm/context.py): a read before the gather lands shows as NaN, not as old values.
os.environ.setdefault("SHARDWISE_POISON_FREED", "1")

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


# The longest files first (their share of a full run, most first: `--durations=0` of a whole run, summed
# per file), so that under `make test`'s two workers (pytest-xdist, whole files each, in this order:
# the Makefile passes --no-loadscope-reorder, else xdist orders files by their count of tests and the
# launch-heavy files of few tests came last) neither is left running one long file after the other ends.
# Tests inside a file keep their order.
LONGEST_FIRST = ("test_doc_blocks.py", "test_zero_parity.py", "test_examples.py", "test_data_resume.py",
                 "test_exit.py", "test_lightning.py", "test_restarts.py", "test_compile.py", "test_accelerate.py",
                 "test_optimizers.py", "test_hsdp.py", "test_deferred.py", "test_slicing.py", "test_estimate.py",
                 "test_dist.py", "test_launch_helpers.py", "test_optimizer_in_backward.py", "test_estimate_probe.py",
                 "test_pipe_memory.py", "test_compression.py", "test_checkpoint.py", "test_precision.py",
                 "test_fake_gpu.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order

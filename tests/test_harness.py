"""The distributed test harness itself: results, errors and hangs come back with the rank named."""

import time

import pytest
import torch
import torch.distributed as dist

from helpers.harness import RankFailed, RankTimeout


def _all_reduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), torch.get_num_threads()


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 waits for a peer that never comes
    return "unreachable"


def _hang_on_rank_one():
    if dist.get_rank() == 1:
        _sleep_forever()
    return "done"


def _sleep_forever():
    while True:
        time.sleep(0.1)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_by_rank(ranks, world_size):
    """Catches a harness that loses, reorders or fakes rank results, or skips set_num_threads(1)."""
    results = ranks.run(_all_reduce_rank, world_size)
    expected_sum = sum(range(world_size))
    assert results == [(r, world_size, expected_sum, 1) for r in range(world_size)]


def _raise_threads():
    torch.set_num_threads(2)
    return torch.get_num_threads()


def test_each_call_starts_at_one_thread(ranks):
    """Catches a pool that keeps the thread count an earlier call left (found when `make test` first ran
    files in another order, under two pytest workers): every call runs one thread per rank."""
    assert ranks.run(_raise_threads, 2) == [2, 2]
    assert [result[3] for result in ranks.run(_all_reduce_rank, 2)] == [1, 1]


def test_rank_exception_is_reraised_with_its_traceback(ranks):
    """Catches a harness that swallows a rank's error or hangs on the peers it left behind."""
    with pytest.raises(RankFailed, match=r"(?s)rank 1 of 2 raised.*ValueError: boom from rank one"):
        ranks.run(_raise_on_rank_one, 2, timeout=60)
    assert ranks.run(_all_reduce_rank, 2)[0][2] == 1.0  # the pool recovers


def test_hung_rank_fails_within_timeout_and_is_named(ranks):
    """Catches a hang that never ends, or a timeout report that does not say which rank was where; and a
    timeout that counts a fresh pool's start (CI's loaded host: rank 0 still in the fork server after 5 s,
    Note [ready before the clock]): the pool is killed first, so the 5 s call starts a fresh one."""
    ranks.close()
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        ranks.run(_hang_on_rank_one, 2, timeout=5)
    assert time.monotonic() - start < 15 + 60  # the call's 5 s, the stack dump, a fresh pool's start
    message = str(info.value)
    assert "rank(s) [1] of 2" in message
    assert "_sleep_forever" in message  # the stack shows where rank 1 was
    assert ranks.run(_all_reduce_rank, 2)[1][2] == 1.0  # a fresh pool replaces the killed one



ORDER = """
import torch.distributed as dist

import shardwise as sw


def test_leaves_its_group():
    sw.init()  # a one-rank group in the pytest process, never shut down


def test_makes_its_own_group():  # as tests/test_compat.py's DDP test does
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.destroy_process_group()
"""


@pytest.mark.slow  # a pytest of its own (~5 s quiet, 18 s loaded)
def test_a_test_that_leaves_its_group_does_not_fail_the_next(tmp_path):
    """Catches the order-dependent failure: a test that called sw.init() in the pytest process and did not
    shut down (tests/test_cli_grammar.py's did) left the default group to the next test, and
    tests/test_compat.py's own init_process_group then failed ("initialize the default process group
    twice"). conftest's no_group_left_behind ends each test's group: two such tests, in that order,
    under this suite's conftest."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "test_order.py").write_text(ORDER)
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_order.py")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout[-3000:]


def _collect_on_rank_zero_alone():
    import gc

    if dist.get_rank() == 0:
        gc.collect()  # a later call's collection, at a time the other rank's objects live on
    return dist.get_rank()


def test_a_caught_refusal_does_not_stall_a_later_call(ranks):
    """Catches the 120 s stall of Note [collect before the group goes] (harness.py): a call that caught a
    refusal left a collective issued on one rank only; a later call's garbage collection on one rank then
    joined gloo's thread blocked on it until the group's timeout (120 s > this call's 60 s)."""
    from test_stepped_regather import _write_after_step

    for message in ranks.run(_write_after_step, 2, "zero2", "one rank"):
        assert "written on rank 1" in message, message
    assert ranks.run(_collect_on_rank_zero_alone, 2, timeout=60) == [0, 1]

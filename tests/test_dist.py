"""`sw.init()`: torchrun's environment, a single process, a half-set environment, the join of each attempt."""

import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.dist import _agree_token, _read_launch_env


@pytest.mark.parametrize("present", [("RANK",), ("RANK", "WORLD_SIZE"), ("MASTER_ADDR", "MASTER_PORT", "RANK")])
def test_half_set_environment_names_the_missing_variable(monkeypatch, present):
    """Catches a launch with RANK but no WORLD_SIZE (etc.) hanging or failing deep inside torch."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name in present:
        monkeypatch.setenv(name, "0" if name != "MASTER_ADDR" else "127.0.0.1")
    missing = {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} - set(present)
    with pytest.raises(sw.ShardwiseError) as info:
        _read_launch_env()
    for name in missing:
        assert name in str(info.value)


def test_bad_rank_values_are_named(monkeypatch):
    """Catches RANK=abc or RANK >= WORLD_SIZE getting past init."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "abc")
    with pytest.raises(sw.ShardwiseError, match="RANK='abc' is not an integer"):
        _read_launch_env()
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(sw.ShardwiseError, match="outside 0..WORLD_SIZE-1"):
        _read_launch_env()


def _single_process_init():
    dist.destroy_process_group()  # the harness formed one; start as a bare process would
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name)
    group = sw.init(timeout=30)
    again = sw.init()
    t = torch.ones(1)
    dist.all_reduce(t)
    return sw.get_rank(), sw.get_world_size(), group is again, dist.get_backend(), t.item()


def test_single_process_without_environment(ranks):
    """Catches `python train.py` (no torchrun) failing, or a second init() forming a new group."""
    assert ranks.run(_single_process_init, 1) == [(0, 1, True, "gloo", 1.0)]


def test_torchrun_launch_forms_the_group(tmp_path):
    """Catches init() misreading torchrun's variables (wrong rank, wrong world, no rendezvous)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist, shardwise as sw
        sw.init(timeout=60)
        t = torch.tensor([float(sw.get_rank() + 1)])
        dist.all_reduce(t)
        print(f"rank={sw.get_rank()} world={sw.get_world_size()} sum={t.item()}", flush=True)
        sw.shutdown()
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "rank=0 world=2 sum=3.0" in done.stdout and "rank=1 world=2 sum=3.0" in done.stdout


def _join(store, world_size, ranks, wait_s):
    """Run `_agree_token` for `ranks` in threads on one store; each rank's token or its error."""
    deadline = time.monotonic() + wait_s

    def one(rank):
        try:
            return _agree_token(store, rank, world_size, deadline)
        except sw.ShardwiseError as error:
            return error

    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(one, ranks))


def test_each_attempt_agrees_on_a_token_no_earlier_attempt_wrote():
    """Catches a restarted group reading an earlier attempt's keys (the stale gloo addresses of
    Note [restart keys]): a second attempt on the same store must agree on a new token."""
    store = dist.HashStore()
    first = _join(store, 3, [0, 1, 2], 20)
    assert len(set(first)) == 1 and isinstance(first[0], str)
    second = _join(store, 3, [2, 1, 0], 20)  # the stale hello/welcome keys of the first are still there
    assert len(set(second)) == 1 and isinstance(second[0], str)
    assert second[0] != first[0]


def test_a_rank_that_never_joins_is_named_on_every_rank():
    """Catches a join that hangs, or fails without saying which rank is missing."""
    store = dist.HashStore()
    start = time.monotonic()
    results = _join(store, 3, [0, 1], 1.0)
    assert time.monotonic() - start < 10
    for error in results:
        assert isinstance(error, sw.ShardwiseError)
        assert "rank 2 of 3 did not join" in str(error)


def test_hand_launch_names_the_rank_that_never_came(tmp_path):
    """Catches a hand launch (rank 0 hosts the store) that fails with the store's own timeout
    ("1/2 clients joined") instead of naming the missing rank, or waits forever."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2", RANK="0",
               OMP_NUM_THREADS="1")
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    code = "import shardwise as sw\ntry:\n    sw.init(timeout=3)\nexcept sw.ShardwiseError as e:\n    print(e)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert "rank 1 of 2 did not join" in done.stdout, done.stdout + done.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

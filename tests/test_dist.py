"""`sw.init()`: torchrun's environment, a single process, a half-set environment."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.dist import _read_launch_env


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

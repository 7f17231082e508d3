"""Lightning with ShardwiseStrategy (Note [lightning integration]): a LightningModule holding GPT-2,
clipped and accumulated, trains as plain single-process Lightning does; its checkpoint resumes
exactly. Run under torchrun, as Lightning users launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
SCRIPT = Path(__file__).parent / "scripts" / "lightning_fit.py"


def _fit(world_size: int, out: Path, *args: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={world_size}", str(SCRIPT), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def _assert_same(got: dict, expected: dict, what: str) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), rtol=1e-5,
                               atol=1e-5, msg=f"{what}: losses")
    for name, value in expected["params"].items():
        torch.testing.assert_close(torch.tensor(got["params"][name]), torch.tensor(value), rtol=1e-5, atol=1e-5,
                                   msg=f"{what}: {name}")


def test_lightning_strategy_matches_one_process_and_resumes(tmp_path):
    """Catches Lightning's DDP wrap, its rank-local clipping (gradient_clip_val), accumulation that
    reduces wrongly, and a checkpoint holding rank 0's rows: zero3 at world size 2 for 3 steps equals
    plain Lightning on one process, and so does a resume from its checkpoint to step 5 (compared
    with plain Lightning resuming its own .ckpt: Lightning's resume is not its uninterrupted run)."""
    # plain Lightning's 3 steps, then its resume of its own .ckpt to step 5 by a fresh trainer in the same process
    plain = _fit(1, tmp_path / "plain.json", "--strategy", "none", "--save", str(tmp_path / "plain.ckpt"),
                 "--resume-to", "5", "--resumed-out", str(tmp_path / "plain5.json"))
    sharded = _fit(2, tmp_path / "sharded.json", "--strategy", "zero3", "--save", str(tmp_path / "ckpt"))
    assert len(plain["losses"]) == 6  # micro-batches
    _assert_same(sharded, plain, "3 steps")
    plain = json.loads((tmp_path / "plain5.json").read_text())
    resumed = _fit(2, tmp_path / "resumed.json", "--strategy", "zero3", "--max-steps", "5",
                   "--resume", str(tmp_path / "ckpt"))
    assert resumed["global_step"] == 5 and len(resumed["losses"]) == 4, resumed["losses"]
    _assert_same(resumed, plain, "resumed to step 5")


@pytest.mark.slow  # three torchrun launches of Lightning: about 40 s on a quiet machine
def test_lightning_muon_and_adamw_resume_bitwise(tmp_path):
    """Catches ShardwiseStrategy refusing a module with two optimizers (Muon + AdamW under manual
    optimization), or its checkpoint keeping one of them, or Muon's momenta of the matrices rank 0 owns
    only: the step after a resume from step 3 ends bitwise where the uninterrupted zero2 run's step 4 does
    (global_step counts both optimizers' steps: 6 and 8). Only one step is compared: Lightning resuming
    a checkpoint saved at an epoch's end replays that epoch's first batch (plain Lightning does too)."""
    straight = _fit(2, tmp_path / "straight.json", "--muon", "--strategy", "zero2", "--max-steps", "8")
    _fit(2, tmp_path / "first.json", "--muon", "--strategy", "zero2", "--max-steps", "6", "--save",
         str(tmp_path / "ckpt"))
    resumed = _fit(2, tmp_path / "resumed.json", "--muon", "--strategy", "zero2", "--max-steps", "8", "--resume",
                   str(tmp_path / "ckpt"))
    assert resumed["global_step"] == 8 and resumed["losses"] == straight["losses"][3:], resumed["losses"]
    assert resumed["params"] == straight["params"]
